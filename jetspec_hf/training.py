"""Training a JetSpec draft head with the Hugging Face `Trainer` (method spec, section C).

One training step, for a batch of token sequences (prompt + target-regenerated response):

1. the *frozen* target runs once over the sequences (no grad) and gives the tapped hidden states of
   `config.target_layer_ids` (the head's context) and, when needed, its next-token logits (the teacher);
2. up to `num_anchors` anchors are sampled per sequence inside the response (`sample_anchors`);
3. each anchor `p` gets a block `[token at p, MASK x (block_size - 1)]`, embedded with the target's embedding table;
4. ONE head forward runs over `[context ; block_0 ; block_1 ; ...]` under the packed mask of
   `training_attention_mask` (slot `k` of the block at `p` sees context rows `< p` and its own block slots; nothing
   of other blocks) with positions from `training_position_ids` (context `j -> j`, slot `k -> p + k`);
5. the target's `lm_head` turns block slots `1..block_size-1` into draft logits; slot `k` is trained to predict the
   token at `p + k` (`block_targets`), the KD teacher for it being the target's logits at `p + k - 1`
   (`gather_teacher_logits`), with the weighted loss of `jetspec_loss`.

This is exactly what `jetspec_hf.generation.JetSpecCandidateGenerator.draft` computes at inference for one anchor
(context = taps of the positions before the anchor, block at the anchor), which the tests check.

The pure pieces are separate functions; [`JetSpecTrainer`] strings them together and keeps the target out of the
optimizer and out of every checkpoint (the `Trainer`'s `model` *is* the head).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging

from .routing import check_head_fits_target

logger = logging.get_logger(__name__)

LOSS_TYPES = ("fkl", "sft", "rkl")


# ---------------------------------------------------------------------------------------------------------------------
# Pure pieces
# ---------------------------------------------------------------------------------------------------------------------


def valid_anchor_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """Bool `[b, S]`: the positions that may anchor a training block.

    Rule: `p` is a valid anchor iff `loss_mask[p] == 1` **and** `p + 1 < S` **and** `loss_mask[p + 1] == 1`.

    Why `loss_mask[p]`: at inference the anchor is always a token the target generated (the last committed token), so
    the anchor lies in the response. The last prompt token never anchors a drafted block: the first response token is
    produced by the prefill forward itself.

    Why also `loss_mask[p + 1]` (stricter than DFlash's `p <= S - bs`): a block only trains through the slots whose
    token lies in the same uninterrupted response span as its anchor (see `block_targets`). If `p + 1` is not a loss
    position (`p` is the last response token: end of turn, end of sequence, or just before padding) the block has no
    trainable slot at all and would only burn compute and dilute the anchor budget. With the rule, every kept block
    has at least depth 1 to learn, and blocks that run past the end of the response still train their in-range slots
    (DFlash's `p <= S - bs` would drop the last `bs - 1` tokens of every response from ever being anchors).
    """
    lm = loss_mask.bool()
    valid = torch.zeros_like(lm)
    valid[:, :-1] = lm[:, :-1] & lm[:, 1:]
    return valid


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Draw block anchors: `(anchors [b, N] long, keep [b, N] bool)` on `loss_mask.device`.

    Valid anchors follow `valid_anchor_mask` (response token followed by a response token; this implies
    `p <= S - 2`, so at least one drafted slot is in range). Per sequence, `min(num_anchors, #valid)` of them are drawn
    uniformly at random *without replacement* (the largest i.i.d. uniform keys among the valid positions) and sorted
    ascending. `N = min(num_anchors, max over the batch of #valid)` (at least 1), so short batches do not pay for
    `num_anchors` blocks; sequences with fewer valid anchors get *disabled* padding blocks at the end
    (`keep=False`, anchor 0), which see only their own slots and carry no loss.

    `block_size` does not restrict anchors (blocks running past the response are trimmed by `block_targets`); it is
    taken for API symmetry and checked. The random keys are drawn on `generator`'s device (CPU when `None`), so the
    draw is the same whatever device the batch lives on.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    valid = valid_anchor_mask(loss_mask)
    batch, seq_len = valid.shape
    num = max(1, min(num_anchors, int(valid.sum(dim=1).max()) if seq_len else 0))
    key_device = generator.device if generator is not None else torch.device("cpu")
    keys = torch.rand(batch, seq_len, generator=generator, device=key_device).to(valid.device)
    keys = keys.masked_fill(~valid, -1.0)  # valid keys lie in [0, 1)
    if seq_len < num:  # degenerate (S <= 1): nothing is valid anyway
        keys = F.pad(keys, (0, num - seq_len), value=-1.0)
    top = keys.topk(num, dim=1)
    keep = top.values >= 0
    anchors = torch.where(keep, top.indices, torch.zeros_like(top.indices))
    # Kept anchors ascending, disabled blocks after them.
    order = torch.where(keep, anchors, anchors.new_full((), seq_len + 1)).argsort(dim=1, stable=True)
    return anchors.gather(1, order), keep.gather(1, order)


def training_attention_mask(
    anchors: torch.LongTensor,
    keep: torch.BoolTensor,
    seq_len: int,
    block_size: int,
    causal: bool,
    dtype: torch.dtype,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive float mask `[b, 1, N * bs, S + N * bs]` for ONE packed head forward over all blocks.

    Keys are `[context (S rows) ; block_0 ; block_1 ; ...]`, queries `[block_0 ; block_1 ; ...]`. Query slot `k` of the
    block anchored at `p` sees:

    - context rows `j < p` (strictly before the anchor: at inference the anchor's own hidden state does not exist
      yet), minus rows where `padding_mask` (`[b, S]`, 1 = real token) is 0;
    - its own block's slots `0..k` (`causal=True`, JetSpec) or all `bs` slots (`causal=False`, DFlash);
    - nothing of other blocks.

    A disabled block (`keep=False`) sees no context but still sees its own slots, so no row is fully masked (a fully
    masked row gives NaN in softmax); its loss is masked by `block_targets`. Kept masked entries hold
    `torch.finfo(dtype).min`.

    Memory is dense, `O(N * bs * (S + N * bs))` per sequence (512 anchors x 16 slots = 8192 query rows).
    """
    batch, num = anchors.shape
    device = anchors.device
    q_len = num * block_size
    query_block = torch.arange(q_len, device=device) // block_size
    query_slot = torch.arange(q_len, device=device) % block_size
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, Q]
    query_keep = keep.repeat_interleave(block_size, dim=1)
    see_context = torch.arange(seq_len, device=device)[None, None, :] < query_anchor[..., None]  # [b, Q, S]
    see_context &= query_keep[..., None]
    if padding_mask is not None:
        see_context &= padding_mask.to(device).bool()[:, None, :]
    see_block = query_block[:, None] == query_block[None, :]  # [Q, Q]
    if causal:
        see_block &= query_slot[None, :] <= query_slot[:, None]
    see = torch.cat([see_context, see_block.expand(batch, q_len, q_len)], dim=-1)[:, None]
    mask = torch.zeros(see.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~see, torch.finfo(dtype).min)


def training_position_ids(
    anchors: torch.LongTensor,
    seq_len: int,
    block_size: int,
    base_positions: torch.LongTensor | None = None,
) -> torch.LongTensor:
    """Positions `[b, S + N * bs]` of `[context ; blocks]`: context row `j` -> `j`, slot `k` of anchor `p` -> `p + k`.

    With `base_positions` (`[b, S]`, the target's own position ids, e.g. `cumsum(attention_mask) - 1` for left
    padding) context row `j` gets `base_positions[j]` and slot `k` gets `base_positions[p] + k`, which is what the
    inference loop does (it feeds only the real, unpadded rows, numbered from 0).
    """
    batch, num = anchors.shape
    if base_positions is None:
        base_positions = torch.arange(seq_len, device=anchors.device).expand(batch, seq_len)
    anchor_pos = base_positions.gather(1, anchors)
    block_pos = anchor_pos[..., None] + torch.arange(block_size, device=anchors.device)
    return torch.cat([base_positions, block_pos.reshape(batch, num * block_size)], dim=1)


def block_targets(
    input_ids: torch.LongTensor,
    loss_mask: torch.Tensor,
    anchors: torch.LongTensor,
    keep: torch.BoolTensor,
    block_size: int,
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Labels `[b, N, bs - 1]` (token at `p + k` for slot `k = 1..bs-1`, `-100` where invalid) and validity mask.

    Slot `k` of the block at `p` is valid iff the block is kept, `p + k < S`, and `loss_mask` is 1 on **every**
    position `p + 1 .. p + k`. The last condition is stricter than `loss_mask[p + k] == 1` alone: it only differs for
    blocks that leave the response and re-enter another one (multi-turn data: end of an assistant turn, user turn,
    next assistant turn). Such slots would teach the head to predict a later assistant turn across a user turn it
    never sees, which never happens at inference (drafting stops at end of turn), so they are dropped.
    """
    seq_len = input_ids.shape[1]
    positions = anchors[..., None] + torch.arange(1, block_size, device=anchors.device)  # [b, N, bs-1]
    in_range = positions < seq_len
    flat = positions.clamp(max=seq_len - 1).flatten(1)
    labels = input_ids.gather(1, flat).view_as(positions)
    in_loss = loss_mask.bool().gather(1, flat).view_as(positions) & in_range
    valid = in_loss.long().cumprod(dim=-1).bool() & keep[..., None]
    return labels.masked_fill(~valid, -100), valid


def teacher_positions(anchors: torch.LongTensor, block_size: int, seq_len: int) -> torch.LongTensor:
    """Sequence positions `[b, N, bs - 1]` of the teacher logits of slots `1..bs-1`: `p + k - 1` (clamped in range).

    The target's logits at `p + k - 1` are its prediction of the token at `p + k` from the ground-truth prefix, the
    same target as slot `k`'s. Logits at `p + k` would be off by one. Out-of-range positions are clamped and are
    always invalid slots.
    """
    positions = anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)
    return positions.clamp(max=seq_len - 1)


def gather_teacher_logits(target_logits: torch.Tensor, anchors: torch.LongTensor, block_size: int) -> torch.Tensor:
    """Teacher logits `[b, N, bs - 1, V]` from full target logits `[b, S, V]`: slot `k` <- position `p + k - 1`."""
    batch, seq_len, _ = target_logits.shape
    positions = teacher_positions(anchors, block_size, seq_len)
    rows = torch.arange(batch, device=target_logits.device)[:, None]
    picked = target_logits[rows, positions.flatten(1).to(target_logits.device)]
    return picked.view(*positions.shape, target_logits.shape[-1])


def position_weights(
    block_size: int, gamma: float, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Per-slot weights `[bs - 1]` for slots `k = 1..bs-1`: `w_k = exp(-(k - 1) / gamma)`; `gamma = 0` -> all 1.

    Slot 1 always weighs 1 (SpecForge's convention); because `jetspec_loss` divides by the sum of the active
    weights, `exp(-k / gamma)` would give the same loss.
    """
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    k = torch.arange(1, block_size, device=device, dtype=dtype)
    if gamma == 0:
        return torch.ones_like(k)
    return torch.exp(-(k - 1) / gamma)


def jetspec_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    labels: torch.LongTensor,
    valid: torch.BoolTensor,
    weights: torch.Tensor | None = None,
    loss_type: str = "fkl",
    temperature: float = 1.0,
) -> torch.Tensor:
    """Weighted mean of the per-position loss over valid positions.

    Args:
        student_logits: `[..., V]` draft logits (e.g. `[b, N, bs - 1, V]`).
        teacher_logits: `[..., V]` target logits aligned with them (`gather_teacher_logits`); unused for `"sft"`.
        labels: `[...]` tokens (for `"sft"`; entries at invalid positions are ignored, `-100` is fine).
        valid: `[...]` bool, positions that carry loss.
        weights: broadcastable to `valid.shape` (e.g. `position_weights(...)` of shape `[bs - 1]`); `None` = 1.
        loss_type: `"fkl"`: `T^2 * KL(softmax(z_t / T) || softmax(z_s / T))` (forward KL, the default);
            `"rkl"`: `T^2 * KL(softmax(z_s / T) || softmax(z_t / T))` (reverse KL, reported harmful: ablation only);
            `"sft"`: cross-entropy of the student on `labels` (no temperature).
        temperature: KD temperature `T`.

    Returns:
        `sum(w * L * valid) / sum(w * valid)`, a scalar in float32. With no valid position it is 0 and still
        connected to `student_logits` (zero gradient), so every process of a distributed run backpropagates.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    student = student_logits.float()
    if loss_type == "sft":
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
        per_position = F.cross_entropy(student.flatten(0, -2), safe_labels.flatten(), reduction="none")
        per_position = per_position.view(valid.shape)
    else:
        if teacher_logits is None:
            raise ValueError(f"loss_type {loss_type!r} needs teacher logits")
        log_q = F.log_softmax(student / temperature, dim=-1)
        log_p = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
        if loss_type == "fkl":
            per_position = (log_p.exp() * (log_p - log_q)).sum(-1)
        else:
            per_position = (log_q.exp() * (log_q - log_p)).sum(-1)
        per_position = per_position * temperature**2
    w = torch.ones((), device=student.device) if weights is None else weights.to(student.device, torch.float32)
    w = torch.broadcast_to(w, valid.shape) * valid
    # `where`, not a product: a non-finite value at a masked position must not turn the sum into NaN.
    total = torch.where(valid, per_position * w, torch.zeros_like(per_position)).sum()
    return total / w.sum().clamp(min=torch.finfo(torch.float32).tiny)


def acceptance_counts(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, valid: torch.BoolTensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-depth top-1 agreement: `(hits [bs - 1], counts [bs - 1])`.

    Inputs are `[..., bs - 1, V]` logits and a `[..., bs - 1]` validity mask; the counts are summed over every dim but
    the depth one. A hit is `argmax(student) == argmax(teacher)` (the target's own greedy token) at a valid position.
    """
    hit = (student_logits.argmax(-1) == teacher_logits.argmax(-1)) & valid
    dims = tuple(range(valid.dim() - 1))
    return hit.sum(dims), valid.sum(dims)


def acceptance_metrics(hits: torch.Tensor | np.ndarray, counts: torch.Tensor | np.ndarray) -> dict[str, float]:
    """`{"acc_depth_1": ..., "acc_depth_D": ..., "expected_accept_len": ...}` from per-depth hit and valid counts.

    `acc_depth_d = hits_d / counts_d` (0 when no position of depth `d` was valid). The chain expected accepted length
    is `1 + sum_d prod_{i <= d} acc_i`, i.e. tokens committed per verify step of linear (chain) drafting if depths
    were accepted independently with these rates; the `1` is the target's bonus token. `num_blocks` is the number of
    scored blocks (every kept block has a valid depth 1, see `valid_anchor_mask`).
    """
    hits = np.asarray(hits, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    acc = np.divide(hits, counts, out=np.zeros_like(hits), where=counts > 0)
    metrics = {f"acc_depth_{d + 1}": float(a) for d, a in enumerate(acc)}
    metrics["expected_accept_len"] = float(1.0 + np.cumprod(acc).sum())
    metrics["num_blocks"] = float(counts[0]) if counts.size else 0.0
    return metrics


def effective_loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
    """`loss_mask` of a batch (default: `attention_mask`, else all ones), zeroed on padding."""
    input_ids, attention_mask = inputs["input_ids"], inputs.get("attention_mask")
    loss_mask = inputs.get("loss_mask")
    if loss_mask is None:
        loss_mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    if attention_mask is not None:
        loss_mask = loss_mask.bool() & attention_mask.bool()
    return loss_mask


def jetspec_block_forward(
    head: nn.Module,
    target: nn.Module,
    input_ids: torch.LongTensor,
    anchors: torch.LongTensor,
    keep: torch.BoolTensor,
    attention_mask: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    need_teacher: bool = True,
    head_module: nn.Module | None = None,
) -> dict[str, torch.Tensor | None]:
    """The training forward for given anchors: target forward (no grad) + ONE packed head forward.

    Args:
        head: the `JetSpecDraftHead` (unwrapped; its config and dtype are read).
        target: the frozen target causal LM (taps, embeddings, `lm_head`, teacher logits).
        input_ids, attention_mask, loss_mask: `[b, S]` batch (`loss_mask` defaults to `attention_mask` / all ones).
        anchors, keep: `[b, N]` from `sample_anchors`.
        need_teacher: compute the target's logits at the teacher positions (`p + k - 1`) only; otherwise the target
            computes a single logit row per sequence.
        head_module: the module to call for the head forward (e.g. its DDP wrapper); defaults to `head`.

    Returns a dict: `slot_hidden` `[b, N, bs, H]` (head output for every block slot, anchor slot included),
    `student_logits` `[b, N, bs-1, V]` float32 (target `lm_head` on slots `1..bs-1`, with grad),
    `teacher_logits` (same shape, or `None`), `labels` / `valid` `[b, N, bs-1]` (`block_targets`), `anchors`, `keep`.
    """
    config = head.config
    block_size = config.block_size
    batch, seq_len = input_ids.shape
    num = anchors.shape[1]
    if loss_mask is None:
        loss_mask = effective_loss_mask({"input_ids": input_ids, "attention_mask": attention_mask})
    base_positions = None
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        # Real tokens numbered from 0 whatever the padding side, as the inference loop numbers the rows it feeds the
        # head; the target gets the same positions (for right padding they are the default arange).
        base_positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)

    taps = [layer + 1 for layer in config.target_layer_ids]  # hidden_states[0] is the embedding output
    with torch.no_grad():
        # Teacher logits only where a slot reads them: [b, N * (bs-1), V] instead of [b, S, V].
        logits_to_keep = teacher_positions(anchors, block_size, seq_len).flatten(1) if need_teacher else 1
        out = target(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=base_positions,
            output_hidden_states=taps,
            logits_to_keep=logits_to_keep,
            use_cache=False,
            return_dict=True,
        )
        context = torch.cat([out.hidden_states[t] for t in taps], dim=-1)
        teacher_logits = out.logits.view(batch, num, block_size - 1, -1) if need_teacher else None
        del out
        block_ids = torch.full(
            (batch, num, block_size), config.mask_token_id, dtype=torch.long, device=input_ids.device
        )
        block_ids[:, :, 0] = input_ids.gather(1, anchors)  # slot 0: the real anchor token; slots 1..: MASK
        noise_embeds = target.get_input_embeddings()(block_ids.view(batch, num * block_size))

    head_dtype = head.dtype
    device_type = noise_embeds.device.type
    # The mask follows the head's dtype. With bf16/fp16 TrainingArguments accelerate autocasts the head's forward only
    # (the mask is then cast with the other attention inputs); inside an enclosing autocast region, use its dtype.
    mask_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else head_dtype
    attn_mask = training_attention_mask(
        anchors, keep, seq_len, block_size, config.causal, mask_dtype, padding_mask=attention_mask
    )
    position_ids = training_position_ids(anchors, seq_len, block_size, base_positions)
    hidden = (head_module if head_module is not None else head)(
        noise_embeds=noise_embeds.to(head_dtype),
        context_hidden_states=context.to(head_dtype),
        attention_mask=attn_mask,
        position_ids=position_ids,
    ).last_hidden_state
    slot_hidden = hidden.view(batch, num, block_size, -1)
    lm_head = target.get_output_embeddings()
    student_logits = lm_head(slot_hidden[:, :, 1:].to(lm_head.weight.dtype)).float()
    labels, valid = block_targets(input_ids, loss_mask, anchors, keep, block_size)
    return {
        "slot_hidden": slot_hidden,
        "student_logits": student_logits,
        "teacher_logits": teacher_logits,
        "labels": labels,
        "valid": valid,
        "anchors": anchors,
        "keep": keep,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class JetSpecTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the JetSpec recipe knobs.

    `remove_unused_columns` defaults to `False`: the head's `forward` takes embeddings and taps, not the dataset's
    `input_ids` / `attention_mask` / `loss_mask`, so the default column filtering would empty every batch.
    """

    num_anchors: int = field(default=512, metadata={"help": "Maximum number of blocks (anchors) per sequence."})
    loss_type: str = field(default="fkl", metadata={"help": "fkl (forward KL to the target), sft (CE), rkl."})
    kd_temperature: float = field(default=1.0, metadata={"help": "Distillation temperature T (loss scaled by T^2)."})
    gamma: float = field(default=0.0, metadata={"help": "Slot weight decay w_k = exp(-(k-1)/gamma); 0 = uniform."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Must stay False: the trainer needs input_ids/attention_mask/loss_mask."}
    )
    ddp_find_unused_parameters: bool | None = field(
        default=False,
        metadata={"help": "Every head parameter is used in every step: DDP need not search for unused ones."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_recipe(self.num_anchors, self.loss_type, self.kd_temperature, self.gamma)


def check_recipe(num_anchors: int, loss_type: str, kd_temperature: float, gamma: float) -> None:
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if not kd_temperature > 0:
        raise ValueError(f"kd_temperature must be > 0, got {kd_temperature}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")


def check_head_trains_on_target(head, target) -> None:
    """Raise, naming what mismatched, when `head` cannot be trained on `target`'s taps, embeddings and lm_head."""
    check_head_fits_target(head, target)
    if head.config._attn_implementation.startswith("flash"):
        raise ValueError(
            "training packs all blocks in one forward with a 4-D mask, which flash attention cannot take: "
            "load the head with attn_implementation='sdpa' (or 'eager')"
        )


class JetSpecTrainer(Trainer):
    """`Trainer` for a JetSpec draft head distilled from a frozen target model.

    `model` is the head (a `JetSpecDraftHead`): it is the only thing the optimizer updates and the only thing every
    checkpoint and `save_model` write (`config.json` + `model.safetensors` with head tensors). The target is passed as
    `target_model=`; the trainer freezes it (`requires_grad_(False)`, `eval()`), moves it to `args.device` (unless it
    was dispatched with a `device_map`) and keeps its dtype: load it in bf16 yourself for large targets. With several
    processes (DDP through `accelerate launch` / `torchrun`) every process holds its own copy of the target.

    Batches are dicts with `input_ids` `[b, S]`, optional `attention_mask` `[b, S]` (1 = real token) and `loss_mask`
    `[b, S]` (1 = token the target generated; defaults to `attention_mask`, or everything). Other keys are ignored.
    Without a `data_collator`, a tokenizer passed as `processing_class` gets `jetspec_hf.data.JetSpecDataCollator`.

    Recipe knobs come from `JetSpecTrainingArguments` (`num_anchors`, `loss_type`, `kd_temperature`, `gamma`); plain
    `TrainingArguments` get their defaults (and `remove_unused_columns` is forced off).

    Loss and gradient accumulation: `compute_loss` returns a per-micro-batch weighted mean (`jetspec_loss`), so
    `loss_is_scaled_for_ga = False` and the `Trainer` divides it by the number of accumulation steps; the step loss
    is the mean of the micro-batch means. The head's `forward(**kwargs)` would make the `Trainer` believe the model
    takes loss kwargs (`num_items_in_batch`): `model_accepts_loss_kwargs` is forced to `False`.

    Anchors: a fresh `torch.Generator` per micro-batch, seeded from `(args.seed, process index, global step,
    micro-batch index within the step)`. The draw does not depend on any global RNG, so resuming from a checkpoint
    replays the same anchors, and the processes of a distributed run draw independent anchors. Evaluation seeds from
    `(args.seed, process index, eval batch index)`, so every evaluation of a run scores the same blocks.

    Evaluation (`evaluate()`): `eval_loss` plus, per depth `d = 1..block_size-1`, `eval_acc_depth_d` (top-1 agreement
    of the draft with the target's greedy token at valid positions), `eval_expected_accept_len` (chain estimate, see
    `acceptance_metrics`) and `eval_num_blocks` (blocks scored). Counts are gathered over processes with
    `gather_for_metrics` (the duplicates padding the last batch are dropped). Any of them can be
    `metric_for_best_model` (e.g. `"expected_accept_len"`; `greater_is_better` then defaults to True). A user
    `compute_metrics` is not called (`prediction_step` returns no logits). Eval anchors depend on the eval batch index
    and process, so metrics are comparable across the evaluations of one run and setup (same world size and eval
    batch size).
    """

    # compute_loss returns a per-batch mean: let the Trainer divide it by the gradient accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self, model=None, args: TrainingArguments | None = None, *trainer_args, target_model: nn.Module, **kwargs
    ):
        if model is None:
            raise ValueError("JetSpecTrainer needs the draft head as `model` (model_init is not supported)")
        if target_model is None:
            raise ValueError("JetSpecTrainer needs the frozen target: JetSpecTrainer(head, args, target_model=...)")
        if args is not None and args.remove_unused_columns:
            logger.warning(
                "JetSpecTrainer reads input_ids/attention_mask/loss_mask: setting remove_unused_columns=False"
            )
            args.remove_unused_columns = False
        if kwargs.get("data_collator") is None and kwargs.get("processing_class") is not None:
            try:
                from .data import JetSpecDataCollator

                kwargs["data_collator"] = JetSpecDataCollator(kwargs["processing_class"])
            except (ImportError, TypeError):
                pass
        check_head_trains_on_target(model, target_model)
        super().__init__(model, args, *trainer_args, **kwargs)
        check_recipe(self.num_anchors, self.loss_type, self.kd_temperature, self.gamma)
        self.model_accepts_loss_kwargs = False  # our compute_loss never passes num_items_in_batch to the head
        target_model.requires_grad_(False).eval()
        if getattr(target_model, "hf_device_map", None) is None:
            target_model.to(self.args.device)
        self.target_model = target_model
        self._anchor_step = (-1, 0)  # (global step, micro-batches drawn in it)
        self._eval_batch = 0
        self._eval_stats: torch.Tensor | None = None

    # recipe knobs, with defaults for plain TrainingArguments
    num_anchors = property(lambda self: getattr(self.args, "num_anchors", 512))
    loss_type = property(lambda self: getattr(self.args, "loss_type", "fkl"))
    kd_temperature = property(lambda self: getattr(self.args, "kd_temperature", 1.0))
    gamma = property(lambda self: getattr(self.args, "gamma", 0.0))

    def _anchor_generator(self, training: bool) -> torch.Generator:
        if training:
            step, micro = self._anchor_step
            micro = micro + 1 if step == self.state.global_step else 0
            self._anchor_step = (self.state.global_step, micro)
            entropy = [self.args.seed, self.args.process_index, 0, self.state.global_step, micro]
        else:
            entropy = [self.args.seed, self.args.process_index, 1, self._eval_batch]
            self._eval_batch += 1
        seed = int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))
        return torch.Generator().manual_seed(seed)

    def block_forward(self, model: nn.Module, inputs: dict[str, Any], training: bool, need_teacher: bool) -> dict:
        """Samples anchors for this micro-batch and runs `jetspec_block_forward` (see there for the outputs)."""
        head = self.accelerator.unwrap_model(model)
        loss_mask = effective_loss_mask(inputs)
        anchors, keep = sample_anchors(
            loss_mask, self.num_anchors, head.config.block_size, self._anchor_generator(training)
        )
        return jetspec_block_forward(
            head,
            self.target_model,
            inputs["input_ids"],
            anchors,
            keep,
            attention_mask=inputs.get("attention_mask"),
            loss_mask=loss_mask,
            need_teacher=need_teacher,
            head_module=model,
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        training = model.training
        outputs = self.block_forward(
            model, inputs, training=training, need_teacher=self.loss_type != "sft" or not training
        )
        weights = position_weights(self.model.config.block_size, self.gamma, device=outputs["valid"].device)
        loss = jetspec_loss(
            outputs["student_logits"],
            outputs["teacher_logits"],
            outputs["labels"],
            outputs["valid"],
            weights,
            loss_type=self.loss_type,
            temperature=self.kd_temperature,
        )
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Eval loss of one batch; accumulates the per-depth acceptance counts reported by `evaluation_loop`."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        student, teacher, valid = outputs["student_logits"], outputs["teacher_logits"], outputs["valid"]
        # Per-sample counts [b, 2, bs-1], gathered like predictions (duplicated samples of the last batch dropped).
        per_sample = torch.stack([torch.stack(acceptance_counts(s, t, v)) for s, t, v in zip(student, teacher, valid)])
        per_sample = self.accelerator.gather_for_metrics(per_sample)
        totals = per_sample.sum(0).cpu()
        self._eval_stats = totals if self._eval_stats is None else self._eval_stats + totals
        return loss.detach(), None, None

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        self._eval_stats, self._eval_batch = None, 0
        output = super().evaluation_loop(
            dataloader,
            description,
            prediction_loss_only=prediction_loss_only,
            ignore_keys=ignore_keys,
            metric_key_prefix=metric_key_prefix,
        )
        if self._eval_stats is not None:
            metrics = acceptance_metrics(self._eval_stats[0], self._eval_stats[1])
            output.metrics.update({f"{metric_key_prefix}_{k}": v for k, v in metrics.items()})
        self._eval_stats = None
        return output


__all__ = [
    "JetSpecTrainer",
    "JetSpecTrainingArguments",
    "acceptance_counts",
    "acceptance_metrics",
    "block_targets",
    "effective_loss_mask",
    "jetspec_block_forward",
    "gather_teacher_logits",
    "jetspec_loss",
    "position_weights",
    "sample_anchors",
    "teacher_positions",
    "training_attention_mask",
    "training_position_ids",
    "valid_anchor_mask",
]


class TreeTauCallback(TrainerCallback):
    """After every evaluation, measure the real thing: tau of tree decoding through `target.generate(...,
    assistant_model=head)` on a few held-out prompts, added to the metrics as `eval_tree_tau` (so it can serve as
    `metric_for_best_model`). The per-depth acceptance metrics are a cheaper proxy of the same quantity.

    `prompts` are `[1, L]` token id tensors (e.g. chat-templated held-out questions). Greedy decoding, so the
    measurement is deterministic; `tree_arguments` (`tree_budget`, `tree_width`, `tree_depth`) default to the head's.
    """

    def __init__(self, target_model, prompts: list[torch.Tensor], max_new_tokens: int = 64, **tree_arguments):
        self.target_model, self.prompts, self.max_new_tokens = target_model, prompts, max_new_tokens
        self.tree_arguments = tree_arguments

    def on_evaluate(self, args, state, control, model=None, metrics=None, **kwargs):
        head = getattr(model, "module", model)  # DDP wraps the head
        was_training = head.training
        head.eval()
        committed = steps = 0
        device = next(self.target_model.parameters()).device
        for ids in self.prompts:
            self.target_model.generate(
                ids.to(device),
                assistant_model=head,
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                **self.tree_arguments,
            )
            committed += sum(head.last_generate_stats.accepted_lengths)
            steps += len(head.last_generate_stats.accepted_lengths)
        head.train(was_training)
        if metrics is not None:
            metrics["eval_tree_tau"] = committed / max(steps, 1)
