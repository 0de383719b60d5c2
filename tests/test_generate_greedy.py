"""Greedy tree decoding is token-identical to plain `generate()` on every supported architecture and setting."""

import pytest
import torch

from jetspec_hf import tree_generate

from tiny_models import TARGETS, OracleTreeGenerator, tiny_head, tiny_target

ATTENTION = [
    (arch, attn) for arch in TARGETS for attn in ("eager", "sdpa") if not (arch == "gemma2" and attn == "sdpa")
]


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (1, int(torch.randint(1, 12, (1,), generator=g))), generator=g) for _ in range(n)]


@pytest.mark.parametrize("arch,attn", ATTENTION)
def test_head_and_oracle_trees_match_plain_greedy(arch, attn):
    target = tiny_target(arch, attn)
    head = tiny_head(target)
    for i, ids in enumerate(prompts(4, seed=hash(arch) % 1000)):
        max_new = [1, 2, 9, 25][i]
        plain = target.generate(ids, max_new_tokens=max_new, do_sample=False)
        # a randomly initialised head: mostly rejections
        assert torch.equal(target.generate(ids, assistant_model=head, max_new_tokens=max_new, do_sample=False), plain)
        # trees that hold the true continuation at random ranks among distractors: multi-token acceptance
        oracle = OracleTreeGenerator(plain[0].tolist(), width=3, depth=4, miss_rate=0.2, seed=i)
        out = target.generate(ids, custom_generate=tree_generate, candidate_generator=oracle, max_new_tokens=max_new)
        assert torch.equal(out, plain)
        if max_new > 2 and plain.shape[1] - ids.shape[1] > 4:
            assert max(oracle.stats.accepted_lengths) > 1  # acceptance really happened


PROCESSOR_SETTINGS = {
    "repetition_penalty": dict(repetition_penalty=1.5),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "min_new_tokens": dict(min_new_tokens=12),
    "bad_words_ids": dict(bad_words_ids=[[5], [7, 8]]),
    "sequence_bias": dict(sequence_bias={(9,): 4.0, (10, 11): -3.0}),
    "suppress_tokens": dict(suppress_tokens=[12, 13]),
    "begin_suppress_tokens": dict(begin_suppress_tokens=[14]),
    "forced_eos_token_id": dict(forced_eos_token_id=2),
}


@pytest.mark.parametrize("name", sorted(PROCESSOR_SETTINGS))
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_logits_processors_apply_to_each_node_with_its_own_path(arch, name):
    target = tiny_target(arch)
    head = tiny_head(target)
    settings = dict(max_new_tokens=16, do_sample=False, **PROCESSOR_SETTINGS[name])
    # repeat a short pattern in the prompt so penalties and n-gram bans actually bite
    for ids in [torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7]]), *prompts(2, seed=3)]:
        plain = target.generate(ids, **settings)
        assert torch.equal(target.generate(ids, assistant_model=head, **settings), plain)
        oracle = OracleTreeGenerator(plain[0].tolist(), width=2, depth=5, seed=1)
        assert torch.equal(
            target.generate(ids, custom_generate=tree_generate, candidate_generator=oracle, **settings), plain
        )


def test_causal_and_bidirectional_heads_and_tree_shapes():
    target = tiny_target("qwen3")
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    for causal in (True, False):
        head = tiny_head(target, causal=causal)
        for budget, width, depth in [(1, 1, 5), (6, 1, 5), (8, 2, 3), (40, 4, 5), (3, 7, 0)]:
            out = target.generate(
                ids, assistant_model=head, max_new_tokens=20, tree_budget=budget, tree_width=width, tree_depth=depth
            )
            assert torch.equal(out, plain)
            assert max(head.last_generate_stats.tree_sizes) <= budget


def test_bf16_head_drafts_in_bf16_beside_an_fp32_target():
    """A head loaded in bf16 drafts in bf16 (its own bf16 copy of the lm_head); the output stays plain greedy's."""
    from transformers import LogitsProcessorList

    from jetspec_hf import JetSpecCandidateGenerator

    target = tiny_target("llama")
    head32 = tiny_head(target)
    head16 = tiny_head(target).to(torch.bfloat16)
    drafts = {}
    for name, head in (("fp32", head32), ("bf16", head16)):
        generator = JetSpecCandidateGenerator(head, target, tree_budget=8, tree_width=2, tree_depth=4)
        assert generator.draft_projection[0].dtype == head.dtype
        context = torch.randn(5, 2 * target.config.hidden_size, generator=torch.Generator().manual_seed(0))
        generator.extend_context(context)
        drafts[name] = generator.draft(torch.tensor([[5, 6, 7, 8, 9]]), LogitsProcessorList(), max_depth=4)
    assert drafts["bf16"].dtype == torch.float32
    torch.testing.assert_close(drafts["bf16"], drafts["fp32"], atol=0.1, rtol=0.05)  # bf16 rounding only
    assert target.get_output_embeddings().weight.dtype == torch.float32  # the target is left as it was
    for ids in prompts(3, seed=5):
        plain = target.generate(ids, max_new_tokens=12, do_sample=False)
        assert torch.equal(target.generate(ids, assistant_model=head16, max_new_tokens=12, do_sample=False), plain)


def test_fast_draft_dtype():
    from jetspec_hf import fast_draft_dtype

    native_bf16 = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert fast_draft_dtype(torch.float32, "cpu") == (torch.bfloat16 if native_bf16 else torch.float32)
    assert fast_draft_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    assert fast_draft_dtype(torch.float16, "cpu") == torch.float16
    assert fast_draft_dtype(torch.float32, "cuda") == torch.float32  # only CPUs switch: GPUs draft in the target's
