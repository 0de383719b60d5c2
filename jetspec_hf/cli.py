"""The `jetspec-hf` command line: regenerate data with the target, train a draft head, publish it.

    jetspec-hf regenerate --target MODEL --data prompts.jsonl --output regenerated.jsonl
    jetspec-hf train --target MODEL --data regenerated.jsonl --output-dir heads/my-head [Trainer arguments]
    jetspec-hf push --head heads/my-head --repo-id me/my-head --target-model MODEL
    jetspec-hf demo ... / jetspec-hf bench ...   (when `jetspec_hf.demo` / `jetspec_hf.bench` are installed)

`MODEL` is a Hub id or a local directory loaded with `AutoModelForCausalLM` / `AutoTokenizer`; the name `smollm2`
means the offline SmolLM2-135M-Instruct of `jetspec_hf.smollm2`.

`train` takes the JetSpec options below plus every `transformers.TrainingArguments` option (`--learning_rate`,
`--max_steps`, `--bf16`, `--eval_strategy`, `--resume_from_checkpoint`, ...: see `jetspec-hf train --help`), and runs
unchanged under `accelerate launch` / `torchrun` (one process per GPU, DDP; every process holds a copy of the target).
Only the main process writes `training_summary.json` and prints the summary. See docs/training.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

SMOLLM2_NAME = "smollm2"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SUMMARY_FILE = "training_summary.json"
SUMMARY_FORMAT = "jetspec-hf training summary v1"
DTYPES = ("auto", "float32", "bfloat16", "float16")

# Recipe defaults of `jetspec-hf train` that differ from `TrainingArguments`' own (method reference, section C.6):
# LR 3e-4 (3e-4 and 6e-4 were best in the paper's sweep), micro-batch 2 per device (8 x H100, micro-batch 2).
TRAINER_DEFAULTS = {
    "learning_rate": 3e-4,
    "lr_scheduler_type": "cosine",
    "per_device_train_batch_size": 2,
    "per_device_eval_batch_size": 2,
    "logging_steps": 10,
}


# ---------------------------------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------------------------------


def _torch_dtype(name: str, device=None):
    import torch

    if name == "auto":
        device_type = getattr(device, "type", str(device or "cpu"))
        if device_type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, name)


def _resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_target(name: str, dtype, *, device=None, trust_remote_code: bool = False, progress: bool = True):
    """`(model, tokenizer, target_model_name)` for a Hub id / local directory, or `smollm2` (offline SmolLM2).

    The model is loaded with `attn_implementation="sdpa"` (tree verification and the packed training forward take
    4-D masks) in eval mode. With a non-CPU `device` it is placed there directly (`device_map`), so that several
    processes of a distributed run do not each stage a full copy in CPU memory first.
    """
    import torch

    if name == SMOLLM2_NAME:
        from .smollm2 import load_smollm2

        model, tokenizer = load_smollm2(dtype=dtype, device=device, progress=progress)
        return model, tokenizer, SMOLLM2_HUB_ID

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": "sdpa", "trust_remote_code": trust_remote_code}
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cpu":
        kwargs["device_map"] = {"": device}
    model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    return model.eval(), tokenizer, name


def _parse_int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _fmt(value, digits: int = 4) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}g}" if math.isfinite(value) else str(value)
    return str(value)


# ---------------------------------------------------------------------------------------------------------------------
# regenerate
# ---------------------------------------------------------------------------------------------------------------------


class _StatsCollectingTarget:
    """Stands in for the target in `regenerate` and keeps every `head.last_generate_stats` (speculative runs)."""

    def __init__(self, model, head):
        self._model, self._head, self.stats = model, head, []

    def generate(self, *args, **kwargs):
        output = self._model.generate(*args, **kwargs)
        self.stats.append(self._head.last_generate_stats)
        return output

    def __getattr__(self, name):
        return getattr(self._model, name)


def _eos_ids(model, tokenizer) -> list[int]:
    """The target's `generation_config.eos_token_id` plus the tokenizer's eos (the end-of-turn token of chat models)."""
    from .data import _as_id_list

    ids = _as_id_list(model.generation_config.eos_token_id)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def run_regenerate(args, parser) -> int:
    from .data import load_conversations, regenerate

    device = _resolve_device(args.device)
    dtype = _torch_dtype(args.dtype, device)
    model, tokenizer, _ = load_target(args.target, dtype, device=device, trust_remote_code=args.trust_remote_code)
    if model.device.type != device.type:
        model.to(device)
    conversations = load_conversations(args.data)
    if args.limit is not None:
        conversations = conversations[: args.limit]

    generate_kwargs: dict[str, Any] = {}
    eos = args.eos_token_ids if args.eos_token_ids is not None else _eos_ids(model, tokenizer)
    if eos:
        generate_kwargs["eos_token_id"] = eos
    head = None
    target_for_regenerate = model
    if args.head is not None:
        from . import JetSpecDraftHead, check_head_fits_target

        head = JetSpecDraftHead.from_pretrained(args.head, dtype=model.dtype).to(model.device).eval()
        try:
            check_head_fits_target(head, model)
        except ValueError as error:
            parser.error(str(error))
        for name in ("tree_budget", "tree_width", "tree_depth"):
            if getattr(args, name) is not None:
                generate_kwargs[name] = getattr(args, name)
        target_for_regenerate = _StatsCollectingTarget(model, head)

    summary = regenerate(
        target_for_regenerate,
        tokenizer,
        conversations,
        args.output,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_p=args.top_p,
        generate_kwargs=generate_kwargs,
        progress=not args.no_progress,
        assistant_model=head,
    )
    seconds = summary["seconds"]
    rate = summary["new_tokens"] / seconds if seconds > 0 else float("nan")
    print(
        f"jetspec-hf regenerate: {summary['done']} done, {summary['skipped']} skipped (already in {args.output}), "
        f"{summary['dropped']} dropped (no prompt), {summary['truncated']} truncated at --max-new-tokens"
    )
    print(f"  {summary['new_tokens']} new tokens in {seconds:.1f} s ({rate:.1f} tokens/s) -> {args.output}")
    if head is not None:
        accepted = [n for stats in target_for_regenerate.stats for n in stats.accepted_lengths]
        if accepted:
            tau = sum(accepted) / len(accepted)
            print(f"  speculative: tau {tau:.2f} tokens per target forward ({len(accepted)} verify steps)")
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------------------------------------


def _row_norms(weight):
    """Float32 L2 norms of the embedding rows, in chunks (no float32 copy of a large table)."""
    import torch

    return torch.cat([chunk.float().norm(dim=-1) for chunk in weight.split(8192)])


def _template_token_ids(tokenizer) -> set[int]:
    """Token ids the chat template writes around a short conversation (empty without a usable template)."""
    conversations = [
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}],
    ]
    ids: set[int] = set()
    for messages in conversations:
        try:
            encoding = tokenizer.apply_chat_template(
                messages, add_generation_prompt=messages[-1]["role"] == "user", tokenize=True, return_dict=True
            )
        except Exception:  # no template, or one that rejects a system turn
            continue
        ids.update(encoding["input_ids"])
    return ids


def default_mask_token_id(target, tokenizer) -> tuple[int, str]:
    """The mask token of a new head, and why it was chosen. The first rule that applies wins:

    1. the first embedding row that no token of the tokenizer uses (`len(tokenizer)`), when the target's embedding
       table is larger than the tokenizer (Qwen3: 151669, the id the DFlash/JetSpec Qwen3 heads use);
    2. the lowest added special token named like a reserved/unused one (Llama 3: `<|reserved_special_token_0|>` =
       128002, the id DFlash heads for Llama 3 use; Gemma: `<unused0>`);
    3. the last added special token that is none of bos/eos/pad/unk and that the chat template does not write
       (SmolLM2: `<empty_output>`);
    4. the tokenizer's pad token; 5. its unk token; 6. its eos token; 7. the last embedding row.

    Rows that are (nearly) zero or not finite are skipped (norm below a tenth of the median row norm: e.g. the pad
    row of models built with `padding_idx`): the MASK embedding is the input of every drafted slot.
    """
    import torch

    weight = target.get_input_embeddings().weight.detach()
    rows = weight.shape[0]
    norms = _row_norms(weight)
    threshold = 0.1 * norms.median()

    def usable(token_id) -> bool:
        if token_id is None or not 0 <= token_id < rows:
            return False
        return bool(torch.isfinite(weight[token_id]).all() and norms[token_id] > threshold)

    candidates: list[tuple[int | None, str]] = []
    if rows > len(tokenizer):
        candidates.append((len(tokenizer), "first embedding row without a token (len(tokenizer))"))
    specials = {
        token_id: str(token.content)
        for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
        if token.special
    }
    reserved = sorted(i for i, text in specials.items() if "reserved" in text.lower() or "unused" in text.lower())
    candidates += [(i, f"reserved special token {specials[i]!r}") for i in reserved[:1]]
    named = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    unused = [i for i in sorted(specials, reverse=True) if i not in named]
    if unused:
        in_template = _template_token_ids(tokenizer)
        unused = [i for i in unused if i not in in_template and usable(i)]
        candidates += [(i, f"special token {specials[i]!r}, unused by the chat template") for i in unused[:1]]
    candidates += [
        (tokenizer.pad_token_id, "the tokenizer's pad token"),
        (tokenizer.unk_token_id, "the tokenizer's unk token"),
        (tokenizer.eos_token_id, "the tokenizer's eos token"),
    ]
    for token_id, reason in candidates:
        if usable(token_id):
            return int(token_id), reason
    return rows - 1, "the last embedding row"


def _rope_parameters(text_config) -> dict | None:
    import copy

    rope = getattr(text_config, "rope_parameters", None)
    if not isinstance(rope, dict):
        return None
    if "rope_type" not in rope and isinstance(rope.get("full_attention"), dict):  # per-layer-type rope (Gemma 3)
        rope = rope["full_attention"]
    return copy.deepcopy(dict(rope))


def head_config_for_target(
    target,
    *,
    num_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int,
    causal: bool = True,
    target_model: str | None = None,
):
    """A `JetSpecConfig` sized from the target: hidden size, vocabulary, attention heads / KV heads / head_dim,
    MLP width, RMSNorm eps, rope and context length of the target's text config; taps by the authors' rule
    (`default_target_layer_ids`) unless given."""
    from .modeling import JetSpecConfig

    text = target.config.get_text_config()
    heads = text.num_attention_heads
    kwargs: dict[str, Any] = dict(
        vocab_size=target.get_input_embeddings().weight.shape[0],
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        rms_norm_eps=getattr(text, "rms_norm_eps", None) or 1e-6,
        max_position_embeddings=getattr(text, "max_position_embeddings", None) or 40960,
        block_size=block_size,
        num_target_layers=text.num_hidden_layers,
        target_layer_ids=target_layer_ids,
        mask_token_id=mask_token_id,
        causal=causal,
        target_model=target_model,
    )
    rope = _rope_parameters(text)
    if rope is not None:
        kwargs["rope_parameters"] = rope
    return JetSpecConfig(**kwargs)


def _build_train_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        add_help=False,
        allow_abbrev=False,
        help="train a draft head on regenerated conversations (JetSpecTrainer)",
        description=(
            "Train a JetSpec draft head with the Hugging Face Trainer. Besides the options below, every "
            "transformers.TrainingArguments option is accepted (listed after them by --help)."
        ),
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help (and the Trainer options) and exit")
    group = parser.add_argument_group("JetSpec options")
    group.add_argument("--target", help="target model: Hub id, local directory, or 'smollm2' (required)")
    group.add_argument("--data", help="training conversations, .jsonl or .parquet (required)")
    group.add_argument("--output-dir", "--output_dir", dest="output_dir", help="where the head is saved (required)")
    group.add_argument(
        "--eval-data", "--eval_data", dest="eval_data", help="evaluation conversations (.jsonl/.parquet)"
    )
    group.add_argument(
        "--init-head", "--init_head", dest="init_head", help="head directory to fine-tune instead of a new head"
    )
    group.add_argument(
        "--block-size", "--block_size", dest="block_size", type=int, help="block size of a new head (default 16)"
    )
    group.add_argument(
        "--num-layers",
        "--num_layers",
        dest="num_layers",
        type=_positive_int,
        help="decoder layers of a new head (default 1)",
    )
    group.add_argument(
        "--target-layers",
        "--target_layers",
        dest="target_layers",
        type=_parse_int_list,
        help="comma-separated target layers to tap, e.g. 1,9,17 (default: the authors' rule, one tap per head layer)",
    )
    causal = group.add_mutually_exclusive_group()
    causal.add_argument(
        "--causal", dest="causal", action="store_const", const=True, help="block-causal JetSpec head (default)"
    )
    causal.add_argument(
        "--bidirectional", dest="causal", action="store_const", const=False, help="bidirectional DFlash head"
    )
    group.add_argument(
        "--mask-token-id",
        "--mask_token_id",
        dest="mask_token_id",
        type=int,
        help="token whose target embedding fills the drafted slots (default: see default_mask_token_id)",
    )
    group.add_argument(
        "--loss",
        "--loss-type",
        "--loss_type",
        dest="loss",
        choices=("fkl", "sft", "rkl"),
        help="fkl (default), sft or rkl",
    )
    group.add_argument(
        "--kd-temperature",
        "--kd_temperature",
        dest="kd_temperature",
        type=float,
        help="distillation temperature (default 1)",
    )
    group.add_argument("--gamma", type=float, help="slot weight decay exp(-(k-1)/gamma); 0 = uniform (default)")
    group.add_argument(
        "--num-anchors", "--num_anchors", dest="num_anchors", type=int, help="blocks per sequence (default 512)"
    )
    group.add_argument(
        "--tree-tau-prompts",
        "--tree_tau_prompts",
        dest="tree_tau_prompts",
        type=int,
        default=0,
        help="at each evaluation, decode the prompts of the first N --eval-data conversations with the head and "
        "report the real tree tau as eval_tree_tau (default 0: off)",
    )
    group.add_argument(
        "--max-length",
        "--max_length",
        dest="max_length",
        type=_positive_int,
        default=2048,
        help="truncate examples to this many tokens (default 2048)",
    )
    group.add_argument(
        "--target-dtype",
        "--target_dtype",
        dest="target_dtype",
        choices=DTYPES,
        default=None,
        help="dtype of the frozen target (default: bfloat16 with --bf16, float16 with --fp16, else float32)",
    )
    group.add_argument("--trust-remote-code", "--trust_remote_code", dest="trust_remote_code", action="store_true")
    return parser


def _trainer_argument_parser():
    from transformers import HfArgumentParser

    from .training import JetSpecTrainingArguments

    parser = HfArgumentParser(JetSpecTrainingArguments, prog="jetspec-hf train", add_help=False)
    parser.set_defaults(**TRAINER_DEFAULTS)
    return parser


def _trainer_help(hf_parser) -> str:
    """Help of the Trainer options (the JetSpec recipe fields appear there too, under their underscore names)."""
    text = hf_parser.format_help()
    options = text[text.index("\n\n") + 2 :] if "\n\n" in text else text  # without the (very long) usage line
    changed = ", ".join(f"{k}={v}" for k, v in TRAINER_DEFAULTS.items())
    return f"Trainer options (transformers.TrainingArguments; defaults changed by jetspec-hf: {changed}):\n\n{options}"


def _resolve_resume(value: str | None, output_dir: str, parser) -> str | None:
    if value is None or value.lower() in ("", "false", "no", "none"):
        return None
    if value.lower() in ("true", "yes", "latest", "last"):
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            parser.error(f"--resume_from_checkpoint {value}: no checkpoint-* directory in {output_dir}")
        return last
    if not os.path.isdir(value):
        parser.error(f"--resume_from_checkpoint: {value} is not a directory")
    return value


def _hardware(training_args) -> str:
    import torch

    device = training_args.device
    if device.type == "cuda":
        return f"{training_args.world_size}x {torch.cuda.get_device_name(device)}"
    return f"{training_args.world_size}x {device.type}"


def _dataset_stats(dataset) -> dict[str, int]:
    return {
        "examples": len(dataset),
        "dropped": dataset.num_dropped,
        "tokens": sum(len(e["input_ids"]) for e in dataset.examples),
        "loss_tokens": sum(sum(e["loss_mask"]) for e in dataset.examples),
    }


def _tree_tau_callbacks(args, target, tokenizer, parser) -> list:
    """`--tree-tau-prompts N`: a TreeTauCallback over the prompts of the first N evaluation conversations."""
    import torch

    from .data import _prompt_messages, load_conversations
    from .training import TreeTauCallback

    if not args.tree_tau_prompts:
        return []
    if not args.eval_data:
        parser.error("--tree-tau-prompts needs --eval-data (the prompts are taken from it)")
    prompts = []
    for row in load_conversations(args.eval_data)[: args.tree_tau_prompts]:
        encoding = tokenizer.apply_chat_template(
            _prompt_messages(row["messages"]), add_generation_prompt=True, tokenize=True, return_dict=True
        )
        prompts.append(torch.tensor([encoding["input_ids"]]))
    return [TreeTauCallback(target, prompts)]


def run_train(args, rest: list[str], parser: argparse.ArgumentParser) -> int:
    hf_parser = _trainer_argument_parser()
    if args.help:
        print(parser.format_help())
        print(_trainer_help(hf_parser))
        return 0
    missing = [
        flag
        for flag, value in (("--target", args.target), ("--data", args.data), ("--output-dir", args.output_dir))
        if not value
    ]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")

    recipe = {
        "num_anchors": args.num_anchors,
        "loss_type": args.loss,
        "kd_temperature": args.kd_temperature,
        "gamma": args.gamma,
    }
    extra = [f"--{k}={v}" for k, v in recipe.items() if v is not None]
    try:
        training_args, remaining = hf_parser.parse_args_into_dataclasses(
            args=[*rest, *extra, f"--output_dir={args.output_dir}"],
            return_remaining_strings=True,
            look_for_args_file=False,
        )
    except ValueError as error:
        parser.error(str(error))
    if remaining:
        parser.error(f"unrecognized arguments: {' '.join(remaining)}")
    resume = _resolve_resume(training_args.resume_from_checkpoint, args.output_dir, parser)

    import torch
    from transformers import set_seed

    from . import JetSpecDraftHead, check_head_fits_target
    from .data import JetSpecDataCollator, TokenizedChatDataset
    from .training import JetSpecTrainer

    start = time.perf_counter()
    main_process = training_args.process_index == 0

    def say(message: str) -> None:
        if main_process:
            print(f"jetspec-hf train: {message}", flush=True)

    if args.target_dtype is not None:
        target_dtype = _torch_dtype(args.target_dtype, training_args.device)
    else:
        target_dtype = torch.bfloat16 if training_args.bf16 else torch.float16 if training_args.fp16 else torch.float32
    target, tokenizer, target_name = load_target(
        args.target,
        target_dtype,
        device=training_args.device,
        trust_remote_code=args.trust_remote_code,
        progress=main_process,
    )
    vocab = target.get_input_embeddings().weight.shape[0]

    set_seed(training_args.seed)  # the same new head on every process (DDP also broadcasts rank 0's weights)
    if args.init_head is not None:
        head = JetSpecDraftHead.from_pretrained(args.init_head, dtype=torch.float32, attn_implementation="sdpa")
        config = head.config
        given = {
            "--block-size": (args.block_size, config.block_size),
            "--num-layers": (args.num_layers, config.num_hidden_layers),
            "--target-layers": (args.target_layers, list(config.target_layer_ids)),
            "--causal/--bidirectional": (args.causal, config.causal),
            "--mask-token-id": (args.mask_token_id, config.mask_token_id),
        }
        conflicts = [
            f"{flag} {mine} (head: {theirs})"
            for flag, (mine, theirs) in given.items()
            if mine is not None and mine != theirs
        ]
        if conflicts:
            parser.error(
                f"--init-head {args.init_head} fixes the head's architecture; conflicting: {'; '.join(conflicts)}"
            )
        say(f"fine-tuning {args.init_head}")
    else:
        if args.mask_token_id is not None:
            if not 0 <= args.mask_token_id < vocab:
                parser.error(
                    f"--mask-token-id {args.mask_token_id} is outside the target's vocabulary (0..{vocab - 1})"
                )
            mask_token_id, reason = args.mask_token_id, "--mask-token-id"
        else:
            mask_token_id, reason = default_mask_token_id(target, tokenizer)
        num_layers = args.num_layers or 1
        try:
            config = head_config_for_target(
                target,
                num_layers=num_layers,
                block_size=args.block_size or 16,
                target_layer_ids=args.target_layers,
                mask_token_id=mask_token_id,
                causal=True if args.causal is None else args.causal,
                target_model=target_name,
            )
        except ValueError as error:
            parser.error(str(error))
        head = JetSpecDraftHead(config)
        head.set_attn_implementation("sdpa")
        say(
            f"new {'JetSpec (causal)' if config.causal else 'DFlash (bidirectional)'} head: {num_layers} layer(s), "
            f"block {config.block_size}, taps {config.target_layer_ids} of {config.num_target_layers} target layers, "
            f"mask token {mask_token_id} ({reason})"
        )
    try:
        check_head_fits_target(head, target)
    except ValueError as error:
        parser.error(str(error))
    if resume is not None:
        say(f"resuming from {resume} (head weights, optimizer, scheduler and step)")

    train_dataset = TokenizedChatDataset(args.data, tokenizer, max_length=args.max_length)
    if len(train_dataset) == 0:
        parser.error(f"{args.data}: no conversation with an assistant turn to train on")
    eval_dataset = (
        TokenizedChatDataset(args.eval_data, tokenizer, max_length=args.max_length) if args.eval_data else None
    )
    train_stats = _dataset_stats(train_dataset)
    say(
        f"{train_stats['examples']} training examples ({train_stats['dropped']} dropped), "
        f"{train_stats['tokens']} tokens, {train_stats['loss_tokens']} target tokens"
    )

    try:
        trainer = JetSpecTrainer(
            head,
            training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            data_collator=JetSpecDataCollator(tokenizer),
            target_model=target,
            callbacks=_tree_tau_callbacks(args, target, tokenizer, parser),
        )
    except ValueError as error:  # e.g. --eval_strategy steps without --eval-data
        parser.error(str(error))
    train_start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume)
    train_seconds = time.perf_counter() - train_start
    trainer.save_model(args.output_dir)  # the head only (config.json + model.safetensors), on the main process
    eval_metrics = trainer.evaluate() if eval_dataset is not None else {}  # every process takes part

    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        summary = {
            "format": SUMMARY_FORMAT,
            "target_model": target_name,
            "init_head": args.init_head,
            "data": str(args.data),
            "num_conversations": train_stats["examples"] + train_stats["dropped"],
            "num_examples": train_stats["examples"],
            "num_tokens": train_stats["tokens"],
            "num_loss_tokens": train_stats["loss_tokens"],
            "eval_data": str(args.eval_data) if args.eval_data else None,
            "num_eval_examples": len(eval_dataset) if eval_dataset is not None else 0,
            "max_length": args.max_length,
            "block_size": head.config.block_size,
            "num_layers": head.config.num_hidden_layers,
            "target_layer_ids": list(head.config.target_layer_ids),
            "mask_token_id": head.config.mask_token_id,
            "causal": bool(head.config.causal),
            "loss": trainer.loss_type,
            "kd_temperature": trainer.kd_temperature,
            "gamma": trainer.gamma,
            "anchors": trainer.num_anchors,
            "lr": training_args.learning_rate,
            "lr_scheduler": str(getattr(training_args.lr_scheduler_type, "value", training_args.lr_scheduler_type)),
            "batch_size": training_args.per_device_train_batch_size
            * training_args.gradient_accumulation_steps
            * training_args.world_size,
            "world_size": training_args.world_size,
            "precision": "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "fp32",
            "hardware": _hardware(training_args),
            "steps": trainer.state.global_step,
            "epochs": trainer.state.epoch,
            "final_loss": losses[-1] if losses else result.training_loss,  # last logged loss (or the run's mean)
            "train_loss": result.training_loss,
            "eval": eval_metrics,
            "resumed_from": resume,
            "train_seconds": train_seconds,
            "seconds": time.perf_counter() - start,
        }
        summary_path = Path(args.output_dir) / SUMMARY_FILE
        summary_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        print(f"jetspec-hf train: done in {summary['seconds']:.1f} s ({train_seconds:.1f} s training)")
        print(f"  head      {args.output_dir}")
        print(
            f"  steps     {summary['steps']} (epoch {_fmt(summary['epochs'], 3)}), "
            f"final loss {_fmt(summary['final_loss'])}, mean loss {_fmt(summary['train_loss'])}"
        )
        if eval_metrics:
            shown = ["eval_loss", "eval_expected_accept_len", "eval_acc_depth_1"]
            print("  eval      " + ", ".join(f"{k[5:]} {_fmt(eval_metrics[k])}" for k in shown if k in eval_metrics))
        print(f"  summary   {summary_path}")
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# push
# ---------------------------------------------------------------------------------------------------------------------


def card_training_info(summary: dict) -> dict:
    """The model card's training table from a `training_summary.json` written by `jetspec-hf train` (any other
    dict is shown as it is)."""
    if summary.get("format") != SUMMARY_FORMAT:
        return summary
    info: dict[str, Any] = {}
    data = (
        f"{Path(summary['data']).name}: {summary['num_examples']} examples, {summary['num_loss_tokens']} target tokens"
    )
    info["data"] = data
    loss = summary["loss"]
    if loss != "sft" and summary.get("kd_temperature", 1.0) != 1.0:
        loss += f" (T={_fmt(summary['kd_temperature'])})"
    if summary.get("gamma"):
        loss += f", gamma={_fmt(summary['gamma'])}"
    info["loss"] = loss
    for key in ("anchors", "block_size", "steps"):
        info[key] = summary.get(key)
    if summary.get("epochs") is not None:
        info["epochs"] = round(float(summary["epochs"]), 2)
    info["lr"] = summary.get("lr")
    info["batch_size"] = summary.get("batch_size")
    info["precision"] = summary.get("precision")
    info["hardware"] = summary.get("hardware")
    if summary.get("final_loss") is not None:
        info["final_loss"] = round(float(summary["final_loss"]), 4)
    eval_metrics = summary.get("eval") or {}
    if "eval_expected_accept_len" in eval_metrics:
        info["eval_expected_accept_len"] = round(float(eval_metrics["eval_expected_accept_len"]), 3)
    if summary.get("init_head"):
        info["fine_tuned_from"] = summary["init_head"]
    return {k: v for k, v in info.items() if v is not None}


def _read_json(path: str, parser, flag: str):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        parser.error(f"{flag} {path}: {error}")


def run_push(args, parser) -> int:
    from . import JetSpecDraftHead

    head = JetSpecDraftHead.from_pretrained(args.head)
    target_model = args.target_model or head.config.target_model
    if not target_model:
        parser.error("--target-model is required: the head's config names no target")
    training = None
    training_json = args.training_json
    if training_json is None and (Path(args.head) / SUMMARY_FILE).exists():
        training_json = str(Path(args.head) / SUMMARY_FILE)
    if training_json is not None:
        training = _read_json(training_json, parser, "--training-json")
        if not isinstance(training, dict):
            parser.error(f"--training-json {training_json}: expected a JSON object")
        training = card_training_info(training)
    measured = _read_json(args.measured_json, parser, "--measured-json") if args.measured_json else None

    if args.dry_run:
        from .hub import model_card

        print(
            model_card(
                head,
                target_model=target_model,
                target_revision=args.target_revision,
                training=training,
                measured=measured,
                license=args.license,
                repo_id=args.repo_id,
                remote_code=not args.no_remote_code,
            )
        )
        return 0

    from .hub import push_head_to_hub

    commit = push_head_to_hub(
        head,
        args.repo_id,
        target_model=target_model,
        target_revision=args.target_revision,
        training=training,
        measured=measured,
        private=args.private or None,
        token=args.token,
        commit_message=args.commit_message,
        remote_code=not args.no_remote_code,
        license=args.license,
    )
    print(f"jetspec-hf push: {args.head} -> https://huggingface.co/{args.repo_id} ({commit})")
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# demo / bench (provided by other modules when installed)
# ---------------------------------------------------------------------------------------------------------------------


def _not_available(name: str) -> int:
    print(f"jetspec-hf {name}: not available yet (this installation has no jetspec_hf.{name} module)", file=sys.stderr)
    return 2


def run_demo(rest: list[str]) -> int:
    try:
        from .demo import main as demo_main
    except ModuleNotFoundError as error:
        if error.name != f"{__package__}.demo":
            raise  # the module exists but one of its own imports is missing: show that error
        return _not_available("demo")
    return demo_main(rest) or 0


def run_bench(rest: list[str]) -> int:
    try:
        from .bench import main as bench_main
    except ModuleNotFoundError as error:
        if error.name != f"{__package__}.bench":
            raise
        return _not_available("bench")
    return bench_main(rest) or 0


# ---------------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------------


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="jetspec-hf",
        description="JetSpec tree speculative decoding for Hugging Face transformers: data, training, publishing.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    regen = subparsers.add_parser(
        "regenerate",
        allow_abbrev=False,
        help="rewrite the assistant answers of conversations with the target model",
        description="Answer every conversation's prompt with the target (resumable; appends to --output).",
    )
    regen.add_argument("--target", required=True, help="target model: Hub id, local directory, or 'smollm2'")
    regen.add_argument("--data", required=True, help="input conversations, .jsonl or .parquet")
    regen.add_argument("--output", required=True, help="output .jsonl (appended to; finished ids are skipped)")
    regen.add_argument("--max-new-tokens", type=_positive_int, default=512, help="answer length limit (default 512)")
    regen.add_argument(
        "--batch-size", type=_positive_int, default=8, help="prompts per generate call (default 8; 1 with --head)"
    )
    regen.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    regen.add_argument(
        "--temperature", type=float, help="sampling temperature (with --do-sample; default: the model's)"
    )
    regen.add_argument("--top-p", type=float, help="nucleus sampling (with --do-sample; default: the model's)")
    regen.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="model dtype (auto: bfloat16 on a GPU, else float32)"
    )
    regen.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    regen.add_argument("--head", help="JetSpec head directory: speculative regeneration (batch size 1)")
    regen.add_argument("--tree-budget", type=_positive_int, help="tree node budget with --head (default: the head's)")
    regen.add_argument("--tree-width", type=_positive_int, help="tree width with --head (default: the head's)")
    regen.add_argument("--tree-depth", type=int, help="tree depth with --head (default: the head's)")
    regen.add_argument("--limit", type=_positive_int, help="only the first N conversations")
    regen.add_argument(
        "--eos-token-ids",
        type=_parse_int_list,
        help="comma-separated stop token ids (default: the model's eos ids plus the tokenizer's eos token)",
    )
    regen.add_argument("--trust-remote-code", action="store_true")
    regen.add_argument("--no-progress", action="store_true", help="no progress bar")

    train = _build_train_parser(subparsers)

    push = subparsers.add_parser(
        "push",
        allow_abbrev=False,
        help="publish a trained head on the Hugging Face Hub with its model card",
        description="Upload a head directory with a model card (jetspec_hf.hub.push_head_to_hub).",
    )
    push.add_argument("--head", required=True, help="head directory (from jetspec-hf train)")
    push.add_argument("--repo-id", required=True, help="Hub repo, e.g. me/Qwen3-8B-JetSpec")
    push.add_argument("--target-model", help="Hub id of the target (default: the head config's target_model)")
    push.add_argument("--target-revision", help="the target's revision the head was trained against")
    push.add_argument(
        "--training-json", help=f"training details for the card (default: HEAD/{SUMMARY_FILE} when present)"
    )
    push.add_argument(
        "--measured-json", help="measured acceptance for the card: a JSON object or list (tau, speedup, ...)"
    )
    push.add_argument("--license", help="Hub license id, e.g. apache-2.0")
    push.add_argument("--private", action="store_true", help="create the repo private")
    push.add_argument("--token", help="Hub token (default: the logged-in one)")
    push.add_argument("--commit-message")
    push.add_argument("--no-remote-code", action="store_true", help="do not ship the modeling files (auto_map)")
    push.add_argument("--dry-run", action="store_true", help="print the model card instead of uploading")

    subparsers.add_parser("demo", add_help=False, help="interactive demo (when jetspec_hf.demo is installed)")
    subparsers.add_parser("bench", add_help=False, help="benchmarks (when jetspec_hf.bench is installed)")
    return parser, {"regenerate": regen, "train": train, "push": push}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jetspec-hf` console script; returns the exit status."""
    parser, commands = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if args.command == "demo":
        return run_demo(rest)
    if args.command == "bench":
        return run_bench(rest)
    if args.command == "train":
        return run_train(args, rest, commands["train"])
    if rest:
        commands[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "regenerate":
        return run_regenerate(args, commands["regenerate"])
    return run_push(args, commands["push"])


if __name__ == "__main__":  # python -m jetspec_hf.cli ... (also: accelerate launch -m jetspec_hf.cli train ...)
    sys.exit(main())
