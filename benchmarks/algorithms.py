"""The seven algorithms where the model can learn: experiment_drgrpo's presets on --task sequence, side by side.

For each of --algorithms, runs benchmarks/learning.py --experiment experiment_drgrpo with the same seed, steps,
evaluations and recipe (learning.py's: 8 prompts x 8 completions at temperature 0.8, correctness alone), the
algorithm's whole preset (`--algorithm A`) and --log-kl, so that every run measures its KL to pi_ref, beta 0 or not.
Each run writes OUT/A/learning.json; one that exists is read instead of run again (a comparison of seven long runs
can be stopped and started again; a learning.json from other settings is an error, not mixed in). Then one table,
OUT/algorithms.json and one figure (OUT/algorithms.png: held-out greedy accuracy and training reward by step):

    python benchmarks/algorithms.py                                   # all seven, 10 steps, held-out accuracy every 5
    python benchmarks/algorithms.py --algorithms grpo drgrpo --steps 20 --eval-interval 10

The table's columns, from each run's TensorBoard scalars: held-out greedy accuracy before and after, the run's
minutes (model loading, evaluations and the sampled completions at the end included) and its mean seconds a step,
train/kl at the last step (the k3 estimate of KL(pi_theta || pi_ref) on that step's batch), the clip fraction (the
share of action tokens the clip held, below and above, mean over the steps), the mean completion length at the first
and the last step, and the share of groups whose completions all earned the same reward (no gradient without a KL
term: what a small batch wastes), and how many of the --samples held-out problems the trained adapter answered
right when sampled at the training temperature.
"""

import argparse
import json
import statistics
import subprocess
import sys

from common import ROOT, load_experiment, output_folder
from learning import plot

ALGORITHMS = list(load_experiment("experiment_drgrpo").ALGORITHMS)
COLUMNS = ("| algorithm | accuracy before | after | gain | minutes | s/step | KL at the end | clip fraction (low / high) "
           "| completion length, first -> last step | groups of equal rewards | sampled at the end, right |")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=ALGORITHMS, metavar="A",
                   help=f"experiment_drgrpo's presets to run, of {', '.join(ALGORITHMS)} (default: all)")
    p.add_argument("--steps", type=int, default=10, help="training steps, the same for each (default: %(default)s)")
    p.add_argument("--eval-interval", type=int, default=5, help="held-out accuracy every N steps (default: %(default)s)")
    p.add_argument("--eval-prompts", type=int, default=100, help="held-out problems per evaluation (default: %(default)s)")
    p.add_argument("--samples", type=int, default=20, help="held-out problems sampled once each at the end (default: "
                   "%(default)s)")
    p.add_argument("--seed", type=int, default=42, help="the seed of every run (default: %(default)s)")
    p.add_argument("--model-name", default="packaged:gemma-3-270m", help="model (default: %(default)s)")
    p.add_argument("--out", type=output_folder, default=ROOT / "runs" / "algorithms", help="output folder, a subfolder per "
                   "algorithm (default: runs/algorithms)")
    p.add_argument("train_args", nargs="*", help="extra options for train.py (after --), the same for every algorithm")
    args = p.parse_args(argv)
    if min(args.steps, args.eval_interval, args.eval_prompts) < 1 or args.samples < 0:
        p.error("--steps, --eval-interval and --eval-prompts must be at least 1, --samples at least 0")
    if any(option.split("=")[0] in ("--algorithm", "--preset", "--seed") for option in args.train_args):
        p.error("the algorithm and the seed are this script's to set: use --algorithms and --seed")
    return args


def learning_command(args, algorithm):
    """The learning.py command of one algorithm's run."""
    return [sys.executable, str(ROOT / "benchmarks" / "learning.py"), "--experiment", "experiment_drgrpo",
            "--model-name", args.model_name, "--steps", str(args.steps), "--eval-interval", str(args.eval_interval),
            "--eval-prompts", str(args.eval_prompts), "--samples", str(args.samples), "--seed", str(args.seed),
            "--out", str(args.out / algorithm), "--run-name", f"algorithms-{algorithm}", "--",
            "--algorithm", algorithm, "--log-kl", *args.train_args]


def option(command, name):
    """The value of a train.py option in a command (the last one given counts, as in argparse), or None."""
    values = [command[i + 1] for i, word in enumerate(command[:-1]) if word == name]
    return values[-1] if values else None


def run_or_read(args, algorithm):
    """One algorithm's learning.json: read when it exists (and was made with these settings), else run."""
    path = args.out / algorithm / "learning.json"
    if not path.exists():
        if subprocess.run(learning_command(args, algorithm)).returncode != 0:
            sys.exit(f"error: the {algorithm} run failed (its output is above)")
    result = json.loads(path.read_text())
    (run,) = result["runs"]
    command = run["command"]
    settings = {"--algorithm": algorithm, "--max-steps": str(args.steps), "--seed": str(args.seed),
                "--eval-interval": str(args.eval_interval), "--eval-prompts": str(args.eval_prompts)}
    differs = [f"{name} {option(command, name)}, not {value}" for name, value in settings.items()
               if option(command, name) != value]
    if differs or result["experiment"] != "experiment_drgrpo" or "--log-kl" not in command:
        sys.exit(f"error: {path} is from another comparison ({'; '.join(differs) or 'not experiment_drgrpo --log-kl'}): "
                 f"remove it, or give another --out")
    return result


def row(algorithm, result):
    """The table's figures for one run, from its learning.json."""
    (run,) = result["runs"]
    curves = run["curves"]
    values = lambda tag: [value for _, value in curves.get(tag, [])]  # noqa: E731
    mean = lambda tag: statistics.mean(values(tag)) if values(tag) else None  # noqa: E731
    length = values("rollout/completion_length")
    return {"algorithm": algorithm, "before": run["before"]["accuracy"], "after": run["after"]["accuracy"],
            "gain": run["gain"], "minutes": run["minutes"], "step_seconds": mean("perf/step_seconds"),
            "kl_at_end": values("train/kl")[-1] if values("train/kl") else None,
            "clip_fraction": mean("train/clip_fraction"), "clip_low_fraction": mean("train/clip_low_fraction"),
            "clip_high_fraction": mean("train/clip_high_fraction"),
            "completion_length": [length[0], length[-1]] if length else None,
            "equal_reward_groups": mean("rollout/zero_spread_groups"),  # each step logs its share; the mean over steps
            "sampled": [sum(sample["correct"] for sample in run["samples"]), len(run["samples"])]}


def markdown(r):
    number = lambda value, form: "-" if value is None else format(value, form)  # noqa: E731
    length = "-" if r["completion_length"] is None else f"{r['completion_length'][0]:.0f} -> {r['completion_length'][1]:.0f}"
    return (f"| {r['algorithm']} | {r['before']:.0%} | {r['after']:.0%} | {r['gain']:+.0%} | {r['minutes']:.1f} | "
            f"{number(r['step_seconds'], '.0f')} | {number(r['kl_at_end'], '.4f')} | {number(r['clip_fraction'], '.3f')} "
            f"({number(r['clip_low_fraction'], '.3f')} / {number(r['clip_high_fraction'], '.3f')}) | {length} | "
            f"{number(r['equal_reward_groups'], '.0%')} | {r['sampled'][0]} of {r['sampled'][1]} |")


def main(argv=None):
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {algorithm: run_or_read(args, algorithm) for algorithm in args.algorithms}
    where = next(iter(results.values()))["machine"]
    if any(result["machine"] != where for result in results.values()):  # side by side means on one machine, one dtype
        sys.exit("error: the runs in " + str(args.out) + " were measured on different machines or dtypes: " +
                 "; ".join(f"{a}: {r['machine']['cpu']}, {r['machine']['dtype']}" for a, r in results.items()))
    rows = [row(algorithm, result) for algorithm, result in results.items()]
    title = (f"experiment_drgrpo's presets, --task sequence, seed {args.seed}, {args.steps} steps; on {where['cpu']} "
             f"({where['cores']} cores, {where['dtype']})")
    (args.out / "algorithms.json").write_text(json.dumps({"machine": where, "steps": args.steps, "seed": args.seed,
                                                           "rows": rows}, indent=2))
    plot({algorithm: result["runs"][0]["curves"] for algorithm, result in results.items()}, args.out / "algorithms.png", title)
    print(f"\n{title}\n\n{COLUMNS}\n" + "| --- " * (COLUMNS.count(" | ") + 1) + "|")
    for r in rows:
        print(markdown(r))
    print(f"\nwrote {args.out / 'algorithms.json'} and {args.out / 'algorithms.png'}")


if __name__ == "__main__":
    main()
