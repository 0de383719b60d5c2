"""Training data for JetSpec draft-head distillation.

The pipeline has three steps:

1. [`load_conversations`] reads chat conversations (`{"messages": [{"role", "content"}, ...]}` rows) from a `.jsonl` or
   `.parquet` file, a `datasets.Dataset` or a list of dicts.
2. [`regenerate`] (optional but recommended) rewrites the assistant turns with the target model itself. A draft head
   is only useful if it predicts what the *target* will say, so training on the target's own outputs rather than on
   the original dataset answers is the key data choice of JetSpec.
3. [`tokenize_conversation`], [`TokenizedChatDataset`] and [`JetSpecDataCollator`] turn conversations into padded
   tensors with a `loss_mask` that is 1 only on the tokens the target generates: assistant contents and their
   end-of-turn token.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging

logger = logging.get_logger(__name__)

ConversationSource = str | os.PathLike | Iterable[dict[str, Any]]

# Arguments of `regenerate` that must not be smuggled in through `generate_kwargs`, so that `do_sample=False` really
# means greedy decoding and the batch-size-1 rule of speculative decoding cannot be bypassed.
_RESERVED_GENERATE_KWARGS = ("max_new_tokens", "do_sample", "temperature", "top_p", "assistant_model")


# ---------------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------------


def load_conversations(source: ConversationSource) -> list[dict[str, Any]]:
    """
    Loads chat conversations and checks that every row has a usable `messages` list.

    Args:
        source: a path to a `.jsonl` or `.parquet` file, a `datasets.Dataset` (pass a split, not a `DatasetDict`), or
            any iterable of dicts such as a list.

    Returns:
        A list of rows `{"messages": [{"role": ..., "content": ...}, ...], ...}`. Extra keys (such as `"id"`) are kept;
        an `"id"` that is `None` (e.g. a missing value in a parquet column) is removed. The messages are shallow
        copies, so callers can edit them without touching `source`.

    Roles are not restricted to `system` / `user` / `assistant`: other roles (e.g. `tool`) are handed to the chat
    template untouched, and it is the template that decides whether it supports them.
    """
    if isinstance(source, (str, os.PathLike)):
        rows = _read_rows(Path(source))
    else:
        rows = source  # a `datasets.Dataset` iterates over its rows as dicts, exactly like a list of dicts
    return [_check_conversation(row, index) for index, row in enumerate(rows)]


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".jsonl":
        rows = []
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{line_number} is not valid JSON: {error}") from error
        return rows
    if path.suffix == ".parquet":
        # `datasets` always depends on `pyarrow`, and reading through `pyarrow` directly avoids `datasets` copying the
        # file into its cache directory, so pyarrow is all we need whichever of the two the user installed.
        try:
            import pyarrow.parquet as pq
        except ImportError as error:
            raise ImportError(
                f"Reading {path} needs `pyarrow` (also installed by `datasets`): `pip install pyarrow`."
            ) from error
        return pq.read_table(path).to_pylist()
    raise ValueError(f"Unsupported conversation file {path}: expected a `.jsonl` or `.parquet` file.")


def _check_conversation(row: Any, index: int) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ValueError(
            f"Conversation {index} is a {type(row).__name__}, expected a dict with a 'messages' key "
            "(for a `datasets.DatasetDict`, pass one split such as `dataset['train']`)."
        )
    messages = row.get("messages")
    if not isinstance(messages, (list, tuple)) or len(messages) == 0:
        raise ValueError(f"Conversation {index} needs a non-empty 'messages' list, got {messages!r}.")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ValueError(f"Conversation {index} has a message without 'role' and 'content': {message!r}.")
    conversation = dict(row)
    conversation["messages"] = [dict(message) for message in messages]
    if conversation.get("id") is None:
        conversation.pop("id", None)
    return conversation


# ---------------------------------------------------------------------------------------------------------------------
# Tokenization
# ---------------------------------------------------------------------------------------------------------------------


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], add_generation_prompt: bool = False
) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template, exactly as the target will see them."""
    encoding = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
    )
    return list(encoding["input_ids"])


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def _special_token_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Ids of special tokens: the named ones plus added tokens flagged special (e.g. `<|im_end|>`, `<end_of_turn>`)."""
    ids = set(tokenizer.all_special_ids)
    ids.update(token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special)
    return ids


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], max_length: int | None
) -> dict[str, list[int]]:
    """
    Tokenizes a conversation with the target's chat template and marks the tokens the draft head must learn.

    `loss_mask[t]` is 1 on every assistant turn's content tokens and on the end-of-turn token the template writes
    right after them (the draft must learn to predict end-of-turn, or speculation would run past the answer). It is 0
    on system / user tokens, on the assistant header (e.g. `"<|im_start|>assistant\\n"`, which the target never
    generates: it is part of the generation prompt) and on any whitespace the template puts after the end-of-turn
    token (e.g. the `"\\n"` after ChatML's `<|im_end|>`).

    Most chat templates lack `{% generation %}` markers, so the assistant spans are found by rendering prefixes of the
    conversation instead: turn `i` starts where `messages[:i]` rendered with the generation prompt ends, and ends where
    `messages[:i + 1]` ends. Two template behaviours are handled conservatively, by leaving tokens out of the mask:

    - a template that renders a turn differently once later messages follow it (e.g. templates that drop the reasoning
      of earlier turns) makes that turn impossible to locate in the full conversation; the turn is left unmasked and a
      warning is logged once.
    - a conversation that *starts* with an assistant turn has no prompt to render a generation prompt for; that turn
      is treated as context and left unmasked.

    Args:
        tokenizer: the target model's tokenizer, with a chat template.
        messages: `[{"role": ..., "content": ...}, ...]`.
        max_length: truncate the tokens (and mask) to this many tokens; `None` keeps everything.

    Returns:
        `{"input_ids": list[int], "loss_mask": list[int]}` of equal lengths. A conversation without an assistant turn
        (a prompt only) gets an all-zero mask.
    """
    input_ids = _render(tokenizer, messages)
    loss_mask = [0] * len(input_ids)
    special_ids = None  # computed on first use; prompt-only conversations never need it

    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i == 0:
            continue
        turn_ids = _render(tokenizer, messages[: i + 1])
        if input_ids[: len(turn_ids)] != turn_ids:
            logger.warning_once(
                "The chat template renders an assistant turn differently once later messages follow it, so the turn "
                "cannot be located in the full conversation; it is left out of the loss mask."
            )
            continue
        # The start is where the two renders diverge, not the generation prompt's length: if the tokenizer merges the
        # end of the header with the start of the content into one token, that token is counted as content instead
        # of misaligning the span.
        prompt_ids = _render(tokenizer, messages[:i], add_generation_prompt=True)
        start = _common_prefix_length(prompt_ids, turn_ids)
        end = len(turn_ids)

        if special_ids is None:
            special_ids = _special_token_ids(tokenizer)
        # Drop the whitespace some templates write after the end-of-turn token: the target stops at end-of-turn and
        # never generates it.
        while end > start and turn_ids[end - 1] not in special_ids:
            if tokenizer.decode([turn_ids[end - 1]]).strip():
                break
            end -= 1
        loss_mask[start:end] = [1] * (end - start)

    if max_length is not None:
        input_ids = input_ids[:max_length]
        loss_mask = loss_mask[:max_length]
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def _pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    raise ValueError("The tokenizer has neither a pad token nor an eos token to pad with; set `tokenizer.pad_token`.")


@dataclass
class JetSpecDataCollator:
    """
    Pads examples from [`tokenize_conversation`] to the longest one in the batch.

    Padding is on the right with the tokenizer's pad token (its eos token if it has none). Padded positions get
    `attention_mask = 0` and `loss_mask = 0`, so the pad token itself never matters.

    Returns `input_ids`, `attention_mask` and `loss_mask`, all `torch.long` of shape `(batch, longest)`.
    """

    tokenizer: PreTrainedTokenizerBase

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        pad_id = _pad_token_id(self.tokenizer)
        longest = max(len(feature["input_ids"]) for feature in features)
        input_ids = torch.full((len(features), longest), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(features), longest), dtype=torch.long)
        loss_mask = torch.zeros((len(features), longest), dtype=torch.long)
        for row, feature in enumerate(features):
            length = len(feature["input_ids"])
            if len(feature["loss_mask"]) != length:
                raise ValueError(f"Example {row} has {length} input_ids but {len(feature['loss_mask'])} loss_mask.")
            input_ids[row, :length] = torch.as_tensor(feature["input_ids"], dtype=torch.long)
            attention_mask[row, :length] = 1
            loss_mask[row, :length] = torch.as_tensor(feature["loss_mask"], dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


class TokenizedChatDataset(Dataset):
    """
    Conversations tokenized up front with [`tokenize_conversation`].

    Tokenizing up front (rather than lazily in `__getitem__`) is what makes it possible to drop the examples whose
    loss mask is empty (prompts only, or assistant turns truncated away by `max_length`) and still know `len()`:
    such examples would cost a forward pass and teach nothing. `num_dropped` tells how many were dropped.

    Args:
        conversations: anything [`load_conversations`] accepts.
        tokenizer: the target model's tokenizer, with a chat template.
        max_length: truncation length in tokens.
    """

    def __init__(self, conversations: ConversationSource, tokenizer: PreTrainedTokenizerBase, max_length: int = 2048):
        conversations = load_conversations(conversations)
        self.examples: list[dict[str, list[int]]] = []
        for conversation in conversations:
            example = tokenize_conversation(tokenizer, conversation["messages"], max_length)
            if any(example["loss_mask"]):
                self.examples.append(example)
        self.num_dropped = len(conversations) - len(self.examples)
        if self.num_dropped:
            logger.info(f"Dropped {self.num_dropped} of {len(conversations)} conversations with no assistant tokens.")

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.examples[index]


# ---------------------------------------------------------------------------------------------------------------------
# Regeneration with the target model
# ---------------------------------------------------------------------------------------------------------------------


def _prompt_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation up to (excluding) its first assistant turn, or all of it when it has none."""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            return messages[:i]
    return messages


def _read_done_ids(output_path: Path) -> set[str]:
    """
    Ids already written to `output_path` by an earlier run, as strings.

    An interrupted run can leave a partial last line; it is cut off so that the next append starts on a clean line
    (that conversation is simply generated again). A missing final newline is added for the same reason.
    """
    if not output_path.exists():
        return set()
    data = output_path.read_bytes()
    done = set()
    offset = 0
    # Split on b"\n" only: `str.splitlines` would also split on U+2028 and friends, which `json.dumps(...,
    # ensure_ascii=False)` writes unescaped inside strings.
    lines = data.split(b"\n")
    for line_number, line in enumerate(lines, start=1):
        is_last = line_number == len(lines)
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                if not is_last:
                    raise ValueError(f"{output_path}:{line_number} is not valid JSON: {error}") from error
                logger.warning(f"Dropping the incomplete last line of {output_path} left by an interrupted run.")
                with open(output_path, "r+b") as f:
                    f.truncate(offset)
                break
            if not isinstance(row, dict) or row.get("id") is None:
                raise ValueError(f"{output_path}:{line_number} has no 'id', so the run cannot be resumed.")
            done.add(str(row["id"]))
            if is_last:  # valid JSON but no trailing newline (the file was written by something else)
                with open(output_path, "ab") as f:
                    f.write(b"\n")
        offset += len(line) + 1
    return done


def _left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding, so that every prompt ends at the same position and generation continues right after it."""
    longest = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, longest - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def _as_id_list(token_ids: int | list[int] | torch.Tensor | None) -> list[int]:
    if token_ids is None:
        return []
    if isinstance(token_ids, torch.Tensor):
        return token_ids.flatten().tolist()
    if isinstance(token_ids, int):
        return [token_ids]
    return list(token_ids)


def regenerate(
    model,
    tokenizer: PreTrainedTokenizerBase,
    conversations: ConversationSource,
    output_path: str | os.PathLike,
    *,
    max_new_tokens: int = 512,
    batch_size: int = 8,
    do_sample: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    generate_kwargs: dict[str, Any] | None = None,
    progress: bool = True,
    assistant_model=None,
) -> dict[str, Any]:
    """
    Rewrites the assistant answer of every conversation with the target model, so the draft head trains on the
    distribution it will have to predict.

    For each conversation, the prompt is the conversation up to (excluding) its first assistant turn, or the whole
    conversation if it has none. The target answers it (chat template with `add_generation_prompt=True`) and the
    output row is `prompt + [{"role": "assistant", "content": answer}]`. Regeneration is single-turn: the first
    assistant turn and everything after it are replaced by the one new answer, so later turns are dropped. Other keys
    of the input row are kept. Conversations that start with an assistant turn have no prompt and are dropped with a
    warning.

    The run is resumable: one JSON line per finished conversation is appended to `output_path` (flushed after each
    batch) and carries the input `"id"` (`str(index)` when the input has none); ids already in `output_path` are
    skipped. Ids are compared as strings.

    Args:
        model: the target `PreTrainedModel` (anything with `generate`, `device` and `generation_config`).
        tokenizer: its tokenizer, with a chat template.
        conversations: anything [`load_conversations`] accepts.
        output_path: the `.jsonl` file to append to.
        max_new_tokens: answer length limit.
        batch_size: prompts per `generate` call, left-padded. Forced to 1 when `assistant_model` is given.
        do_sample: greedy decoding when `False` (the default). `temperature` / `top_p` are then never passed to
            `generate`; when `True`, unset ones come from `model.generation_config`, i.e. the model's recommended
            sampling settings.
        temperature, top_p: sampling settings, used only with `do_sample=True`.
        generate_kwargs: extra arguments for `model.generate` (e.g. `eos_token_id`, `top_k`, `min_new_tokens`).
        progress: show a tqdm progress bar.
        assistant_model: a draft (e.g. a JetSpec head) to speed up generation with speculative decoding. Speculative
            decoding works on one sequence at a time, so conversations are then generated one by one.

    Returns:
        `{"done": ..., "skipped": ..., "dropped": ..., "new_tokens": ..., "truncated": ..., "seconds": ...}`:
        conversations generated now, skipped because already in `output_path`, dropped for having no prompt, tokens
        generated (up to and including end-of-turn), answers cut by `max_new_tokens` before their end-of-turn, and
        wall-clock seconds. Truncated answers are still written; when tokenized, the chat template closes them with an
        end-of-turn token the target did not generate, so keep `truncated` small by giving enough `max_new_tokens`.
    """
    start_time = time.perf_counter()
    generate_kwargs = dict(generate_kwargs or {})
    reserved = sorted(set(generate_kwargs) & set(_RESERVED_GENERATE_KWARGS))
    if reserved:
        raise ValueError(f"Pass {reserved} as arguments of `regenerate`, not in `generate_kwargs`.")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be at least 1, got {batch_size}.")
    if assistant_model is not None:
        batch_size = 1

    generate_kwargs.update(max_new_tokens=max_new_tokens, do_sample=do_sample)
    if do_sample:
        if temperature is not None:
            generate_kwargs["temperature"] = temperature
        if top_p is not None:
            generate_kwargs["top_p"] = top_p
    elif temperature is not None or top_p is not None:
        logger.warning("`temperature` and `top_p` are ignored because `do_sample=False` (greedy decoding).")
    if assistant_model is not None:
        generate_kwargs["assistant_model"] = assistant_model
    pad_id = _pad_token_id(tokenizer)
    if model.generation_config.pad_token_id is None:
        generate_kwargs.setdefault("pad_token_id", pad_id)
    eos_ids = set(_as_id_list(generate_kwargs.get("eos_token_id", model.generation_config.eos_token_id)))

    output_path = Path(output_path)
    done_ids = _read_done_ids(output_path)
    pending = []
    skipped = dropped = 0
    for index, conversation in enumerate(load_conversations(conversations)):
        conversation_id = conversation.get("id", str(index))
        if str(conversation_id) in done_ids:
            skipped += 1
            continue
        prompt = _prompt_messages(conversation["messages"])
        if not prompt:
            logger.warning(f"Conversation {conversation_id!r} starts with an assistant turn: no prompt, dropped.")
            dropped += 1
            continue
        pending.append((conversation_id, conversation, prompt))

    output_path.parent.mkdir(parents=True, exist_ok=True)
    new_tokens = truncated = 0
    with (
        open(output_path, "a", encoding="utf-8") as output_file,
        tqdm(total=len(pending), desc="Regenerating", unit="conv", disable=not progress) as progress_bar,
    ):
        for batch_start in range(0, len(pending), batch_size):
            batch = pending[batch_start : batch_start + batch_size]
            prompts = [_render(tokenizer, prompt, add_generation_prompt=True) for _, _, prompt in batch]
            input_ids, attention_mask = _left_pad(prompts, pad_id, model.device)
            output = model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)
            sequences = output if isinstance(output, torch.Tensor) else output.sequences
            for (conversation_id, conversation, prompt), generated in zip(
                batch, sequences[:, input_ids.shape[1] :], strict=True
            ):
                generated = generated.tolist()
                # Everything after the first end-of-turn is padding from sequences that finished earlier.
                length = next((i for i, token in enumerate(generated) if token in eos_ids), len(generated))
                new_tokens += min(length + 1, len(generated))
                truncated += length == len(generated)
                answer = tokenizer.decode(generated[:length], skip_special_tokens=True)
                row = {key: value for key, value in conversation.items() if key not in ("id", "messages")}
                row = {"id": conversation_id, **row, "messages": prompt + [{"role": "assistant", "content": answer}]}
                output_file.write(json.dumps(row, ensure_ascii=False) + "\n")
            output_file.flush()
            progress_bar.update(len(batch))

    return {
        "done": len(pending),
        "skipped": skipped,
        "dropped": dropped,
        "new_tokens": new_tokens,
        "truncated": truncated,
        "seconds": time.perf_counter() - start_time,
    }
