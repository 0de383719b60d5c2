"""Every generate() feature users rely on behaves as without the head; unsupported settings fail clearly."""

import os
import subprocess
import sys

import pytest
import torch
from transformers import GenerationMixin, StoppingCriteria, StoppingCriteriaList, TextStreamer

import jetspec_hf
from jetspec_hf import JetSpecConfig, JetSpecDraftHead, tree_generate

from tiny_models import OracleTreeGenerator, tiny_head, tiny_target


@pytest.fixture(scope="module")
def qwen3():
    target = tiny_target("qwen3")
    return target, tiny_head(target)


class RecordingStreamer:
    def __init__(self):
        self.chunks, self.ended = [], 0

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended += 1


def test_streamer_receives_the_prompt_once_then_every_token(qwen3):
    target, head = qwen3
    ids = torch.tensor([[5, 6, 7]])
    plain_streamer, tree_streamer = RecordingStreamer(), RecordingStreamer()
    plain = target.generate(ids, max_new_tokens=12, streamer=plain_streamer)
    out = target.generate(ids, assistant_model=head, max_new_tokens=12, streamer=tree_streamer)
    assert torch.equal(out, plain)
    flatten = lambda chunks: [t for chunk in chunks for t in chunk]  # noqa: E731
    assert tree_streamer.chunks[0] == [5, 6, 7] and plain_streamer.chunks[0] == [5, 6, 7]
    assert flatten(tree_streamer.chunks) == flatten(plain_streamer.chunks) == out[0].tolist()
    assert tree_streamer.ended == plain_streamer.ended == 1


def test_text_streamer_and_stop_strings_give_the_same_text(chat_tokenizer, capsys):
    target = tiny_target("llama", vocab_size=len(chat_tokenizer))
    head = tiny_head(target)
    ids = chat_tokenizer("Hello there! How are you", return_tensors="pt").input_ids
    free = target.generate(ids, max_new_tokens=30, eos_token_id=None)
    text = chat_tokenizer.decode(free[0, ids.shape[1] :])
    stop = text.strip()[6:9]  # a string that appears in the middle of the free-running text
    settings = dict(max_new_tokens=30, eos_token_id=None, stop_strings=[stop], tokenizer=chat_tokenizer)
    plain = target.generate(ids, **settings, streamer=TextStreamer(chat_tokenizer, skip_prompt=True))
    plain_text = capsys.readouterr().out
    out = target.generate(
        ids, assistant_model=head, **settings, streamer=TextStreamer(chat_tokenizer, skip_prompt=True)
    )
    assert torch.equal(out, plain) and out.shape[1] < free.shape[1]
    assert capsys.readouterr().out == plain_text and stop in plain_text


def test_return_dict_with_scores_and_logits(qwen3):
    target, head = qwen3
    ids = torch.tensor([[9, 8, 7, 6]])
    settings = dict(
        max_new_tokens=10, return_dict_in_generate=True, output_scores=True, output_logits=True, repetition_penalty=1.4
    )
    plain = target.generate(ids, **settings)
    reference = plain.sequences[0].tolist()
    oracle = OracleTreeGenerator(reference, width=2, depth=4, seed=0)
    for out in (
        target.generate(ids, assistant_model=head, **settings),
        target.generate(ids, custom_generate=tree_generate, candidate_generator=oracle, **settings),
    ):
        assert type(out) is type(plain)
        assert torch.equal(out.sequences, plain.sequences)
        assert len(out.scores) == len(plain.scores) == len(out.logits) == 10
        for mine, theirs in zip(out.scores + out.logits, plain.scores + plain.logits):
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
        assert out.past_key_values.get_seq_length() == out.sequences.shape[1] - 1
    assert max(oracle.stats.accepted_lengths) > 1


def test_left_padding_and_attention_mask(qwen3):
    target, head = qwen3
    ids = torch.tensor([[0, 0, 0, 21, 22, 23, 24]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=15, eos_token_id=None, pad_token_id=0)
    unpadded = target.generate(ids[:, 3:], max_new_tokens=15, eos_token_id=None)
    assert torch.equal(plain[:, 3:], unpadded)  # the target itself ignores the padding
    out = target.generate(
        ids, attention_mask=mask, assistant_model=head, max_new_tokens=15, eos_token_id=None, pad_token_id=0
    )
    assert torch.equal(out, plain)
    oracle = OracleTreeGenerator(plain[0].tolist(), width=3, depth=4, seed=2)
    out = target.generate(
        ids,
        attention_mask=mask,
        custom_generate=tree_generate,
        candidate_generator=oracle,
        max_new_tokens=15,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert torch.equal(out, plain) and max(oracle.stats.accepted_lengths) > 1


class StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_eos_lists_stopping_criteria_and_max_length(qwen3):
    target, head = qwen3
    ids = torch.tensor([[30, 31, 32]])
    free = target.generate(ids, max_new_tokens=20, eos_token_id=None)[0, 3:].tolist()
    cases = [
        dict(eos_token_id=[free[5], free[9]]),
        dict(eos_token_id=None, stopping_criteria=StoppingCriteriaList([StopAfterToken(free[7])])),
        dict(eos_token_id=None, max_length=11),
        dict(eos_token_id=None, max_new_tokens=1),
    ]
    for case in cases:
        settings = {"max_new_tokens": 20, **case}
        plain = target.generate(ids, **settings)
        assert torch.equal(target.generate(ids, assistant_model=head, **settings), plain), case
        oracle = OracleTreeGenerator(ids[0].tolist() + free, width=2, depth=5, seed=4)
        out = target.generate(ids, custom_generate=tree_generate, candidate_generator=oracle, **settings)
        assert torch.equal(out, plain), case


def test_statistics_are_reachable_after_the_call(qwen3):
    target, head = qwen3
    out = target.generate(torch.tensor([[1, 2, 3]]), assistant_model=head, max_new_tokens=9, eos_token_id=None)
    stats = head.last_generate_stats
    assert stats.new_tokens == out.shape[1] - 3 == 9
    assert stats.target_forwards == 1 + len(stats.accepted_lengths) and stats.head_forwards >= 1
    assert sum(stats.accepted_lengths) == 9 - 1  # the prefill commits the first token
    assert stats.tau == pytest.approx(8 / len(stats.accepted_lengths))
    assert min(stats.draft_seconds, stats.verify_seconds, stats.accept_seconds, stats.build_seconds) > 0


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(num_beams=2), "num_beams"),
        (dict(num_return_sequences=2, do_sample=True), "num_return_sequences"),
        (dict(cache_implementation="static"), "StaticLayer"),
        (dict(return_dict_in_generate=True, output_attentions=True), "output_attentions"),
        (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
        (dict(tree_depth=9), "tree_depth=9"),
        (dict(tree_budget=0), "tree_budget"),
    ],
)
def test_unsupported_settings_are_named(qwen3, settings, message):
    target, head = qwen3
    with pytest.raises(ValueError, match=message):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=head, max_new_tokens=5, **settings)


def test_batches_are_refused_before_any_work(qwen3):
    target, head = qwen3
    with pytest.raises(ValueError, match="batch size 1"):
        target.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), assistant_model=head, max_new_tokens=5)


def test_sliding_window_beyond_the_window_is_refused():
    target = tiny_target("mistral", sliding_window=16)
    with pytest.raises(ValueError, match="sliding-window"):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=tiny_head(target), max_new_tokens=10)


def make_head(**overrides):
    config = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_target_layers=4,
        target_layer_ids=[0, 2],
        mask_token_id=95,
        block_size=4,
    )
    return JetSpecDraftHead(JetSpecConfig(**{**config, **overrides})).eval()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden_size=64), "hidden size: head 64, target 32"),
        (dict(vocab_size=100, mask_token_id=99), "vocabulary size: head 100, target 96"),
        (dict(num_target_layers=6), "number of target layers"),
        (dict(target_layer_ids=[0, 3]), r"target_layer_ids \[3\] out of range"),
        (dict(mask_token_id=None), "mask_token_id is missing"),
        (dict(mask_token_id=200), "mask_token_id 200 is outside"),
    ],
)
def test_a_head_for_another_target_is_refused_naming_the_mismatch(qwen3, overrides, message):
    target, _ = qwen3
    calls = []
    original_forward = target.forward
    target.forward = lambda *a, **k: calls.append(1) or original_forward(*a, **k)
    try:
        with pytest.raises(ValueError, match=message):
            target.generate(torch.tensor([[1, 2, 3]]), assistant_model=make_head(**overrides), max_new_tokens=5)
    finally:
        del target.forward
    assert calls == []  # refused before any forward


def test_flash_attention_targets_are_refused(qwen3):
    target, head = qwen3
    target.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="set_attn_implementation"):
            target.generate(torch.tensor([[1, 2, 3]]), assistant_model=head, max_new_tokens=5)
    finally:
        target.config._attn_implementation = "sdpa"


def test_other_assistants_and_plain_calls_are_untouched(qwen3):
    target, _ = qwen3
    ids = torch.tensor([[40, 41, 42]])
    plain = target.generate(ids, max_new_tokens=10)
    small = tiny_target("qwen3", seed=1)
    assert torch.equal(target.generate(ids, assistant_model=small, max_new_tokens=10), plain)
    assert torch.equal(target.generate(ids, prompt_lookup_num_tokens=2, max_new_tokens=10), plain)
    with pytest.raises(
        ValueError, match="tree_budget"
    ):  # tree settings without a JetSpec head are not silently dropped
        target.generate(ids, max_new_tokens=10, tree_budget=8)


def test_the_hook_is_idempotent_and_can_be_removed(qwen3):
    target, head = qwen3
    ids = torch.tensor([[40, 41, 42]])
    wrapped = GenerationMixin.generate
    jetspec_hf.install_generate_hook()
    assert GenerationMixin.generate is wrapped
    jetspec_hf.uninstall_generate_hook()
    try:
        assert GenerationMixin.generate is wrapped._jetspec_original
        # without the hook, transformers' assisted path does not know what to do with a JetSpec head...
        with pytest.raises(Exception):
            target.generate(ids, assistant_model=head, max_new_tokens=5)
        # ...and the same loop is reachable explicitly
        generator = jetspec_hf.JetSpecCandidateGenerator(head, target, tree_budget=8, tree_width=2, tree_depth=3)
        out = target.generate(ids, custom_generate=tree_generate, candidate_generator=generator, max_new_tokens=5)
        assert torch.equal(out, target.generate(ids, max_new_tokens=5))
    finally:
        jetspec_hf.install_generate_hook()
    assert GenerationMixin.generate is not wrapped._jetspec_original


def test_environment_variable_disables_the_hook():
    code = "import jetspec_hf, transformers; print(hasattr(transformers.GenerationMixin.generate, '_jetspec_original'))"
    env = {**os.environ, "JETSPEC_HF_NO_GENERATE_HOOK": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("causal", [True, False])
def test_transformers_own_dflash_chain_mode_serves_the_head(causal):
    target = tiny_target("qwen3")
    head = tiny_head(target, causal=causal)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    plain = target.generate(ids, max_new_tokens=16, eos_token_id=None)
    out = target.generate(ids, assistant_model=head, speculation_type="dflash", max_new_tokens=16, eos_token_id=None)
    assert torch.equal(out, plain)
    assert not hasattr(head, "last_generate_stats")  # transformers ran its own chain loop, not ours
