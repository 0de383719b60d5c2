"""The `jetspec-hf` command line, run in-process (`main([...])`) on a tiny Llama target saved with a real tokenizer."""

import copy
import json
import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaForCausalLM

from jetspec_hf import JetSpecDraftHead, check_head_fits_target
from jetspec_hf.cli import SUMMARY_FILE, card_training_info, default_mask_token_id, head_config_for_target, main

from tiny_models import tiny_target

PROMPTS = [
    "Hello there! How are you today?",
    "What is two plus two?",
    "Tell me a short joke about cats and dogs.",
]

TRAINER_FLAGS = ["--use_cpu", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--seed", "0"]


def tiny_llama(vocab: int, **config) -> LlamaForCausalLM:
    """Unsharpened logits (logit_scale 1); pad token 0, whose row Llama's embedding zeroes (padding_idx)."""
    overrides = dict(vocab_size=vocab, max_position_embeddings=256, initializer_range=0.2, pad_token_id=0)
    return tiny_target("llama", logit_scale=1.0, **{**overrides, **config})


def regenerate_args(workdir, output, *extra) -> list[str]:
    """`regenerate` of the workdir's prompts with the workdir's target, 12 new tokens, then `extra`."""
    target, data = str(workdir / "target"), str(workdir / "prompts.jsonl")
    return ["regenerate", "--target", target, "--data", data, "--output", str(output), "--max-new-tokens", "12", *extra]


def train_args(workdir, data, output_dir, *extra) -> list[str]:
    """`train` of a head for the workdir's target on `data`, saved to `output_dir`, then `extra`."""
    return ["train", "--target", str(workdir / "target"), "--data", str(data), "--output-dir", str(output_dir), *extra]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, chat_tokenizer):
    """A saved tiny target + tokenizer, prompts, and (once) the regenerated data and a trained head."""
    root = tmp_path_factory.mktemp("cli")
    target_dir = root / "target"
    tiny_llama(len(chat_tokenizer)).save_pretrained(target_dir)
    chat_tokenizer.save_pretrained(target_dir)
    prompts = root / "prompts.jsonl"
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": text}]} for i, text in enumerate(PROMPTS)]
    rows[1]["messages"].append({"role": "assistant", "content": "An answer that regeneration replaces."})
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def regenerated(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def regenerated_data(workdir):
    output = workdir / "regenerated.jsonl"
    code = main(regenerate_args(workdir, output, "--batch-size", "2", "--no-progress"))
    assert code == 0
    return output


@pytest.fixture(scope="module")
def trained_head(workdir, regenerated_data):
    head_dir = workdir / "head"
    code = main(
        train_args(
            workdir,
            regenerated_data,
            head_dir,
            "--eval-data",
            str(regenerated_data),
            "--tree-tau-prompts",
            "2",
            "--block-size",
            "4",
            "--num-layers",
            "1",
            "--target-layers",
            "0,2",
            "--num-anchors",
            "4",
            "--loss",
            "fkl",
            "--gamma",
            "2",
            "--max_steps",
            "3",
            "--per_device_train_batch_size",
            "2",
            "--learning_rate",
            "1e-3",
            "--logging_steps",
            "1",
            *TRAINER_FLAGS,
        )
    )
    assert code == 0
    return head_dir


def test_regenerate_writes_target_answers_and_resumes(workdir, regenerated_data, capsys):
    rows = regenerated(regenerated_data)
    assert [row["id"] for row in rows] == ["p0", "p1", "p2"]
    for row, prompt in zip(rows, PROMPTS):
        assert row["messages"][0] == {"role": "user", "content": prompt}
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
    assert rows[1]["messages"][1]["content"] != "An answer that regeneration replaces."
    # a second run skips everything and says so
    code = main(regenerate_args(workdir, regenerated_data, "--no-progress"))
    assert code == 0
    out = capsys.readouterr().out
    assert "0 done, 3 skipped" in out and "tokens/s" in out
    assert len(regenerated(regenerated_data)) == 3


def test_train_saves_a_head_that_fits_and_a_summary(workdir, trained_head, capsys):
    head = JetSpecDraftHead.from_pretrained(trained_head)
    target = AutoModelForCausalLM.from_pretrained(workdir / "target", attn_implementation="sdpa")
    check_head_fits_target(head, target)
    config = head.config
    assert (config.block_size, config.num_hidden_layers, config.target_layer_ids) == (4, 1, [0, 2])
    # default mask token: not the pad token 0, whose embedding row is zero (padding_idx), but the eos token
    assert config.causal and config.mask_token_id == 2
    assert config.hidden_size == 32 and config.num_key_value_heads == 2 and config.head_dim == 8
    assert config.rope_parameters["rope_theta"] == target.config.rope_parameters["rope_theta"]
    assert config.target_model == str(workdir / "target")

    summary = json.loads((trained_head / SUMMARY_FILE).read_text())
    assert summary["steps"] == 3 and summary["num_examples"] == 3 and summary["num_loss_tokens"] > 0
    assert summary["loss"] == "fkl" and summary["gamma"] == 2.0 and summary["anchors"] == 4 and summary["lr"] == 1e-3
    assert summary["final_loss"] is not None and summary["seconds"] > 0
    assert {"eval_loss", "eval_expected_accept_len", "eval_acc_depth_3", "eval_tree_tau"} <= set(summary["eval"])
    assert summary["eval"]["eval_tree_tau"] >= 1.0  # real generate() tau on two held-out prompts
    card = card_training_info(summary)
    assert card["steps"] == 3 and "3 examples" in card["data"] and card["loss"] == "fkl, gamma=2"


def test_speculative_regeneration_with_the_trained_head_is_lossless(workdir, regenerated_data, trained_head, capsys):
    output = workdir / "speculative.jsonl"
    code = main(
        regenerate_args(
            workdir, output, "--head", str(trained_head), "--tree-budget", "8", "--limit", "2", "--no-progress"
        )
    )
    assert code == 0
    assert "tau" in capsys.readouterr().out
    assert regenerated(output) == regenerated(regenerated_data)[:2]


def test_fine_tune_from_init_head(workdir, regenerated_data, trained_head):
    out_dir = workdir / "finetuned"
    flags = ["--max_steps", "1", "--per_device_train_batch_size", "2", "--num-anchors", "2", *TRAINER_FLAGS]
    common = train_args(workdir, regenerated_data, out_dir)
    with pytest.raises(SystemExit) as error:  # the architecture comes from the head
        main([*common, "--init-head", str(trained_head), "--block-size", "8", *flags])
    assert error.value.code == 2
    assert main([*common, "--init-head", str(trained_head), "--loss", "sft", *flags]) == 0
    head = JetSpecDraftHead.from_pretrained(out_dir)
    assert head.config.block_size == 4
    summary = json.loads((out_dir / SUMMARY_FILE).read_text())
    assert summary["init_head"] == str(trained_head) and summary["loss"] == "sft" and summary["steps"] == 1


def test_train_rejects_bad_arguments(workdir, regenerated_data, capsys):
    common = train_args(workdir, regenerated_data, workdir / "bad", *TRAINER_FLAGS)
    for extra, message in [
        (["--mask-token-id", "100000"], "outside the target's vocabulary"),
        (["--target-layers", "0,3"], "out of range"),  # tap 3 = the last layer of 4: not a valid tap
        (["--no_such_option", "1"], "unrecognized arguments"),
        (["--loss", "kl"], "invalid choice"),
        (["--eval_strategy", "steps"], "eval_dataset"),  # no --eval-data
    ]:
        with pytest.raises(SystemExit) as error:
            main([*common, *extra])
        assert error.value.code == 2
        assert message in capsys.readouterr().err, extra
    with pytest.raises(SystemExit):
        main(["train", "--data", str(regenerated_data)])
    assert "--target" in capsys.readouterr().err


def test_train_help_lists_jetspec_and_trainer_options(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--mask-token-id", "--target-layers", "--bidirectional", "--learning_rate", "--max_steps", "--bf16"):
        assert flag in out, flag
    assert "learning_rate=0.0003" in out


def test_default_mask_token_and_head_config(chat_tokenizer):
    # vocabulary == tokenizer: the pad token, unless its embedding row is zero (padding_idx): then eos
    target = tiny_llama(len(chat_tokenizer), pad_token_id=None)
    assert default_mask_token_id(target, chat_tokenizer)[0] == chat_tokenizer.pad_token_id == 0
    assert default_mask_token_id(tiny_llama(len(chat_tokenizer)), chat_tokenizer)[0] == chat_tokenizer.eos_token_id
    # embedding rows beyond the tokenizer: the first of them (the Qwen3 DFlash convention), unless its row is zero
    bigger = tiny_llama(len(chat_tokenizer) + 8, pad_token_id=None)
    assert default_mask_token_id(bigger, chat_tokenizer)[0] == len(chat_tokenizer)
    with torch.no_grad():
        bigger.get_input_embeddings().weight[len(chat_tokenizer)] = 0
    assert default_mask_token_id(bigger, chat_tokenizer)[0] == chat_tokenizer.pad_token_id
    # special tokens: a reserved/unused-named one first, else the last one the chat template does not write
    reserved = copy.deepcopy(chat_tokenizer)
    reserved.add_tokens(["<empty_output>", "<|reserved_special_token_0|>"], special_tokens=True)
    reserved_id = reserved.convert_tokens_to_ids("<|reserved_special_token_0|>")
    assert default_mask_token_id(tiny_llama(len(reserved)), reserved)[0] == reserved_id
    other = copy.deepcopy(chat_tokenizer)
    other.add_tokens(["<empty_output>", "<sep>"], special_tokens=True)
    other.chat_template = chat_tokenizer.chat_template.replace("<|im_end|>", "<|im_end|><sep>")
    chosen, reason = default_mask_token_id(tiny_llama(len(other)), other)
    assert chosen == other.convert_tokens_to_ids("<empty_output>") and "unused by the chat template" in reason

    # authors' tap rule by default; Gemma 3's per-layer-type rope: the full-attention one
    config = head_config_for_target(target, num_layers=2, mask_token_id=5)
    assert config.target_layer_ids == [1, 1] and config.block_size == 16 and config.causal
    torch.manual_seed(0)
    gemma = Gemma3ForCausalLM(
        Gemma3TextConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=64,
        )
    )
    gemma.set_attn_implementation("sdpa")
    config = head_config_for_target(gemma, mask_token_id=3, causal=False)
    assert config.rope_parameters == gemma.config.rope_parameters["full_attention"] and not config.causal
    check_head_fits_target(JetSpecDraftHead(config), gemma)


def test_push_dry_run_and_push(trained_head, monkeypatch, capsys):
    measured = trained_head.parent / "measured.json"
    measured.write_text(json.dumps([{"tau": 2.5, "budget": 16, "hardware": "cpu"}]))
    common = ["push", "--head", str(trained_head), "--repo-id", "me/tiny-head", "--target-model", "me/tiny-target"]
    assert main([*common, "--measured-json", str(measured), "--dry-run"]) == 0
    card = capsys.readouterr().out
    assert "base_model: me/tiny-target" in card and "fkl, gamma=2" in card and "2.5" in card

    calls = []

    def fake_push(head, repo_id, **kwargs):
        calls.append((head, repo_id, kwargs))
        return "https://huggingface.co/me/tiny-head/commit/abc"

    monkeypatch.setattr("jetspec_hf.hub.push_head_to_hub", fake_push)
    assert main([*common, "--target-revision", "v1", "--license", "apache-2.0", "--private"]) == 0
    ((head, repo_id, kwargs),) = calls
    assert repo_id == "me/tiny-head" and isinstance(head, JetSpecDraftHead)
    assert kwargs["target_model"] == "me/tiny-target" and kwargs["target_revision"] == "v1"
    assert kwargs["training"]["steps"] == 3  # HEAD/training_summary.json is picked up by default
    assert kwargs["private"] is True and kwargs["license"] == "apache-2.0" and kwargs["remote_code"] is True
    assert "me/tiny-head" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_demo_and_bench_slots(command, monkeypatch, capsys):
    # not installed: a message and exit status 2
    monkeypatch.setitem(sys.modules, f"jetspec_hf.{command}", None)  # makes the import fail as a missing module
    assert main([command, "--anything", "x"]) == 2
    assert "not available yet" in capsys.readouterr().err
    # installed: the rest of the command line goes to its main(argv)
    seen = []
    module = types.ModuleType(f"jetspec_hf.{command}")
    module.main = lambda argv=None: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, f"jetspec_hf.{command}", module)
    assert main([command, "--prompt", "hi", "-h"]) == 7
    assert seen == [["--prompt", "hi", "-h"]]
