"""Does it learn? Train the packaged Gemma-3-270M with experiment_base on CPU and measure held-out accuracy.

Runs experiment_base/train.py with its CPU defaults on --task (by default sequence, experiment_base's CPU
default: "What number comes next: 15, 20, 25, 30, ...?"; math keeps the rows with two terms of two digits
and + or -), evaluates greedy accuracy and format rate on held-out problems before training and every
--eval-interval steps, then samples one completion for each of 20 held-out
problems with the trained adapter, prints a before/after table and writes OUT/learning.json and the
curves as OUT/learning.png:

    {"before": {"accuracy", "format_rate"}, "after": {...}, "minutes", "task", "steps", "samples", "curves", ...}

    python benchmarks/learning.py                          # about half an hour on a 2-core CPU
    python benchmarks/learning.py --task count_words       # learns a constant: see the README
    python benchmarks/learning.py -- --lr 5e-5             # anything after -- goes to train.py

Accuracy is the figure that counts, and the sampled completions say whether it is real: format
compliance alone can be won without learning anything, and so can accuracy, by a constant answer (the
README's count_words run). The minutes are the whole run's wall time, the model loading and every
evaluation included.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, load_experiment, scalars

TASKS = list(load_experiment().TASKS)  # experiment_base's --task choices
FILTERS = {"math": ["--filter", "num_terms=2", "--filter", "num_digits=2", "--filter", "ops=+,-"]}  # before yours


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-name", default="packaged:gemma-3-270m", help="model (default: %(default)s)")
    p.add_argument("--task", choices=TASKS, default="sequence", help="experiment_base's --task (its CPU default is sequence); math keeps its two-term two-digit +/- rows "
                   "(a --filter of yours after -- replaces one on the same field) (default: %(default)s)")
    p.add_argument("--steps", type=int, default=40, help="training steps (default: %(default)s)")
    p.add_argument("--samples", type=int, default=20, help="held-out problems to sample one completion each for at the "
                   "end, at the training temperature (default: %(default)s)")
    p.add_argument("--eval-prompts", type=int, default=100, help="held-out problems per evaluation (default: %(default)s)")
    p.add_argument("--eval-interval", type=int, default=10, help="evaluate every N steps (default: %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="output folder (default: benchmarks/results)")
    p.add_argument("--run-name", default=None, help="run name (default: learning-<time>)")
    p.add_argument("train_args", nargs="*", help="extra options for experiment_base/train.py, after --")
    args = p.parse_args(argv)
    if min(args.steps, args.eval_prompts, args.eval_interval) < 1 or args.samples < 0:
        p.error("--steps, --eval-prompts and --eval-interval must be at least 1, --samples at least 0")
    return args


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


def sample_at_end(args, checkpoint, train_args):
    """One completion, sampled as in training, for each of the first --samples held-out problems, with the adapter
    of `checkpoint`: [{"question", "answer", "completion", "correct"}]. Read them: a right answer copied from the
    prompt or from the worked example is no answer."""
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    base = load_experiment()
    options = base.parse_args(["--model-name", args.model_name, "--task", args.task, *FILTERS.get(args.task, []), *train_args])
    tasks = base.load_tasks(options.eval_data_path, options.prompt_key, options.answer_key, options.filter, args.samples)
    model, tokenizer = base.load_model(options)
    set_peft_model_state_dict(model, load_file(checkpoint / "adapter_model.safetensors"))
    base.add_prompts(model, tokenizer, options, tasks, [])
    score = base.Scorer(options.task, options.reasoning_format, options.partial_credit)
    torch.manual_seed(options.seed)
    with torch.no_grad():
        result = base.rollout(model.eval(), tokenizer, tasks, 1, options.max_length, options.temperature, options.top_p,
                              options.generation_batch_size, score)
    return [{"question": t["question"], "answer": t["answer"], "completion": c, "correct": bool(right == 1)}
            for t, c, right in zip(tasks, result.completions, result.terms["correctness"].tolist())]


def main(argv=None):
    args = parse_args(argv)
    run_name = args.run_name or f"learning-{time.strftime('%Y%m%d-%H%M%S')}"
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir, checkpoints = args.out / "runs", args.out / "checkpoints"
    command = [sys.executable, str(ROOT / "experiment_base" / "train.py"), "--model-name", args.model_name,
               "--task", args.task, "--max-steps", str(args.steps), "--eval-interval", str(args.eval_interval),
               "--eval-prompts", str(args.eval_prompts), "--run-name", run_name, "--log-dir", str(log_dir),
               "--checkpoint-path", str(checkpoints), "--checkpoint-interval", "0", "--keep-checkpoints", "1",
               *FILTERS.get(args.task, []), *args.train_args]
    print(" ".join(command), flush=True)
    started = time.perf_counter()
    if subprocess.run(command).returncode != 0:
        sys.exit("error: experiment_base/train.py failed (its output is above)")
    minutes = (time.perf_counter() - started) / 60
    curves = scalars(log_dir / run_name)
    first, last = (lambda tag: curves[tag][0][1]), (lambda tag: curves[tag][-1][1])
    before = {"accuracy": first("eval/accuracy"), "format_rate": first("eval/format_rate")}
    after = {"accuracy": last("eval/accuracy"), "format_rate": last("eval/format_rate")}
    samples = sample_at_end(args, checkpoints / run_name / f"step_{args.steps:06d}", args.train_args) if args.samples else []
    result = {
        "before": before, "after": after, "minutes": minutes, "task": args.task, "steps": args.steps,
        "model": args.model_name, "eval_prompts": args.eval_prompts, "samples": samples, "curves": curves,
        "command": command,
    }
    png, figures = args.out / "learning.png", args.out / "learning.json"
    plot(curves, png, f"experiment_base, {args.model_name}, --task {args.task}, {minutes:.0f} min on CPU")
    figures.write_text(json.dumps(result, indent=2))
    print(f"\n{args.steps} steps in {minutes:.1f} minutes (training only: the samples below came after); "
          f"{args.eval_prompts} held-out problems, greedy\n")
    print("| held out | before | after |\n| --- | --- | --- |")
    print(f"| accuracy | {before['accuracy']:.0%} | {after['accuracy']:.0%} |\n"
          f"| format rate | {before['format_rate']:.0%} | {after['format_rate']:.0%} |")
    if samples:
        print(f"\n{len(samples)} held-out problems, one completion each sampled with the trained adapter "
              f"({sum(s['correct'] for s in samples)} right):")
        for s in samples:
            print(f"  [{'right' if s['correct'] else 'wrong'}] answer {s['answer']}: {s['completion']!r}")
    print(f"\nwrote {png} and {figures}")


if __name__ == "__main__":
    main()
