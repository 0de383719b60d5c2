"""Tests of jetspec_hf.training: the pure pieces, training/inference equivalence, the real Trainer on tiny targets."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import LogitsProcessorList
from transformers.cache_utils import DynamicCache

from jetspec_hf import JetSpecCandidateGenerator, JetSpecConfig, JetSpecDraftHead
from jetspec_hf.training import (
    JetSpecTrainer,
    JetSpecTrainingArguments,
    TreeTauCallback,
    acceptance_counts,
    acceptance_metrics,
    block_targets,
    gather_teacher_logits,
    jetspec_block_forward,
    jetspec_loss,
    position_weights,
    sample_anchors,
    teacher_positions,
    training_attention_mask,
    training_position_ids,
    valid_anchor_mask,
)

import tiny_models

REPO = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, LAYERS = 96, 32, 4
MASK_ID = VOCAB - 1


def tiny_target(kind: str = "llama", seed: int = 0, initializer_range: float = 0.2):
    """Unsharpened logits (logit_scale 1): the large initializer_range peaks the teacher distributions instead."""
    return tiny_models.tiny_target(
        kind, seed=seed, logit_scale=1.0, max_position_embeddings=256, initializer_range=initializer_range
    )


def tiny_head(causal: bool = True, block_size: int = 4, seed: int = 1, num_layers: int = 2) -> JetSpecDraftHead:
    torch.manual_seed(seed)
    config = JetSpecConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        block_size=block_size,
        num_target_layers=LAYERS,
        target_layer_ids=[0, 2],
        mask_token_id=MASK_ID,
        causal=causal,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    return JetSpecDraftHead(config)


def make_examples(n: int, seq_len: int = 20, prompt_len: int = 5, seed: int = 0) -> list[dict]:
    """Right-padded examples of varying length: prompt (loss 0), response (loss 1), padding."""
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(seq_len)
    examples = []
    for i in range(n):
        length = seq_len - 2 * (i % 3)
        attention_mask = (positions < length).long()
        input_ids = torch.randint(0, VOCAB - 1, (seq_len,), generator=generator).masked_fill(attention_mask == 0, 0)
        loss_mask = ((positions >= prompt_len) & (attention_mask == 1)).long()
        examples.append({"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask})
    return examples


def training_args(tmp_path, **overrides) -> JetSpecTrainingArguments:
    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        num_anchors=8,
        logging_steps=1,
        **tiny_models.CPU_TRAINING,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return JetSpecTrainingArguments(**kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# Anchors
# ---------------------------------------------------------------------------------------------------------------------


def test_valid_anchor_rule():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    valid = valid_anchor_mask(loss_mask)
    # response tokens followed by a response token; never the last position
    assert valid[0].nonzero().flatten().tolist() == [2, 3, 6]
    assert valid[1].nonzero().flatten().tolist() == list(range(1, 9))


def test_sample_anchors_valid_sorted_padded_reproducible():
    loss_mask = torch.zeros(3, 30, dtype=torch.long)
    loss_mask[0, 5:25] = 1  # 19 valid anchors
    loss_mask[1, 10:14] = 1  # 3 valid anchors -> padded
    # row 2: nothing valid -> all disabled
    anchors, keep = sample_anchors(loss_mask, 8, 4, torch.Generator().manual_seed(0))
    assert anchors.shape == keep.shape == (3, 8) and anchors.dtype == torch.long and keep.dtype == torch.bool
    assert keep[0].all() and keep[1].tolist() == [True] * 3 + [False] * 5 and not keep[2].any()
    assert anchors[1, :3].tolist() == [10, 11, 12]
    valid = valid_anchor_mask(loss_mask)
    for row in range(3):
        kept = anchors[row][keep[row]]
        assert valid[row, kept].all()
        assert kept.tolist() == sorted(set(kept.tolist()))  # sorted, without replacement
    again, _ = sample_anchors(loss_mask, 8, 4, torch.Generator().manual_seed(0))
    other, _ = sample_anchors(loss_mask, 8, 4, torch.Generator().manual_seed(1))
    assert torch.equal(anchors, again) and not torch.equal(anchors, other)
    # N shrinks to the largest valid count of the batch
    anchors, keep = sample_anchors(loss_mask[1:], 512, 4, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 3)


def test_sample_anchors_uniform():
    loss_mask = torch.zeros(1, 12, dtype=torch.long)
    loss_mask[0, 1:11] = 1  # valid anchors 1..9
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(12)
    draws = 3000
    for _ in range(draws):
        anchors, _ = sample_anchors(loss_mask, 3, 4, generator)
        counts[anchors[0]] += 1
    freq = counts / draws
    assert freq[0] == 0 and freq[10] == 0 and freq[11] == 0
    assert torch.allclose(freq[1:10], torch.full((9,), 3 / 9), atol=0.04)


# ---------------------------------------------------------------------------------------------------------------------
# Mask and positions
# ---------------------------------------------------------------------------------------------------------------------

NEG = torch.finfo(torch.float32).min


def visible(mask: torch.Tensor) -> torch.Tensor:
    return mask == 0


@pytest.mark.parametrize("causal", [True, False])
def test_training_mask_context_block_and_isolation(causal):
    seq_len, bs = 10, 4
    anchors = torch.tensor([[3, 6]])
    keep = torch.tensor([[True, True]])
    mask = training_attention_mask(anchors, keep, seq_len, bs, causal, torch.float32)
    assert mask.shape == (1, 1, 2 * bs, seq_len + 2 * bs) and mask.dtype == torch.float32
    assert set(mask.unique().tolist()) <= {0.0, NEG}
    see = visible(mask[0, 0])
    for block, p in enumerate([3, 6]):
        for k in range(bs):
            row = see[block * bs + k]
            # context: exactly the rows strictly before the anchor (p itself is NOT visible)
            assert row[:seq_len].nonzero().flatten().tolist() == list(range(p))
            own = row[seq_len + block * bs : seq_len + (block + 1) * bs]
            expected = [j <= k for j in range(bs)] if causal else [True] * bs
            assert own.tolist() == expected
            other = torch.cat([row[seq_len : seq_len + block * bs], row[seq_len + (block + 1) * bs :]])
            assert not other.any()


def test_training_mask_disabled_blocks_padding_and_no_empty_rows():
    seq_len, bs = 8, 3
    anchors = torch.tensor([[2, 0], [5, 6]])
    keep = torch.tensor([[True, False], [True, True]])
    padding = torch.ones(2, seq_len, dtype=torch.long)
    padding[1, 1] = 0  # a padded context row (left-padding style)
    mask = training_attention_mask(anchors, keep, seq_len, bs, True, torch.bfloat16, padding_mask=padding)
    assert mask.dtype == torch.bfloat16
    see = visible(mask[:, 0])
    assert see.any(-1).all()  # no fully masked row
    disabled = see[0, bs : 2 * bs]
    assert not disabled[:, :seq_len].any()  # a disabled block sees no context
    assert disabled[:, seq_len + bs : seq_len + 2 * bs].tolist() == [[j <= k for j in range(bs)] for k in range(bs)]
    assert see[1, 0, :seq_len].tolist() == [True, False, True, True, True, False, False, False]
    # softmax over the additive mask stays finite
    scores = torch.randn(2, 1, 2 * bs, seq_len + 2 * bs) + mask.float()
    assert torch.isfinite(scores.softmax(-1)).all()


def test_training_position_ids():
    anchors = torch.tensor([[2, 5]])
    positions = training_position_ids(anchors, 8, 3)
    assert positions.tolist() == [list(range(8)) + [2, 3, 4, 5, 6, 7]]
    base = torch.tensor([[0, 0, 0, 1, 2, 3]])  # left padding by 2
    assert training_position_ids(torch.tensor([[4]]), 6, 2, base).tolist() == [[0, 0, 0, 1, 2, 3, 2, 3]]


# ---------------------------------------------------------------------------------------------------------------------
# Labels, teacher alignment, weights, losses, metrics
# ---------------------------------------------------------------------------------------------------------------------


def test_block_targets():
    seq_len, bs = 12, 5
    input_ids = torch.arange(100, 100 + seq_len)[None]
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1]])  # two responses with a prompt between
    anchors = torch.tensor([[2, 4, 9, 10, 0]])
    keep = torch.tensor([[True, True, True, True, False]])
    labels, valid = block_targets(input_ids, loss_mask, anchors, keep, bs)
    assert labels.shape == valid.shape == (1, 5, bs - 1)
    assert labels[0, 0].tolist() == [103, 104, 105, -100] and valid[0, 0].tolist() == [True, True, True, False]
    # anchor 4: 5 is a response token, 6-7 the prompt between, 8 the next response: a block never re-enters it
    assert valid[0, 1].tolist() == [True, False, False, False] and labels[0, 1].tolist() == [105, -100, -100, -100]
    assert valid[0, 2].tolist() == [True, True, False, False]  # 10, 11 in range, 12+ past the end
    assert valid[0, 3].tolist() == [True, False, False, False]
    assert not valid[0, 4].any() and (labels[0, 4] == -100).all()  # disabled block


def test_teacher_alignment():
    batch, seq_len, bs = 2, 16, 5
    t = torch.arange(seq_len)
    token_of_position = (7 * t + 3) % VOCAB
    logits = torch.full((batch, seq_len, VOCAB), -5.0)
    logits[:, t, token_of_position] = 5.0  # argmax at position t is a known function of t
    anchors = torch.tensor([[1, 6, 11], [0, 3, 13]])
    teacher = gather_teacher_logits(logits, anchors, bs)
    assert teacher.shape == (batch, 3, bs - 1, VOCAB)
    for b in range(batch):
        for n, p in enumerate(anchors[b].tolist()):
            for k in range(1, bs):
                expected = token_of_position[min(p + k - 1, seq_len - 1)]  # slot k <- position p+k-1, not p+k
                assert teacher[b, n, k - 1].argmax() == expected
    assert teacher_positions(torch.tensor([[3]]), 4, 10).tolist() == [[[3, 4, 5]]]


def test_position_weights():
    assert torch.equal(position_weights(5, 0.0), torch.ones(4))
    weights = position_weights(5, 2.0)
    assert torch.allclose(weights, torch.exp(-torch.arange(4.0) / 2.0)) and weights[0] == 1


def test_losses_on_hand_computable_tensors():
    torch.manual_seed(0)
    student = torch.randn(2, 3, 4, 11)
    teacher = torch.randn(2, 3, 4, 11)
    labels = torch.randint(0, 11, (2, 3, 4))
    valid = torch.rand(2, 3, 4) > 0.3
    # forward KL of identical distributions is 0
    assert jetspec_loss(student, student.clone(), labels, valid, loss_type="fkl").abs() < 1e-6
    # forward KL = sum p (log p - log q), with T^2 on tempered distributions
    for temperature in (1.0, 2.0):
        log_p = F.log_softmax(teacher / temperature, -1)
        log_q = F.log_softmax(student / temperature, -1)
        fkl = (log_p.exp() * (log_p - log_q)).sum(-1)[valid].mean() * temperature**2
        rkl = (log_q.exp() * (log_q - log_p)).sum(-1)[valid].mean() * temperature**2
        got = jetspec_loss(student, teacher, labels, valid, loss_type="fkl", temperature=temperature)
        assert torch.allclose(got, fkl, atol=1e-6)
        assert torch.allclose(
            F.kl_div(log_q[valid], log_p[valid], log_target=True, reduction="batchmean") * temperature**2,
            got,
            atol=1e-6,
        )
        got = jetspec_loss(student, teacher, labels, valid, loss_type="rkl", temperature=temperature)
        assert torch.allclose(got, rkl, atol=1e-6)
    # SFT is cross-entropy on the labels at valid positions
    sft = jetspec_loss(student, None, labels, valid, loss_type="sft")
    assert torch.allclose(sft, F.cross_entropy(student[valid], labels[valid]), atol=1e-6)
    # weighted mean over valid positions, normalised by the active weights
    weights = position_weights(5, 1.5)
    per_position = F.cross_entropy(student.flatten(0, 2), labels.flatten(), reduction="none").view(2, 3, 4)
    w = weights.expand(2, 3, 4)[valid]
    expected = (per_position[valid] * w).sum() / w.sum()
    assert torch.allclose(jetspec_loss(student, None, labels, valid, weights, loss_type="sft"), expected, atol=1e-6)
    # garbage at invalid positions does not leak; no valid position -> 0 with a (zero) gradient
    dirty = student.clone()
    dirty[~valid] = float("inf")
    assert torch.allclose(jetspec_loss(dirty, teacher, labels, valid), jetspec_loss(student, teacher, labels, valid))
    leaf = student.clone().requires_grad_(True)
    empty = jetspec_loss(leaf, teacher, labels, torch.zeros_like(valid))
    empty.backward()
    assert empty.item() == 0 and leaf.grad is not None and (leaf.grad == 0).all()
    with pytest.raises(ValueError, match="loss_type"):
        jetspec_loss(student, teacher, labels, valid, loss_type="kl")


def test_acceptance_metrics():
    metrics = acceptance_metrics(torch.tensor([8, 4, 0]), torch.tensor([10, 8, 5]))
    assert metrics["acc_depth_1"] == pytest.approx(0.8) and metrics["acc_depth_2"] == pytest.approx(0.5)
    assert metrics["acc_depth_3"] == 0.0
    assert metrics["expected_accept_len"] == pytest.approx(1 + 0.8 + 0.8 * 0.5)
    assert metrics["num_blocks"] == 10
    assert acceptance_metrics([0], [0]) == {"acc_depth_1": 0.0, "expected_accept_len": 1.0, "num_blocks": 0.0}
    student = torch.zeros(1, 2, 2, 5)
    teacher = torch.zeros(1, 2, 2, 5)
    student[..., 1] = 1
    teacher[0, 0, :, 1] = 1
    teacher[0, 1, :, 2] = 1
    hits, counts = acceptance_counts(student, teacher, torch.tensor([[[True, True], [True, False]]]))
    assert hits.tolist() == [1, 1] and counts.tolist() == [2, 1]


# ---------------------------------------------------------------------------------------------------------------------
# Training forward == inference forward
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,causal", [("llama", True), ("llama", False), ("qwen3", True)])
def test_packed_training_forward_matches_inference_draft(kind, causal):
    """The key check: one packed training forward over several blocks gives, for every anchor, what the inference
    loop (`JetSpecCandidateGenerator.draft`, with its context cache carried across steps) computes for it."""
    target, head = tiny_target(kind), tiny_head(causal=causal).eval()
    bs = head.config.block_size
    input_ids = torch.randint(0, VOCAB - 1, (1, 22), generator=torch.Generator().manual_seed(3))
    anchor_list = [5, 9, 13, 20]  # 20: the last slots run past the end of the sequence
    anchors = torch.tensor([anchor_list])
    with torch.no_grad():
        packed = jetspec_block_forward(head, target, input_ids, anchors, torch.ones_like(anchors, dtype=torch.bool))
        full = target(input_ids, output_hidden_states=True)
    taps = [layer + 1 for layer in head.config.target_layer_ids]
    rows = torch.cat([full.hidden_states[t][0] for t in taps], dim=-1)  # [S, taps * H]

    # 1. the head call exactly as `draft` makes it, for the first anchor: slot hidden states
    p = anchor_list[0]
    block_ids = torch.full((1, bs), MASK_ID)
    block_ids[0, 0] = input_ids[0, p]
    with torch.no_grad():
        out = head(
            target.get_input_embeddings()(block_ids),
            rows[:p][None],
            position_ids=torch.arange(p + bs)[None],
            past_key_values=DynamicCache(),
            use_cache=True,
        )
    torch.testing.assert_close(packed["slot_hidden"][0, 0], out.last_hidden_state[0], atol=1e-5, rtol=0)

    # 2. the real inference drafter, context cache carried from anchor to anchor
    drafter = JetSpecCandidateGenerator(head, target, tree_budget=8, tree_width=2, tree_depth=bs - 1)
    previous = 0
    for n, p in enumerate(anchor_list):
        drafter.extend_context(rows[previous:p])
        previous = p
        draft_logprobs = drafter.draft(input_ids[:, : p + 1], LogitsProcessorList(), bs - 1)
        torch.testing.assert_close(
            draft_logprobs, torch.log_softmax(packed["student_logits"][0, n], dim=-1), atol=1e-5, rtol=0
        )
    # teacher logits come from position p + k - 1 of the same target forward
    torch.testing.assert_close(packed["teacher_logits"][0, 1, 2], full.logits[0, 9 + 2], atol=1e-6, rtol=0)


def test_packed_forward_batch_rows_and_disabled_blocks_are_independent():
    """A batch gives each row what that row alone gives; disabled padding blocks change nothing for kept ones."""
    target, head = tiny_target("qwen3"), tiny_head().eval()
    ids = torch.randint(0, VOCAB - 1, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        batch = jetspec_block_forward(
            head, target, ids, torch.tensor([[3, 8, 12], [5, 0, 0]]), torch.tensor([[True] * 3, [True, False, False]])
        )
        row0 = jetspec_block_forward(
            head, target, ids[:1], torch.tensor([[3, 8, 12]]), torch.ones(1, 3, dtype=torch.bool)
        )
        row1 = jetspec_block_forward(head, target, ids[1:], torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.bool))
    torch.testing.assert_close(batch["slot_hidden"][:1], row0["slot_hidden"], atol=1e-5, rtol=0)
    torch.testing.assert_close(batch["slot_hidden"][1:, :1], row1["slot_hidden"], atol=1e-5, rtol=0)
    assert not batch["valid"][1, 1:].any()


def test_packed_forward_left_padding_matches_unpadded():
    """Left padding: context pad rows are masked and positions count real tokens only, as at inference."""
    target, head = tiny_target(), tiny_head().eval()
    ids = torch.randint(0, VOCAB - 1, (1, 14), generator=torch.Generator().manual_seed(5))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    attention_mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 14, dtype=torch.long)], dim=1)
    keep = torch.ones(1, 2, dtype=torch.bool)
    with torch.no_grad():
        plain = jetspec_block_forward(head, target, ids, torch.tensor([[4, 9]]), keep)
        shifted = jetspec_block_forward(
            head, target, padded, torch.tensor([[7, 12]]), keep, attention_mask=attention_mask
        )
    torch.testing.assert_close(shifted["slot_hidden"], plain["slot_hidden"], atol=1e-5, rtol=0)
    torch.testing.assert_close(shifted["teacher_logits"], plain["teacher_logits"], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------------


def head_tensor_names(head) -> set[str]:
    return set(head.state_dict().keys())


def test_trainer_trains_only_the_head_and_saves_only_the_head(tmp_path):
    target, head = tiny_target(), tiny_head()
    target_before = {k: v.clone() for k, v in target.state_dict().items()}
    head_before = {k: v.clone() for k, v in head.state_dict().items()}
    data = make_examples(8)
    args = training_args(
        tmp_path / "run",
        max_steps=12,
        learning_rate=3e-3,
        eval_strategy="steps",
        eval_steps=6,
        save_strategy="steps",
        save_steps=6,
        load_best_model_at_end=True,
        metric_for_best_model="expected_accept_len",
        gradient_accumulation_steps=2,
    )
    trainer = JetSpecTrainer(head, args, train_dataset=data, eval_dataset=data, target_model=target)
    assert trainer.loss_is_scaled_for_ga is False and trainer.model_accepts_loss_kwargs is False
    optimized = {id(p) for group in trainer.create_optimizer().param_groups for p in group["params"]}
    assert optimized == {id(p) for p in head.parameters()}

    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    expected_keys = {f"eval_acc_depth_{d}" for d in range(1, 4)} | {"eval_expected_accept_len", "eval_loss"}
    assert expected_keys <= set(after)
    assert 1.0 <= after["eval_expected_accept_len"] <= 4.0
    assert after["eval_loss"] < 0.8 * before["eval_loss"], (before, after)
    assert after["eval_expected_accept_len"] >= before["eval_expected_accept_len"], (before, after)
    assert trainer.state.best_metric is not None  # metric_for_best_model was found

    # gradients reach only the head; the target is untouched
    assert all(p.grad is None and not p.requires_grad for p in target.parameters())
    assert all(torch.equal(v, target_before[k]) for k, v in target.state_dict().items())
    assert any(not torch.equal(v, head_before[k]) for k, v in head.state_dict().items())

    # checkpoints and save_model hold the head only, and load back
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    for directory in [out, *sorted((tmp_path / "run").glob("checkpoint-*"))]:
        assert (directory / "config.json").exists()
        assert not list(directory.glob("*.bin")) or {p.name for p in directory.glob("*.bin")} <= {
            "training_args.bin",
            "optimizer.bin",
            "scheduler.bin",
            "rng_state.bin",
        }
        with safe_open(directory / "model.safetensors", "pt") as f:
            names = set(f.keys())
        assert names == head_tensor_names(head), directory
        assert not any(n.startswith(("model.", "lm_head")) for n in names)
    loaded = JetSpecDraftHead.from_pretrained(out)
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in loaded.state_dict().items())
    assert loaded.config.block_size == head.config.block_size and loaded.config.causal


def test_trainer_sft_and_bf16(tmp_path):
    target, head = tiny_target("qwen3"), tiny_head(num_layers=1)
    args = training_args(tmp_path, max_steps=2, bf16=True, loss_type="sft", gamma=2.0)
    trainer = JetSpecTrainer(
        head, args, train_dataset=make_examples(4), eval_dataset=make_examples(2), target_model=target
    )
    result = trainer.train()
    assert math.isfinite(result.training_loss)
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and "eval_expected_accept_len" in metrics


def test_trainer_rejects_bad_setup(tmp_path):
    with pytest.raises(ValueError, match="loss_type"):
        training_args(tmp_path, loss_type="kl")
    head = tiny_head()
    head.config.mask_token_id = None
    with pytest.raises(ValueError, match="mask_token_id"):
        JetSpecTrainer(
            head, training_args(tmp_path, max_steps=1), train_dataset=make_examples(2), target_model=tiny_target()
        )


def test_trainer_defaults(tmp_path, chat_tokenizer):
    data_module = pytest.importorskip("jetspec_hf.data")
    args = JetSpecTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert args.remove_unused_columns is False
    assert (args.num_anchors, args.loss_type, args.kd_temperature, args.gamma) == (512, "fkl", 1.0, 0.0)
    trainer = JetSpecTrainer(
        tiny_head(), args, train_dataset=make_examples(2), processing_class=chat_tokenizer, target_model=tiny_target()
    )
    if hasattr(data_module, "JetSpecDataCollator"):  # a tokenizer gets the loss_mask-aware collator by default
        assert isinstance(trainer.data_collator, data_module.JetSpecDataCollator)


def test_gradient_accumulation_logs_the_mean_of_micro_batch_losses(tmp_path):
    micro_losses = []

    class Recording(JetSpecTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            micro_losses.append(loss.item())
            return loss

    args = training_args(tmp_path, max_steps=1, per_device_train_batch_size=1, gradient_accumulation_steps=2)
    trainer = Recording(tiny_head(), args, train_dataset=make_examples(4), target_model=tiny_target())
    trainer.train()
    assert len(micro_losses) == 2 and micro_losses[0] != micro_losses[1]  # two micro-batches, different anchors/data
    assert train_losses(trainer)[1] == pytest.approx(sum(micro_losses) / 2, rel=1e-4)


def train_losses(trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def test_resume_reproduces_losses(tmp_path):
    data = make_examples(8)

    def run(output_dir, resume=None):
        args = training_args(
            output_dir, max_steps=4, save_strategy="steps", save_steps=2, gradient_accumulation_steps=2
        )
        trainer = JetSpecTrainer(
            tiny_head(seed=7 if resume else 1), args, train_dataset=data, target_model=tiny_target()
        )
        trainer.train(resume_from_checkpoint=resume)
        return train_losses(trainer)

    full = run(tmp_path / "full")
    assert sorted(full) == [1, 2, 3, 4]
    resumed = run(tmp_path / "full_again", resume=str(tmp_path / "full" / "checkpoint-2"))
    # steps 1-2 come from the checkpoint's trainer state, steps 3-4 were trained again from checkpoint-2 (whose
    # head weights replaced the differently initialised head)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=1e-7), (full, resumed)


def test_ddp_two_processes(tmp_path):
    """Two processes, DDP with gloo on CPU, via torchrun (accelerate's `--cpu` launcher runs a single process
    without MPI). Both ranks must end with identical head weights; the saved head loads."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(REPO / "tests" / "ddp_train_script.py"),
        str(tmp_path),
    ]
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(rank["world_size"] == 2 for rank in ranks)
    assert ranks[0]["sha256"] == ranks[1]["sha256"]
    # evaluation gathers the acceptance counts of both ranks: every rank reports the same metrics
    assert ranks[0]["eval"]["eval_expected_accept_len"] == ranks[1]["eval"]["eval_expected_accept_len"]
    assert {"eval_loss", "eval_acc_depth_1", "eval_acc_depth_3"} <= set(ranks[0]["eval"])
    # 5 examples x 4 anchors: the duplicate that pads one rank's last batch is not counted
    assert ranks[0]["eval"]["eval_num_blocks"] == 20
    loaded = JetSpecDraftHead.from_pretrained(tmp_path / "final")
    with safe_open(tmp_path / "final" / "model.safetensors", "pt") as f:
        assert set(f.keys()) == head_tensor_names(loaded)


def test_ship_script_card_gives_every_stage_of_a_continued_run(tmp_path):
    """scripts/smollm2_ship_head.py (issue 4's shipping step) on three real Trainer runs, each warm-started from the
    one before (what smollm2_train.py --init-from does): the card reads every stage's recipe from its
    training_args.bin, and the shipped weights are the last stage's, in bf16."""
    target, head = tiny_target(), tiny_head()
    recipes = [(3, 1e-2, 4), (2, 5e-3, 6), (1, 2e-3, 8)]  # steps, learning rate, conversations
    runs = [tmp_path / f"stage{number}" for number in range(1, len(recipes) + 1)]
    for run, (steps, lr, conversations) in zip(runs, recipes):
        args = training_args(run, max_steps=steps, learning_rate=lr)
        trainer = JetSpecTrainer(head, args, train_dataset=make_examples(conversations), target_model=target)
        trainer.train()
        trainer.save_model(str(run))
        head = JetSpecDraftHead.from_pretrained(run)
    out = tmp_path / "shipped"
    earlier = [f"--continued-from={run}:{conversations}" for run, (_, _, conversations) in zip(runs, recipes)][:-1]
    command = [sys.executable, "scripts/smollm2_ship_head.py", runs[-1], "--out", out, "--conversations", "8", *earlier]
    result = subprocess.run(list(map(str, command)), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]

    card = (out / "README.md").read_text()
    assert "| Steps | 6 (3, then 2, then 1 continued) |" in card
    assert "| Conversations | 8 |" in card
    assert "lr 0.01 then 0.005 then 0.002, constant each, 0 warm-up steps" in card
    train = "THREADS=1 python scripts/smollm2_train.py"
    assert (
        f"{train} STAGE1 --limit 4 --max-steps 3 --lr 0.01; "
        f"{train} STAGE2 --limit 6 --init-from STAGE1 --max-steps 2 --lr 0.005; "
        f"{train} RUN_DIR --limit 8 --init-from STAGE2 --max-steps 1 --lr 0.002 |"
    ) in card
    shipped = JetSpecDraftHead.from_pretrained(out)
    for name, tensor in shipped.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, head.state_dict()[name].to(torch.bfloat16))


def test_tree_tau_callback_reports_generate_tau_as_a_metric(tmp_path):
    target, head = tiny_target(), tiny_head()
    data = make_examples(4)
    prompts = [torch.tensor([[1, 5, 9, 13, 17]]), torch.tensor([[2, 4, 6]])]
    callback = TreeTauCallback(target, prompts, max_new_tokens=10, tree_budget=6, tree_width=2)
    trainer = JetSpecTrainer(
        head, training_args(tmp_path), eval_dataset=data, target_model=target, callbacks=[callback]
    )
    metrics = trainer.evaluate()
    committed = steps = 0
    for ids in prompts:  # the same measurement done by hand through generate()
        target.generate(ids, assistant_model=head, max_new_tokens=10, do_sample=False, tree_budget=6, tree_width=2)
        committed += sum(head.last_generate_stats.accepted_lengths)
        steps += len(head.last_generate_stats.accepted_lengths)
    assert metrics["eval_tree_tau"] == pytest.approx(committed / steps)
    assert head.last_generate_stats.tree_sizes and max(head.last_generate_stats.tree_sizes) <= 6
