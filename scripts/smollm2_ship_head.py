"""Issue 4 shipping step: copy a trained SmolLM2 head into the package, with its model card.

    python scripts/smollm2_ship_head.py RUN_DIR [--bench docs/benchmark_results.json] [--tree-budget B]
                                        [--tree-width W] [--out DIR] [--hours H] --conversations N

RUN_DIR is the output directory of scripts/smollm2_train.py (its final `save_model`, or one `checkpoint-N`). The
head lands in --out (default jetspec_hf/heads/smollm2-135m-instruct/: config.json, model.safetensors, README.md),
in bf16 unless --dtype float32 (half the size; the demo and the benchmark load heads in
`jetspec_hf.fast_draft_dtype`). The card's training table reads the recipe from RUN_DIR/training_args.bin. With
--bench, its measured table is the benchmark's T=0 JetSpec rows (tau, speedup) of that run; the default tree of the
config is set with --tree-budget / --tree-width (the demo and `generate()` use it when the caller gives none).
"""

import argparse
import json
import shutil
from pathlib import Path

import torch

from jetspec_hf import JetSpecDraftHead
from jetspec_hf.hub import model_card

SHIPPED = Path(__file__).resolve().parents[1] / "jetspec_hf" / "heads" / "smollm2-135m-instruct"
TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"


def bench_measurements(path: Path) -> list[dict]:
    result = json.loads(path.read_text())
    rows = []
    for row in result["rows"]:
        if row["temperature"] != 0 or row["group"] not in ("jetspec_chain", "jetspec_tree") or row.get("error"):
            continue
        rows.append(
            {
                "dataset": f"{row['dataset']} ({row['prompts']} prompts)",
                "budget": row["budget"] if row["group"] == "jetspec_tree" else f"chain of {row['budget']}",
                "tau": round(row["tau"], 2),
                "speedup": f"{row['speedup']:.2f}x",
                "hardware": "2-core CPU, target fp32, head drafting in bf16; plain generate() baseline of the same run",
            }
        )
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=str(SHIPPED), help="default: the package's shipped head directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="of the saved weights")
    parser.add_argument("--bench", help="benchmark_results.json of `jetspec-hf bench` with this head")
    parser.add_argument("--tree-budget", type=int)
    parser.add_argument("--tree-width", type=int)
    parser.add_argument("--hours", type=float, help="wall-clock training time (for the card)")
    parser.add_argument("--conversations", type=int, required=True, help="training conversations (for the card)")
    parser.add_argument(
        "--continued-from",
        metavar="EARLIER_RUN_DIR:CONVERSATIONS",
        action="append",
        help="RUN_DIR was warm-started (--init-from) from this run, trained on its first CONVERSATIONS rows; repeat it "
        "for every earlier stage, first stage first",
    )
    args = parser.parse_args()

    head = JetSpecDraftHead.from_pretrained(args.run_dir, dtype=torch.float32)
    if args.tree_budget is not None:
        head.config.tree_budget = args.tree_budget
    if args.tree_width is not None:
        head.config.tree_width = args.tree_width
    # The recipe as the run recorded it (the Trainer saves its arguments beside the weights), not as remembered.
    recipe = torch.load(Path(args.run_dir) / "training_args.bin", weights_only=False)
    precision = "target in bf16, head under bf16 autocast" if recipe.bf16 else "float32"
    weights = "uniform" if recipe.gamma == 0 else f"slot weights exp(-(k-1)/{recipe.gamma:g})"
    steps = f"{recipe.max_steps}"
    schedule = f"lr {recipe.learning_rate:g}, {recipe.lr_scheduler_type.value}, {recipe.warmup_steps} warm-up steps"
    train = "THREADS=1 python scripts/smollm2_train.py" + ("" if head.config.causal else " --bidirectional")
    command = f"{train} RUN_DIR --limit {args.conversations} --max-steps {recipe.max_steps}"
    if args.continued_from:  # warm starts (`smollm2_train.py --init-from`): the card gives every stage
        stages = []
        for earlier in args.continued_from:
            run_dir, _, conversations = earlier.rpartition(":")
            stages.append((torch.load(Path(run_dir) / "training_args.bin", weights_only=False), conversations))
        stages.append((recipe, str(args.conversations)))
        total = sum(stage.max_steps for stage, _ in stages)
        steps = f"{total} ({', then '.join(str(stage.max_steps) for stage, _ in stages)} continued)"
        schedule = (
            f"lr {' then '.join(f'{stage.learning_rate:g}' for stage, _ in stages)}, "
            f"{recipe.lr_scheduler_type.value} each, {recipe.warmup_steps} warm-up steps"
        )
        commands = []
        for number, (stage, conversations) in enumerate(stages, start=1):
            out_dir = "RUN_DIR" if number == len(stages) else f"STAGE{number}"
            init = f" --init-from STAGE{number - 1}" if number > 1 else ""
            commands.append(
                f"{train} {out_dir} --limit {conversations}{init} --max-steps {stage.max_steps} "
                f"--lr {stage.learning_rate:g}"
            )
        command = "; ".join(commands)
    training = {
        "data": "answers of SmolLM2-135M-Instruct itself (greedy, up to 320 new tokens, target in fp32 or bf16) to "
        "offline prompts: CPython standard-library functions and docstrings, Python documentation topics, composed "
        "general and math instructions (`jetspec_hf.prompts`; no HumanEval); held-out split by subject",
        "conversations": args.conversations,
        "loss": f"{recipe.loss_type} (against the target's distribution at each drafted slot), {weights}",
        "anchors": f"{recipe.num_anchors} random anchors per conversation, "
        f"{recipe.per_device_train_batch_size} conversation(s) per step",
        "steps": steps,
        "optimizer": f"AdamW, {schedule}; {precision}",
        "hardware": f"a 2-core CPU (bf16 AMX){f', {args.hours:.1f} h' if args.hours else ''}",
        "command": command,
    }
    measured = bench_measurements(Path(args.bench)) if args.bench else None

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    head.to(getattr(torch, args.dtype)).save_pretrained(out)
    card = model_card(
        head, target_model=TARGET, training=training, measured=measured, license="apache-2.0", remote_code=False
    )
    (out / "README.md").write_text(card)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"shipped {args.run_dir} -> {out} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
