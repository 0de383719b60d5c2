"""Tests of the distillation data layer with a real (tiny) tokenizer and real (tiny) Llama models, no mocks."""

import copy
import importlib.util
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from jetspec_hf.data import (
    JetSpecDataCollator,
    TokenizedChatDataset,
    load_conversations,
    regenerate,
    tokenize_conversation,
)

SYSTEM = "You are a helpful assistant."
TWO_TURNS = [
    {"role": "user", "content": "Hello there!"},
    {"role": "assistant", "content": "I am fine, thank you."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Two plus two is four."},
]
CONVERSATIONS = [
    {"id": "a", "messages": [{"role": "system", "content": SYSTEM}, *TWO_TURNS]},
    {"messages": [{"role": "user", "content": "Tell me a short joke about cats."}]},  # prompt only, no id
    {"id": "c", "messages": TWO_TURNS[:2], "source": "unit-test"},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]},  # no id
    {"id": "e", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And you?"}]},
]
EXPECTED_IDS = ["a", "1", "c", "3", "e"]
MAX_NEW_TOKENS = 8


def masked_spans(example, tokenizer):
    """Decoded text of each run of consecutive `loss_mask == 1` tokens."""
    spans, start = [], None
    for position, flag in enumerate([*example["loss_mask"], 0]):
        if flag and start is None:
            start = position
        elif not flag and start is not None:
            spans.append(tokenizer.decode(example["input_ids"][start:position]))
            start = None
    return spans


class CountingLlama(LlamaForCausalLM):
    """A real tiny Llama that records the batch size of every `generate` call, to check what `regenerate` runs."""

    def __init__(self, config):
        super().__init__(config)
        self.generate_batch_sizes = []

    def generate(self, *args, **kwargs):
        self.generate_batch_sizes.append(kwargs["input_ids"].shape[0])
        return super().generate(*args, **kwargs)


def tiny_llama(tokenizer, seed, model_class=LlamaForCausalLM):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return model_class(config).eval()


def prompt_ids(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")


def generate_directly(model, tokenizer, messages):
    """
    The reference answer: one unpadded greedy `generate` call, decoded without the end-of-turn token, and the tokens
    generated (end-of-turn included: a single sequence stops right after it).
    """
    inputs = prompt_ids(tokenizer, messages)
    output = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    generated = output[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(generated, skip_special_tokens=True), generated.tolist()


@pytest.fixture
def target(chat_tokenizer):
    """
    A tiny random target that ends its turn early on some prompts.

    A random model almost never picks end-of-turn, so the end-of-turn row of `lm_head` is set to a copy (scaled by
    1.0001) of the row of the 4th token the model generates for the first prompt: wherever that token would have been
    the (positive) argmax, end-of-turn now wins by a hair, and elsewhere nothing changes. So the first conversation
    ends after 3 tokens, and the others wherever they would have produced that token.
    """
    model = tiny_llama(chat_tokenizer, seed=0, model_class=CountingLlama)
    inputs = prompt_ids(chat_tokenizer, CONVERSATIONS[0]["messages"][:2])
    fourth_token = model.generate(**inputs, max_new_tokens=4, do_sample=False)[0, -1]
    with torch.no_grad():
        model.lm_head.weight[chat_tokenizer.eos_token_id] = 1.0001 * model.lm_head.weight[fourth_token]
    model.generate_batch_sizes.clear()
    return model


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------------


def test_load_conversations_from_list_and_jsonl(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in CONVERSATIONS) + "\n\n", encoding="utf-8")

    assert load_conversations(path) == CONVERSATIONS
    assert load_conversations(str(path)) == CONVERSATIONS
    loaded = load_conversations(CONVERSATIONS)
    assert loaded == CONVERSATIONS
    loaded[0]["messages"][0]["content"] = "changed"  # the loaded rows are copies
    assert CONVERSATIONS[0]["messages"][0]["content"] == SYSTEM
    assert load_conversations([{"id": None, "messages": TWO_TURNS}]) == [{"messages": TWO_TURNS}]


@pytest.mark.parametrize(
    "rows, error",
    [
        ([{"text": "no messages"}], "non-empty 'messages'"),
        ([{"messages": []}], "non-empty 'messages'"),
        ([{"messages": [{"content": "no role"}]}], "without 'role'"),
        (["train"], "DatasetDict"),
    ],
)
def test_load_conversations_rejects_bad_rows(rows, error):
    with pytest.raises(ValueError, match=error):
        load_conversations(rows)


def test_load_conversations_rejects_unknown_files(tmp_path):
    with pytest.raises(ValueError, match="expected a `.jsonl` or `.parquet`"):
        load_conversations(tmp_path / "chats.csv")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n{not json\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_conversations(bad)


# ---------------------------------------------------------------------------------------------------------------------
# Tokenization and loss mask
# ---------------------------------------------------------------------------------------------------------------------


def test_loss_mask_covers_assistant_contents_and_end_of_turn(chat_tokenizer):
    example = tokenize_conversation(chat_tokenizer, TWO_TURNS, max_length=1024)

    # Same tokens as the chat template gives the target.
    assert example["input_ids"] == chat_tokenizer.apply_chat_template(TWO_TURNS)["input_ids"]
    assert len(example["loss_mask"]) == len(example["input_ids"])
    assert masked_spans(example, chat_tokenizer) == [
        "I am fine, thank you.<|im_end|>",
        "Two plus two is four.<|im_end|>",
    ]
    # Everything else (user turns, assistant headers, the newline after <|im_end|>) is unmasked.
    unmasked = [token for token, flag in zip(example["input_ids"], example["loss_mask"], strict=True) if not flag]
    assert chat_tokenizer.decode(unmasked) == (
        "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n\n"
        "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n\n"
    )


def test_loss_mask_excludes_system_message(chat_tokenizer):
    messages = CONVERSATIONS[0]["messages"]
    example = tokenize_conversation(chat_tokenizer, messages, max_length=None)

    assert masked_spans(example, chat_tokenizer) == [
        "I am fine, thank you.<|im_end|>",
        "Two plus two is four.<|im_end|>",
    ]
    first_masked = example["loss_mask"].index(1)
    assert chat_tokenizer.decode(example["input_ids"][:first_masked]).startswith(f"<|im_start|>system\n{SYSTEM}")


def test_loss_mask_truncation(chat_tokenizer):
    full = tokenize_conversation(chat_tokenizer, TWO_TURNS, max_length=None)
    cut = len(full["input_ids"]) - 4  # inside the second answer
    truncated = tokenize_conversation(chat_tokenizer, TWO_TURNS, max_length=cut)

    assert truncated["input_ids"] == full["input_ids"][:cut]
    assert truncated["loss_mask"] == full["loss_mask"][:cut]
    first, second = masked_spans(truncated, chat_tokenizer)
    assert first == "I am fine, thank you.<|im_end|>"
    assert second and "Two plus two is four.".startswith(second) and second != "Two plus two is four."


def test_prompt_only_conversation_has_empty_mask(chat_tokenizer):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there!"}]
    example = tokenize_conversation(chat_tokenizer, messages, max_length=1024)

    assert len(example["input_ids"]) > 0
    assert not any(example["loss_mask"])


def test_conversation_ending_with_user_turn_keeps_earlier_answers(chat_tokenizer):
    example = tokenize_conversation(chat_tokenizer, TWO_TURNS[:3], max_length=1024)

    assert masked_spans(example, chat_tokenizer) == ["I am fine, thank you.<|im_end|>"]


def test_turn_rendered_differently_later_is_left_unmasked(chat_tokenizer):
    # Like templates that drop the reasoning of earlier turns: only the last assistant turn shows its content.
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['role'] == 'assistant' and not loop.last %}{{ '...' }}"
        "{% else %}{{ message['content'] }}{% endif %}"
        "{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    example = tokenize_conversation(tokenizer, TWO_TURNS, max_length=1024)

    assert masked_spans(example, tokenizer) == ["Two plus two is four.<|im_end|>"]


def test_leading_assistant_turn_is_context(chat_tokenizer):
    messages = [{"role": "assistant", "content": "Hello!"}, *TWO_TURNS[:2]]
    example = tokenize_conversation(chat_tokenizer, messages, max_length=1024)

    assert masked_spans(example, chat_tokenizer) == ["I am fine, thank you.<|im_end|>"]


# ---------------------------------------------------------------------------------------------------------------------
# Collator and dataset
# ---------------------------------------------------------------------------------------------------------------------


def test_collator_pads_right_to_longest(chat_tokenizer):
    long = tokenize_conversation(chat_tokenizer, TWO_TURNS, max_length=None)
    short = tokenize_conversation(chat_tokenizer, TWO_TURNS[:2], max_length=None)
    batch = JetSpecDataCollator(chat_tokenizer)([short, long])

    longest, shortest = len(long["input_ids"]), len(short["input_ids"])
    for name in ("input_ids", "attention_mask", "loss_mask"):
        assert batch[name].shape == (2, longest)
        assert batch[name].dtype == torch.long
    assert batch["input_ids"][1].tolist() == long["input_ids"]
    assert batch["input_ids"][0].tolist() == short["input_ids"] + [chat_tokenizer.pad_token_id] * (longest - shortest)
    assert batch["attention_mask"].sum(dim=1).tolist() == [shortest, longest]
    assert batch["loss_mask"][0].tolist() == short["loss_mask"] + [0] * (longest - shortest)
    assert batch["loss_mask"][1].tolist() == long["loss_mask"]


def test_collator_pads_with_eos_without_pad_token(chat_tokenizer):
    tokenizer = chat_tokenizer.__class__(tokenizer_object=chat_tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    assert tokenizer.pad_token_id is None
    features = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [5], "loss_mask": [0]}]
    batch = JetSpecDataCollator(tokenizer)(features)

    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, tokenizer.eos_token_id, tokenizer.eos_token_id]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_dataset_drops_rows_without_assistant_tokens(chat_tokenizer):
    conversations = [
        {"messages": TWO_TURNS},
        {"messages": TWO_TURNS[:1]},  # prompt only
        {"messages": [{"role": "system", "content": SYSTEM * 20}, *TWO_TURNS[:2]]},  # answer truncated away
    ]
    dataset = TokenizedChatDataset(conversations, chat_tokenizer, max_length=64)

    assert len(dataset) == 1
    assert dataset.num_dropped == 2
    assert dataset[0] == tokenize_conversation(chat_tokenizer, TWO_TURNS, max_length=64)
    assert JetSpecDataCollator(chat_tokenizer)([dataset[0]])["loss_mask"].sum() > 0


# ---------------------------------------------------------------------------------------------------------------------
# Regeneration with the target
# ---------------------------------------------------------------------------------------------------------------------


def expected_prompt(messages):
    roles = [message["role"] for message in messages]
    return messages[: roles.index("assistant")] if "assistant" in roles else messages


def test_regenerate_matches_greedy_generate_for_any_batch_size(chat_tokenizer, target, tmp_path):
    summary_1 = regenerate(
        target,
        chat_tokenizer,
        CONVERSATIONS,
        tmp_path / "b1.jsonl",
        max_new_tokens=MAX_NEW_TOKENS,
        batch_size=1,
        progress=False,
    )
    assert target.generate_batch_sizes == [1] * 5
    target.generate_batch_sizes.clear()
    summary_3 = regenerate(
        target,
        chat_tokenizer,
        CONVERSATIONS,
        tmp_path / "b3.jsonl",
        max_new_tokens=MAX_NEW_TOKENS,
        batch_size=3,
        progress=False,
    )
    assert target.generate_batch_sizes == [3, 2]

    rows = read_jsonl(tmp_path / "b1.jsonl")
    assert read_jsonl(tmp_path / "b3.jsonl") == rows
    assert [row["id"] for row in rows] == EXPECTED_IDS
    assert rows[2]["source"] == "unit-test"  # extra keys survive
    expected_tokens = expected_truncated = 0
    for row, conversation in zip(rows, CONVERSATIONS, strict=True):
        prompt = expected_prompt(conversation["messages"])
        answer, tokens = generate_directly(target, chat_tokenizer, prompt)
        assert row["messages"][:-1] == prompt  # later turns are dropped
        assert row["messages"][-1] == {"role": "assistant", "content": answer}
        assert "<|im_end|>" not in answer
        expected_tokens += len(tokens)
        expected_truncated += tokens[-1] != chat_tokenizer.eos_token_id

    # Some answers end early with end-of-turn (see the `target` fixture), so padding after a finished sequence is
    # exercised by batch_size=3, and the token count stops at end-of-turn.
    assert len(generate_directly(target, chat_tokenizer, CONVERSATIONS[0]["messages"][:2])[1]) <= 4
    assert 0 < expected_truncated < 5
    for summary in (summary_1, summary_3):
        assert summary["done"] == 5 and summary["skipped"] == 0 and summary["dropped"] == 0
        assert summary["new_tokens"] == expected_tokens
        assert summary["truncated"] == expected_truncated
        assert summary["seconds"] > 0


def test_regenerate_resumes(chat_tokenizer, target, tmp_path):
    output_path = tmp_path / "out" / "regenerated.jsonl"
    first = regenerate(
        target, chat_tokenizer, CONVERSATIONS[:2], output_path, max_new_tokens=MAX_NEW_TOKENS, progress=False
    )
    assert first["done"] == 2 and target.generate_batch_sizes == [2]
    target.generate_batch_sizes.clear()

    second = regenerate(
        target,
        chat_tokenizer,
        CONVERSATIONS,
        output_path,
        max_new_tokens=MAX_NEW_TOKENS,
        batch_size=2,
        progress=False,
    )
    assert second["done"] == 3 and second["skipped"] == 2
    assert target.generate_batch_sizes == [2, 1]  # only the 3 new conversations went through the target
    rows = read_jsonl(output_path)
    assert [row["id"] for row in rows] == EXPECTED_IDS

    # An interrupted run leaves a partial last line: it is dropped and that conversation generated again.
    output_path.write_text(output_path.read_text(encoding="utf-8") + '{"id": "f", "messa', encoding="utf-8")
    target.generate_batch_sizes.clear()
    extra = {"id": "f", "messages": [{"role": "user", "content": "hi"}]}
    third = regenerate(
        target, chat_tokenizer, [*CONVERSATIONS, extra], output_path, max_new_tokens=MAX_NEW_TOKENS, progress=False
    )
    assert third["done"] == 1 and third["skipped"] == 5 and target.generate_batch_sizes == [1]
    assert [row["id"] for row in read_jsonl(output_path)] == [*EXPECTED_IDS, "f"]


def test_regenerate_reads_jsonl_and_parquet(chat_tokenizer, target, tmp_path):
    jsonl_path = tmp_path / "chats.jsonl"
    jsonl_path.write_text("".join(json.dumps(row) + "\n" for row in CONVERSATIONS), encoding="utf-8")
    regenerate(target, chat_tokenizer, jsonl_path, tmp_path / "from_jsonl.jsonl", max_new_tokens=4, progress=False)
    expected = read_jsonl(tmp_path / "from_jsonl.jsonl")
    assert [row["id"] for row in expected] == EXPECTED_IDS

    if importlib.util.find_spec("pyarrow") is None:  # `datasets` depends on pyarrow, so this covers both
        pytest.skip("reading parquet needs pyarrow or datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet_path = tmp_path / "chats.parquet"
    columns = {key: [row.get(key) for row in CONVERSATIONS] for key in ("id", "messages", "source")}
    pq.write_table(pa.Table.from_pydict(columns), parquet_path)
    loaded = load_conversations(parquet_path)
    assert [row["messages"] for row in loaded] == [row["messages"] for row in CONVERSATIONS]
    regenerate(target, chat_tokenizer, parquet_path, tmp_path / "from_parquet.jsonl", max_new_tokens=4, progress=False)
    # Parquet fills columns missing from a row with nulls ("source"), otherwise the rows are the same.
    from_parquet = read_jsonl(tmp_path / "from_parquet.jsonl")
    assert [{k: v for k, v in row.items() if v is not None} for row in from_parquet] == expected


def test_regenerate_with_assistant_model_generates_one_by_one(chat_tokenizer, target, tmp_path):
    greedy_path, assisted_path = tmp_path / "greedy.jsonl", tmp_path / "assisted.jsonl"
    regenerate(target, chat_tokenizer, CONVERSATIONS, greedy_path, max_new_tokens=MAX_NEW_TOKENS, progress=False)
    target.generate_batch_sizes.clear()

    draft = tiny_llama(chat_tokenizer, seed=1)
    regenerate(
        target,
        chat_tokenizer,
        CONVERSATIONS,
        assisted_path,
        max_new_tokens=MAX_NEW_TOKENS,
        batch_size=8,
        assistant_model=draft,
        progress=False,
    )
    assert target.generate_batch_sizes == [1] * 5
    # Greedy speculative decoding is lossless: same answers as plain greedy decoding.
    assert read_jsonl(assisted_path) == read_jsonl(greedy_path)


def test_regenerate_sampling_and_argument_checks(chat_tokenizer, target, tmp_path):
    torch.manual_seed(0)
    summary = regenerate(
        target,
        chat_tokenizer,
        CONVERSATIONS,
        tmp_path / "sampled.jsonl",
        max_new_tokens=4,
        do_sample=True,
        temperature=0.7,
        top_p=0.9,
        generate_kwargs={"top_k": 20},
        progress=False,
    )
    assert summary["done"] == 5 and len(read_jsonl(tmp_path / "sampled.jsonl")) == 5

    with pytest.raises(ValueError, match="not in `generate_kwargs`"):
        regenerate(target, chat_tokenizer, CONVERSATIONS, tmp_path / "x.jsonl", generate_kwargs={"temperature": 0.5})
    with pytest.raises(ValueError, match="batch_size"):
        regenerate(target, chat_tokenizer, CONVERSATIONS, tmp_path / "x.jsonl", batch_size=0)

    leading_assistant = [{"id": "z", "messages": [{"role": "assistant", "content": "Hello!"}]}]
    summary = regenerate(target, chat_tokenizer, leading_assistant, tmp_path / "z.jsonl", progress=False)
    assert summary["dropped"] == 1 and summary["done"] == 0


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow is installed")
def test_parquet_without_pyarrow_raises_a_clear_error(tmp_path):
    (tmp_path / "chats.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_conversations(tmp_path / "chats.parquet")
