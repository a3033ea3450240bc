"""Does it learn? Train the packaged Gemma-3-270M with experiment_base on CPU and measure held-out accuracy.

Runs experiment_base/train.py on two-term two-digit addition and subtraction (the rows of
data/math_tasks*.jsonl with num_terms=2, num_digits=2, ops + or -), evaluates greedy accuracy and
format rate on held-out problems of the same kind before training and every --eval-interval steps,
then prints a before/after table and writes the curves as a PNG and the figures as JSON.

    python benchmarks/learning.py                          # 60 steps, about half an hour on a 2-core CPU
    python benchmarks/learning.py --steps 30 --out benchmarks/results
    python benchmarks/learning.py -- --lr 5e-5             # anything after -- goes to train.py

Accuracy is the figure that counts: format compliance alone can be won without learning anything.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, scalars

FILTERS = ["--filter", "num_terms=2", "--filter", "num_digits=2", "--filter", "ops=+,-"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-name", default="packaged:gemma-3-270m", help="model (default: %(default)s)")
    p.add_argument("--steps", type=int, default=60, help="training steps (default: %(default)s)")
    p.add_argument("--eval-prompts", type=int, default=100, help="held-out problems per evaluation (default: %(default)s)")
    p.add_argument("--eval-interval", type=int, default=20, help="evaluate every N steps (default: %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="output folder (default: benchmarks/results)")
    p.add_argument("--run-name", default=None, help="run name (default: learning-<time>)")
    p.add_argument("train_args", nargs="*", help="extra options for experiment_base/train.py, after --")
    return p.parse_args(argv)


def plot(curves, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for tag, label in [("rollout/reward_mean", "reward (mean)"), ("rollout/format_rate", "format rate"),
                       ("rollout/accuracy", "accuracy")]:
        steps, values = zip(*curves[tag])
        top.plot(steps, values, label=label)
    top.set_ylabel("training rollouts")
    top.legend()
    top.grid(alpha=0.3)
    for tag, label in [("eval/accuracy", "held-out greedy accuracy"), ("eval/format_rate", "held-out format rate")]:
        steps, values = zip(*curves[tag])
        bottom.plot(steps, values, marker="o", label=label)
    bottom.set_xlabel("step")
    bottom.set_ylabel("held out")
    bottom.set_ylim(-0.02, 1.02)
    bottom.legend()
    bottom.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv=None):
    args = parse_args(argv)
    run_name = args.run_name or f"learning-{time.strftime('%Y%m%d-%H%M%S')}"
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir, checkpoints = args.out / "runs", args.out / "checkpoints"
    command = [sys.executable, str(ROOT / "experiment_base" / "train.py"), "--model-name", args.model_name,
               "--max-steps", str(args.steps), "--eval-interval", str(args.eval_interval), "--eval-prompts",
               str(args.eval_prompts), *FILTERS, "--run-name", run_name, "--log-dir", str(log_dir),
               "--checkpoint-path", str(checkpoints), "--checkpoint-interval", "0", "--keep-checkpoints", "1",
               "--data-path", str(ROOT / "data" / "math_tasks.jsonl"),
               "--eval-data-path", str(ROOT / "data" / "math_tasks_eval.jsonl"), *args.train_args]
    print(" ".join(command), flush=True)
    started = time.perf_counter()
    if subprocess.run(command).returncode != 0:
        sys.exit("error: experiment_base/train.py failed (its output is above)")
    minutes = (time.perf_counter() - started) / 60
    curves = scalars(log_dir / run_name)
    before, after = dict(curves["eval/accuracy"])[0], curves["eval/accuracy"][-1][1]
    format_before, format_after = dict(curves["eval/format_rate"])[0], curves["eval/format_rate"][-1][1]
    result = {
        "model": args.model_name, "steps": args.steps, "minutes": minutes, "eval_prompts": args.eval_prompts,
        "accuracy_before": before, "accuracy_after": after, "format_before": format_before, "format_after": format_after,
        "curves": curves, "command": command,
    }
    png = args.out / f"{run_name}.png"
    plot(curves, png, f"experiment_base, {args.model_name}, two-term two-digit +/-, {minutes:.0f} min on CPU")
    (args.out / f"{run_name}.json").write_text(json.dumps(result, indent=2))
    print(f"\n{args.steps} steps in {minutes:.1f} minutes; {args.eval_prompts} held-out problems, greedy\n")
    print("| held out | before | after |\n| --- | --- | --- |")
    print(f"| accuracy | {before:.0%} | {after:.0%} |\n| format rate | {format_before:.0%} | {format_after:.0%} |")
    print(f"\nwrote {png} and {png.with_suffix('.json')}")


if __name__ == "__main__":
    main()
