"""`jetspec-hf bench` end to end on a tiny local target: every method runs, the report files are written, greedy
outputs equal plain `generate()` and JetSpec sampling equals plain sampling with the same seed."""

import json

import pytest

from jetspec_hf import bench
from jetspec_hf.prompts import write_jsonl

from tiny_models import tiny_head, tiny_target


def tiny_bench_files(tmp_path, chat_tokenizer) -> list[str]:
    """A tiny Llama target, a causal and a bidirectional head and two chat prompts on disk; returns their bench args."""
    target = tiny_target("llama", vocab_size=len(chat_tokenizer), pad_token_id=0)
    target.save_pretrained(tmp_path / "target")
    chat_tokenizer.save_pretrained(tmp_path / "target")
    tiny_head(target, causal=True).save_pretrained(tmp_path / "causal")
    tiny_head(target, causal=False, seed=1).save_pretrained(tmp_path / "bidirectional")
    write_jsonl(
        [
            {"id": "a", "messages": [{"role": "user", "content": "Hello there! How are you today?"}]},
            {"id": "b", "messages": [{"role": "user", "content": "What is two plus two?"}]},
        ],
        tmp_path / "chat.jsonl",
    )
    return [
        "--target", str(tmp_path / "target"),
        "--head", str(tmp_path / "causal"),
        "--bidirectional-head", str(tmp_path / "bidirectional"),
        "--datasets", "chat",
        "--chat-prompts", str(tmp_path / "chat.jsonl"),
    ]  # fmt: skip


def test_bench_runs_every_method_and_checks_outputs(tmp_path, chat_tokenizer, capsys):
    out = tmp_path / "out"
    argv = [
        *tiny_bench_files(tmp_path, chat_tokenizer),
        "--num-prompts", "2",
        "--budgets", "4,8",
        "--max-new-tokens", "8",
        "--temperatures", "0,1",
        "--output-dir", str(out),
        "--no-progress",
    ]  # fmt: skip
    assert bench.main(argv) == 0

    md = (out / "benchmark_results.md").read_text()
    result = json.loads((out / "benchmark_results.json").read_text())
    assert (out / "benchmark.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert md.startswith("# JetSpec benchmark results\n\nCommand: `jetspec-hf bench --target ")
    assert "| dataset | T | method | budget | tau | tok/s | speedup | identical |" in md

    rows = result["rows"]
    expected = [
        "plain", "prompt_lookup", "dflash_chain", "jetspec_chain", "jetspec_tree@4", "jetspec_tree@8",
        "dflash_chain_bidir", "dflash_tree@4", "dflash_tree@8",
    ]  # fmt: skip
    for temperature in (0.0, 1.0):
        assert [r["method"] for r in rows if r["temperature"] == temperature] == expected
    assert not [r for r in rows if r["error"]], [r["error"] for r in rows if r["error"]]
    greedy = [r for r in rows if r["temperature"] == 0 and r["method"] != "plain"]
    assert all(r["identical"] == r["prompts"] == 2 for r in greedy)
    assert all(f"| {r['method']} |" in md for r in greedy) and md.count("| 2/2 |") == len(greedy)
    tree_loop = ("jetspec_chain", "jetspec_tree", "dflash_tree")
    seeded = [r for r in rows if r["temperature"] == 1 and r["group"] in tree_loop]
    assert len(seeded) == 5 and all(r["identical"] == 2 for r in seeded)
    assert md.count("| 2/2 (same seed) |") == 5
    assert result["checks"] == {"greedy_identical": True, "seeded_identical": True, "failures": []}

    plain = next(r for r in rows if r["method"] == "plain" and r["temperature"] == 0)
    assert plain["tau"] == 1.0 and plain["speedup"] == 1.0
    for r in rows:
        assert r["tau"] >= 1.0 and r["tokens_per_second"] > 0
        if r["group"] in tree_loop:
            records = result["per_prompt"][f"chat|T={r['temperature']:g}|{r['method']}"]
            steps = sum(len(p["accepted_lengths"]) for p in records)
            assert r["tau"] == sum(sum(p["accepted_lengths"]) for p in records) / steps  # hook count = loop's own
    printed = capsys.readouterr()
    assert "Greedy (T=0): every method's output equals plain `generate()` token for token: **yes**" in printed.out
    assert "chat T=0 jetspec_tree@8: tau" in printed.err  # the per-method summary lines


def test_sampling_methods_run_a_subset_at_t1(tmp_path, chat_tokenizer, monkeypatch):
    calls = []
    real_run_call = bench.run_call

    def recording_run_call(target, counter, method, prompt, settings, seed):
        calls.append((method.name, prompt.id, seed))
        return real_run_call(target, counter, method, prompt, settings, seed)

    monkeypatch.setattr(bench, "run_call", recording_run_call)
    out = tmp_path / "out"
    argv = [
        *tiny_bench_files(tmp_path, chat_tokenizer),
        "--num-prompts", "2", "--budgets", "4,8", "--max-new-tokens", "6", "--temperatures", "0,1",
        "--methods", "prompt_lookup,jetspec_tree", "--sampling-methods", "jetspec_tree@8",
        "--output-dir", str(out), "--no-progress", "--no-plot",
    ]  # fmt: skip
    assert bench.main(argv) == 0
    rows = json.loads((out / "benchmark_results.json").read_text())["rows"]
    by_temperature = {t: [r["method"] for r in rows if r["temperature"] == t] for t in (0.0, 1.0)}
    assert by_temperature == {
        0.0: ["plain", "prompt_lookup", "jetspec_tree@4", "jetspec_tree@8"],
        1.0: ["plain", "jetspec_tree@8"],
    }
    # T=0: one warm-up call per method on the first prompt, then round-robin: each prompt through every method
    methods_t0 = by_temperature[0.0]
    t0_calls = [(name, prompt) for name, prompt, _ in calls[: 3 * len(methods_t0)]]
    assert t0_calls == [(m, "a") for m in methods_t0] + [(m, p) for p in ("a", "b") for m in methods_t0]
    with pytest.raises(SystemExit, match="not among the methods run at T=0"):
        bench.main([*argv[:-4], "--sampling-methods", "dflash_chain", "--output-dir", str(out)])


def test_method_selection():
    budgets = [4, 16]
    assert bench.select_methods(None, budgets, have_bidirectional=False) == [
        "plain", "prompt_lookup", "dflash_chain", "jetspec_chain", "jetspec_tree@4", "jetspec_tree@16",
    ]  # fmt: skip
    assert bench.select_methods("jetspec_tree@8,prompt_lookup", budgets, False) == [
        "plain", "prompt_lookup", "jetspec_tree@8",
    ]  # fmt: skip
    assert bench.select_methods("dflash_tree,plain", budgets, True) == ["plain", "dflash_tree@4", "dflash_tree@16"]
    for bad in ("nope", "jetspec_chain@4", "dflash_chain_bidir"):
        with pytest.raises(SystemExit):
            bench.select_methods(bad, budgets, have_bidirectional=False)
