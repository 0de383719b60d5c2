"""Per-step overhead of JetSpec tree decoding outside the two forwards, against a 1-token target step.

    python bench/overhead.py [--budgets 8,32,64,128,256] [--width 7] [--depth 15] [--context 512] [--repeats N]
                             [--markdown OUT.md] [--dtype float32|bfloat16]

Baseline (same run): one 1-token decode step of SmolLM2-135M-Instruct (fp32 by default, sdpa) on a KV cache of
`--context` tokens, median of repeats after warm-up. For each tree budget, the pieces `tree_generate` runs outside
the head forward and the target verify forward, each calling the library's own functions:

    log_softmax  `torch.log_softmax` of the [depth, V] draft logits (part of drafting; reported apart, not in total)
    build        `build_tree` (top-k included)
    verify_in    `tree_attention_mask` (ancestor mask included, all-ones 2-D prefix mask like generate() passes),
                 the prefix-mask extension and root position of the loop, position ids, input ids
    children     `DraftTree.children()`
    walk@L       `walk_tree` with the loop's greedy `pick` (argmax over one [1, V] row of the [n, V] node logits,
                 cast to float32 per visited row as the loop does: a no-op in fp32) and `commit` (append to the
                 sequence, generate()'s StoppingCriteriaList with MaxLengthCriteria and EosTokenCriteria), for an
                 accepted path of L nodes (L tokens committed, bonus included)
    surgery@L    `keep_path_in_cache` on a DynamicCache filled by real SmolLM2 forwards: prefill of `--context`
                 tokens, then one tree verify forward over the n nodes (30 layers, 3 KV heads, head_dim 64)

The draft logits are random with a realistic peaked shape: Gaussian logits over the full vocabulary, scaled so the
mean top-1 probability is about 0.5. Such a tree is bushy and never reaches depth 15 within these budgets, so the
deep-path case (walk/surgery along the deepest path the budget allows, up to depth + 1 nodes) is measured on a tree of
the same budget built from a sharper draft (mean top-1 ~0.95, best-first then goes straight down); build, verify
inputs and children are always those of the realistic tree. Head-side bookkeeping (tapped hidden rows) belongs to the
draft forward and is left out. Timings are medians; speed is reported only as ratios to the baseline step measured
in this run, timed round-robin with the pieces of each budget so that both see the same load on a shared CPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jetspec_hf.generation import keep_path_in_cache, tree_attention_mask  # noqa: E402
from jetspec_hf.smollm2 import load_smollm2  # noqa: E402
from jetspec_hf.tree import build_tree, walk_tree  # noqa: E402

EOS_TOKEN_ID = 2


def interleaved_ms(tasks: dict, repeats: int, warmup: int = 3) -> dict[str, list[float]]:
    """Wall times in ms of every task, run round-robin (one call of each task per round), so that the baseline step
    and the pieces see the same load on a shared machine. A task is `fn` or `(fn, setup)`: `setup()` (untimed) makes
    a fresh state for every call, passed to `fn`; without one `fn(None)` is called. The first `warmup` rounds are
    dropped."""
    times = {name: [] for name in tasks}
    for i in range(warmup + repeats):
        for name, task in tasks.items():
            fn, setup = task if isinstance(task, tuple) else (task, None)
            state = setup() if setup is not None else None
            start = time.perf_counter()
            fn(state)
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[name].append(1e3 * elapsed)
    return times


def peaked_draft_logits(depth: int, vocab: int, top1: float, generator: torch.Generator) -> torch.Tensor:
    """`[depth, V]` Gaussian logits scaled (bisection on one scale) so the mean top-1 softmax probability ~ `top1`."""
    base = torch.randn(depth, vocab, generator=generator)
    lo, hi = 0.0, 50.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if torch.softmax(base * mid, dim=-1).max(dim=-1).values.mean() < top1:
            lo = mid
        else:
            hi = mid
    return base * hi


def chain_path(tree, length: int) -> list[int]:
    """A root-first path of at most `length` nodes along the deepest branch of the tree (the likeliest chain)."""
    parents = tree.parents.tolist()
    depths = tree.depths.tolist()
    deepest = max(range(len(tree)), key=lambda i: (depths[i], -i))  # deepest node, earliest created (best ranks)
    path = [deepest]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1][:length]


def node_logits_for_path(tree, path: list[int], vocab: int, generator: torch.Generator, dtype) -> torch.Tensor:
    """`[n, V]` target logits whose argmax follows `path`, then picks a token that is no child (the bonus)."""
    logits = torch.randn(len(tree), vocab, generator=generator)
    tokens = tree.tokens.tolist()
    children = tree.children()
    for node, nxt in zip(path, path[1:]):
        logits[node, tokens[nxt]] = 100.0
    last = path[-1]
    bonus = next(t for t in range(3, vocab) if t not in children[last])  # not EOS, not a child: the walk ends here
    logits[last, bonus] = 100.0
    return logits.to(dtype)


def make_stopping_criteria(max_length: int, max_position_embeddings: int) -> StoppingCriteriaList:
    """What generate()'s `_get_stopping_criteria` builds for max_length + eos_token_id (no stop strings)."""
    return StoppingCriteriaList(
        [
            MaxLengthCriteria(max_length=max_length, max_position_embeddings=max_position_embeddings),
            EosTokenCriteria(eos_token_id=torch.tensor([EOS_TOKEN_ID])),
        ]
    )


def clone_cache(cache: DynamicCache) -> DynamicCache:
    """A cache with the same layers holding fresh copies of keys/values (as after a verify forward's torch.cat)."""
    copy = DynamicCache()
    for src in cache.layers:
        layer = type(src)()
        layer.lazy_initialization(src.keys, src.values)
        layer.keys, layer.values = src.keys.clone(), src.values.clone()
        copy.layers.append(layer)
    return copy


def machine_info() -> str:
    return (
        f"{platform.processor() or platform.machine()}, os.cpu_count()={os.cpu_count()}, "
        f"torch threads={torch.get_num_threads()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"python {platform.python_version()}"
    )


@torch.no_grad()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="8,32,64,128,256")
    parser.add_argument("--width", type=int, default=7)
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--path-length", type=int, default=4, help="typical accepted length (nodes on the path)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the CPU here is shared)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", default="bench/results/overhead.md")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="of the model and cache")
    args = parser.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    generator = torch.Generator().manual_seed(args.seed)

    dtype = getattr(torch, args.dtype)
    model, _ = load_smollm2(dtype=dtype, attn_implementation="sdpa", progress=False)
    vocab = model.config.vocab_size
    ctx = args.context

    # ---- baseline: one 1-token decode step on a `ctx`-token cache (real prefill of random token ids) ----
    prompt = torch.randint(3, vocab, (1, ctx), generator=generator)
    prefix_cache = DynamicCache(config=model.config)
    model(input_ids=prompt, past_key_values=prefix_cache, use_cache=True)
    step_token = torch.tensor([[int(prompt[0, -1])]])
    step_mask = torch.ones(1, ctx + 1, dtype=torch.long)
    step_pos = torch.tensor([[ctx]])

    def decode_step(_):
        model(
            input_ids=step_token,
            attention_mask=step_mask,
            position_ids=step_pos,
            past_key_values=prefix_cache,
            use_cache=True,
        )
        prefix_cache.crop(-1)  # back to `ctx` tokens (cheap slice; timed with the step)

    step_times = []

    # ---- per-step pieces ----
    draft_logits = peaked_draft_logits(args.depth, vocab, 0.5, generator)
    draft_logprobs = torch.log_softmax(draft_logits, dim=-1)
    top1 = draft_logprobs.exp().max(dim=-1).values
    deep_logprobs = torch.log_softmax(peaked_draft_logits(args.depth, vocab, 0.95, generator), dim=-1)
    softmax_ms = statistics.median(
        interleaved_ms({"log_softmax": lambda _: torch.log_softmax(draft_logits, dim=-1)}, args.repeats)["log_softmax"]
    )
    root_token = int(prompt[0, -1])
    sequence0 = torch.cat([prompt, torch.tensor([[root_token]])], dim=-1)  # the root is committed, not yet cached
    past_len = sequence0.shape[1] - 1
    pad_keep0 = torch.ones(ctx, dtype=torch.bool)  # generate() passes an all-ones 2-D mask for one unpadded prompt
    stopping = make_stopping_criteria(ctx + 10_000, model.config.max_position_embeddings)

    rows = []
    for budget in budgets:
        tree = build_tree(root_token, draft_logprobs, budget, args.width)
        n = len(tree)

        def verify_inputs(_):
            pad_keep = torch.cat([pad_keep0, torch.ones(sequence0.shape[1] - pad_keep0.shape[0], dtype=torch.bool)])
            root_position = int(pad_keep.sum()) - 1
            tree.tokens[None]
            tree_attention_mask(tree, pad_keep, past_len, model.dtype, "cpu")
            (root_position + tree.depths)[None]

        # Real tree-verify forward to fill the cache exactly as the loop does (prefix + n tree rows).
        verify_cache = clone_cache(prefix_cache)
        model(
            input_ids=tree.tokens[None],
            attention_mask=tree_attention_mask(tree, pad_keep0, past_len, model.dtype, "cpu"),
            position_ids=(past_len + tree.depths)[None],
            past_key_values=verify_cache,
            use_cache=True,
        )
        assert verify_cache.get_seq_length() == past_len + n

        deep_tree = build_tree(root_token, deep_logprobs, budget, args.width)
        assert len(deep_tree) == n
        deep_cache = clone_cache(prefix_cache)
        model(
            input_ids=deep_tree.tokens[None],
            attention_mask=tree_attention_mask(deep_tree, pad_keep0, past_len, model.dtype, "cpu"),
            position_ids=(past_len + deep_tree.depths)[None],
            past_key_values=deep_cache,
            use_cache=True,
        )

        tasks = {
            "step": decode_step,
            "build": lambda _: build_tree(root_token, draft_logprobs, budget, args.width),
            "verify_in": verify_inputs,
            "children": lambda _: tree.children(),
        }
        paths = {}
        for label, walked_tree, length, filled_cache in (
            ("typ", tree, args.path_length, verify_cache),
            ("deep", deep_tree, args.depth + 1, deep_cache),
        ):
            path = chain_path(walked_tree, length)
            node_logits = node_logits_for_path(walked_tree, path, vocab, generator, model.dtype)
            children = walked_tree.children()

            def walk(_, node_logits=node_logits, children=children):
                sequence = sequence0

                def pick(next_token_logits):  # the loop's greedy pick with no logits processors
                    return int(torch.argmax(next_token_logits, dim=-1, keepdim=True))

                def commit(token):  # the loop's commit without a streamer
                    nonlocal sequence
                    sequence = torch.cat([sequence, sequence.new_tensor([[token]])], dim=-1)
                    return bool(stopping(sequence, None).any())

                return walk_tree(
                    children, lambda node: pick(node_logits[node : node + 1].to(dtype=torch.float32)), commit
                )

            walked, committed = walk(None)
            assert walked == path and len(committed) == len(path), (walked, path)
            tasks[f"walk_{label}"] = walk
            tasks[f"surgery_{label}"] = (
                lambda cache, path=path: keep_path_in_cache(cache, past_len, path),
                lambda filled_cache=filled_cache: clone_cache(filled_cache),
            )
            check = clone_cache(filled_cache)
            keep_path_in_cache(check, past_len, path)
            assert check.get_seq_length() == past_len + len(path)
            rows_kept = torch.tensor(list(range(past_len)) + [past_len + node for node in path])
            for got, full in zip(check.layers, filled_cache.layers):  # the kept rows are the path's, in order
                assert torch.equal(got.keys, full.keys[:, :, rows_kept])
                assert torch.equal(got.values, full.values[:, :, rows_kept])
            paths[label] = path

        times = interleaved_ms(tasks, args.repeats)
        del verify_cache, deep_cache, tasks
        step_times += times["step"]
        med = {name: statistics.median(ts) for name, ts in times.items()}
        low = {name: min(ts) for name, ts in times.items()}
        row = {
            "budget": budget,
            "n": n,
            "step": med["step"],
            "build": med["build"],
            "verify_in": med["verify_in"],
            "children": med["children"],
        }
        for label, path in paths.items():
            total = med["build"] + med["verify_in"] + med["children"] + med[f"walk_{label}"] + med[f"surgery_{label}"]
            pieces = ("build", "verify_in", "children", f"walk_{label}", f"surgery_{label}")
            total_min = sum(low[name] for name in pieces)
            row[label] = {
                "L": len(path),
                "walk": med[f"walk_{label}"],
                "surgery": med[f"surgery_{label}"],
                "total": total,
                "ratio": total / med["step"],
                "ratio_min": total_min / low["step"],
            }
        rows.append(row)
    step_ms = statistics.median(step_times)

    # ---- report ----
    header = (
        f"Machine: {machine_info()}\n"
        f"Baseline: 1-token decode step of SmolLM2-135M-Instruct ({args.dtype}, sdpa), KV cache of {ctx} tokens: "
        f"**{step_ms:.2f} ms** (median of all {len(step_times)} timed steps; per budget, {args.repeats} steps after "
        f"3 warm-up rounds, timed round-robin with the pieces so both see the same load: column `step`).\n"
        f"Draft: depth {args.depth}, width {args.width}, vocab {vocab}; peaked random draft logits "
        f"(mean top-1 probability {top1.mean():.2f}, min {top1.min():.2f}, max {top1.max():.2f}). "
        f"`log_softmax` of the [{args.depth}, {vocab}] draft logits (part of drafting, not in the totals): "
        f"{softmax_ms:.3f} ms.\n"
        f"Cache for the surgery: filled by real SmolLM2 forwards (prefill of {ctx} random tokens + one tree verify "
        f"forward over the n nodes), 30 layers x 3 KV heads x head_dim 64, {args.dtype}.\n"
        f"All times are medians of {args.repeats} calls in ms; L = nodes on the accepted path = tokens committed "
        f"(bonus included). total = build + verify inputs + children + "
        f"walk + surgery; ratio = total / step (the same budget's interleaved 1-token step); ratio (min) = the same "
        f"with the minimum of each timing instead of the median (less sensitive to other load on a shared CPU). "
        f"Load average (1 min) at start / end: {load_start:.2f} / {os.getloadavg()[0]:.2f}.\n"
    )
    cols = [
        "budget",
        "n",
        "step",
        "build",
        "verify in",
        "children",
        "L",
        "walk",
        "surgery",
        "total",
        "ratio",
        "ratio (min)",
        "L",
        "walk",
        "surgery",
        "total",
        "ratio",
        "ratio (min)",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for r in rows:
        cells = [
            str(r["budget"]),
            str(r["n"]),
            f"{r['step']:.1f}",
            f"{r['build']:.3f}",
            f"{r['verify_in']:.3f}",
            f"{r['children']:.3f}",
        ]
        for label in ("typ", "deep"):
            p = r[label]
            cells += [
                str(p["L"]),
                f"{p['walk']:.3f}",
                f"{p['surgery']:.3f}",
                f"{p['total']:.3f}",
                f"{p['ratio']:.1%}",
                f"{p['ratio_min']:.1%}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    note = (
        "\nThe first `L/walk/surgery/total/ratio` group is a typical accepted path (L = "
        f"{args.path_length}, or less where the realistic tree is shallower) on the realistic tree; the second the "
        f"deepest path a tree of this budget and width can hold (up to depth {args.depth} + 1 = {args.depth + 1} "
        "nodes), on the sharp-draft tree of the same size.\n"
    )
    command = "python bench/overhead.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (
        f"### Per-step overhead outside the forwards\n\nCommand: `{command.strip()}`\n\n"
        + header.replace("\n", "\n\n")
        + "\n".join(lines)
        + "\n"
        + note
    )
    print(text)
    if args.markdown:
        out = Path(args.markdown)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
