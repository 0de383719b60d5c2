"""`jetspec-hf demo`: SmolLM2-135M-Instruct with the head shipped in this package, side by side with plain decoding.

Answers a few chat prompts, streaming the speculative answer, and prints tokens/s with and without the head, tau
(tokens committed per target forward) and the speedup. Both runs are greedy and must give the same tokens.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import TextStreamer

SHIPPED_HEAD = Path(__file__).parent / "heads" / "smollm2-135m-instruct"

DEMO_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, with a short docstring.",
    "Explain in three sentences what a hash table is.",
    "Give me three tips for writing readable code.",
]


def untrained_smollm2_head(target, tokenizer):
    """A randomly initialised head shaped like the shipped one (`jetspec_hf.smollm2.smollm2_head_config`)."""
    from jetspec_hf import JetSpecDraftHead
    from jetspec_hf.smollm2 import smollm2_head_config

    torch.manual_seed(0)
    return JetSpecDraftHead(smollm2_head_config(target, tokenizer)).eval()


def timed_generate(target, ids, **kwargs):
    start = time.perf_counter()
    out = target.generate(ids, **kwargs)
    return out, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jetspec-hf demo", description=__doc__)
    parser.add_argument("--head", default=str(SHIPPED_HEAD), help="draft head directory (default: the shipped one)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree-budget", type=int, default=None, help="default: the head config's")
    parser.add_argument("--prompt", action="append", help="a chat prompt (repeatable); default: three built-in ones")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1, as `jetspec-hf bench`: on a 2-vCPU machine "
        "two threads decode slower than one, and far slower when anything else runs)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import jetspec_hf  # noqa: F401  (routes generate(assistant_model=head))
    from jetspec_hf import JetSpecDraftHead, fast_draft_dtype
    from jetspec_hf.smollm2 import load_smollm2

    print("[demo] loading SmolLM2-135M-Instruct (converted from GGUF on first use) ...", file=sys.stderr)
    target, tokenizer = load_smollm2(dtype=torch.float32)
    draft_dtype = fast_draft_dtype(target.dtype, target.device)  # drafting precision never changes the output
    if (Path(args.head) / "config.json").exists():
        head = JetSpecDraftHead.from_pretrained(args.head, dtype=draft_dtype)
    elif args.head == str(SHIPPED_HEAD):
        print(
            "[demo] NOTE: the shipped SmolLM2 head is missing from this install (jetspec_hf/heads/). This "
            "run uses an UNTRAINED head of the same shape: it shows that the output is unchanged, not a speedup.",
            file=sys.stderr,
        )
        head = untrained_smollm2_head(target, tokenizer).to(draft_dtype)
    else:
        print(f"no draft head at {args.head}: train one with `jetspec-hf train` (docs/training.md)", file=sys.stderr)
        return 1
    print(
        f"[demo] head: {args.head} ({'JetSpec causal' if head.config.causal else 'DFlash bidirectional'}, "
        f"block {head.config.block_size}, taps {head.config.target_layer_ids}, drafting in {head.dtype})",
        file=sys.stderr,
    )
    tree = {} if args.tree_budget is None else {"tree_budget": args.tree_budget}
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    # Warm-up: the first forwards of a process are slow (allocations, kernel selection), for both methods alike.
    warm = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_tensors="pt"
    )
    warm = warm["input_ids"] if hasattr(warm, "keys") else warm
    target.generate(warm, max_new_tokens=8)
    target.generate(warm, assistant_model=head, max_new_tokens=8, **tree)

    totals = {"plain_s": 0.0, "jetspec_s": 0.0, "tokens": 0, "steps": 0, "committed": 0}
    identical = True
    for i, prompt in enumerate(args.prompt or DEMO_PROMPTS, start=1):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        print(f"\n### prompt {i}: {prompt}\n")
        plain, plain_s = timed_generate(target, ids, **settings)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        fast, fast_s = timed_generate(target, ids, assistant_model=head, streamer=streamer, **tree, **settings)
        stats = head.last_generate_stats
        new = fast.shape[1] - ids.shape[1]
        same = torch.equal(plain, fast)
        identical &= same
        print(
            f"\n[plain {new / plain_s:.1f} tok/s | jetspec {new / fast_s:.1f} tok/s | tau {stats.tau:.2f} | "
            f"speedup {plain_s / fast_s:.2f}x | same tokens as plain: {same}]"
        )
        totals["plain_s"] += plain_s
        totals["jetspec_s"] += fast_s
        totals["tokens"] += new
        totals["steps"] += len(stats.accepted_lengths)
        totals["committed"] += sum(stats.accepted_lengths)

    tau = totals["committed"] / max(totals["steps"], 1)
    print(
        f"\n== {totals['tokens']} tokens: plain {totals['tokens'] / totals['plain_s']:.1f} tok/s, jetspec "
        f"{totals['tokens'] / totals['jetspec_s']:.1f} tok/s, tau {tau:.2f}, speedup "
        f"{totals['plain_s'] / totals['jetspec_s']:.2f}x, outputs identical: {identical} "
        f"(CPU, {torch.get_num_threads()} threads, fp32) =="
    )
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
