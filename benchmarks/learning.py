"""Does it learn? Train the packaged Gemma-3-270M with experiment_base on CPU and measure held-out accuracy.

Runs experiment_base/train.py (or --experiment experiment_drgrpo, with its --algorithm or --preset after --)
with its CPU defaults, which are the demo's recipe (`recipe` below), on --task (by default sequence, experiment_base's
CPU default: "What number comes next: 17, 21, 25, 29, ...?"; math keeps the rows with two terms of two digits
and + or -) once per seed, evaluates greedy accuracy and format rate on held-out problems before training and
every --eval-interval steps, then samples one completion for each of --samples held-out problems with each
trained adapter, prints a table per seed and the gain's min / median / max over the seeds, and writes
OUT/learning.json, and the curves as a figure (benchmarks/figures/learning.png, beside the other figures):

    {"runs": [{"seed", "before": {"accuracy", "format_rate"}, "after", "gain", "minutes", "curves", "samples",
               "reasoning"}, ...], "summary": {"gain": {"min", "median", "max"}, ...}, "experiment", "task", "steps", "machine"}

    python benchmarks/learning.py                          # one seed, 30 steps: about 15 minutes on a 2-core AMD EPYC
                                                           # in bfloat16, 21 to 26 there in float32 (AVX2 kernels)
    python benchmarks/learning.py --seeds 3                # seeds 42, 43, 44, and the gain over them
    python benchmarks/learning.py --task count_words       # learns a constant: see the README
    python benchmarks/learning.py -- --lr 5e-5 --dtype float32   # anything after -- goes to train.py
    python benchmarks/learning.py --experiment experiment_drgrpo -- --algorithm dapo

Accuracy is the figure that counts, and the sampled completions say whether it is real: format
compliance alone can be won without learning anything, and so can accuracy, by a constant answer (the
README's count_words run). On --task sequence the samples are also read by `faithful`, tiny_grpo/skill.py's
checker (no reward sees it): of the right answers, the share whose reasoning computes them (the true step added to
the last term, or the sequence written on term by term to the answer). The minutes are each run's wall time, the
model loading and every evaluation included.
"""

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
import time

from common import ROOT, load_experiment, machine, output_file, output_folder, resolved_dtype, scalars
from tiny_grpo import skill

TASKS = list(load_experiment().TASKS)  # experiment_base's --task choices
RESULTS, FIGURE = ROOT / "benchmarks" / "results", ROOT / "benchmarks" / "figures" / "learning.png"
EXPERIMENTS = ["experiment_base", "experiment_drgrpo"]  # the two whose train.py trains on --task


# train.py's options that learning.py sets itself, and what to give instead. One after -- would override its value
# (the last one given counts): `-- --max-steps 2` trained 2 steps, then found no step_000020 to sample from
SET_HERE = {"--max-steps": "give learning.py's --steps", "--eval-interval": "give learning.py's --eval-interval",
            "--eval-prompts": "give learning.py's --eval-prompts", "--model-name": "give learning.py's --model-name",
            "--task": "give learning.py's --task", "--run-name": "give learning.py's --run-name",
            "--seed": "give learning.py's --seed, so that each run of --seeds gets its own",
            "--checkpoint-path": "learning.py's --out names the folder", "--log-dir": "learning.py's --out names the folder",
            "--keep-checkpoints": "learning.py keeps the last checkpoint, which it samples from"}


def recipe(task, experiment):
    """The options the demo gives train.py before yours after -- (yours win: the last of an option counts). math: the
    two-term two-digit +/- rows. sequence: none, as train.py's CPU defaults are the recipe (DEVICE_DEFAULTS: 8 prompts a
    step of 8 completions each, sampled at temperature 0.35, lr 5e-5 (experiment_drgrpo: 0.8 and 1e-4), the reward
    correctness and format at 0.1 (experiment_drgrpo: correctness alone), and in experiment_base no KL term;
    experiment_drgrpo's algorithms choose their own beta). The format term scores a completion cut at the budget below
    a closed wrong one; in a group whose completions all close their tags it is the same for each and changes no
    advantage. Without it bfloat16 seed 49 learned to write terms on past the answer, up to the budget, and gained 19
    points; with it 41.
    On the seven-step sequences the untrained model's samples of 32 training prompts x 8 were right 5% of the time at T
    0.8 and 18% at 0.35, computed by their reasoning 8 and 33 times, with 12 and 16 groups of 32 that differ; a step
    moves log softmax(z / T) by about lr / T, so the lower T takes half the rate: docs/results/learning.md has the
    screen and the runs."""
    if task == "math":
        return ["--filter", "num_terms=2", "--filter", "num_digits=2", "--filter", "ops=+,-"]
    return []


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-name", default="packaged:gemma-3-270m", help="model (default: %(default)s)")
    p.add_argument("--experiment", choices=EXPERIMENTS, default="experiment_base", help="whose train.py to run; "
                   "experiment_drgrpo takes --algorithm or --preset after -- (default: %(default)s)")
    p.add_argument("--task", choices=TASKS, default="sequence", help="experiment_base's --task (its CPU default is sequence); math keeps its two-term two-digit +/- rows "
                   "(a --filter of yours after -- replaces one on the same field) (default: %(default)s)")
    p.add_argument("--steps", type=int, help="training steps (default: the experiment's on a CPU: 30 for experiment_base, "
                   "20 for experiment_drgrpo)")
    p.add_argument("--samples", type=int, default=100, help="held-out problems to sample one completion each for at the "
                   "end, at the training temperature (default: %(default)s)")
    p.add_argument("--seed", type=int, default=42, help="the first seed, train.py's --seed (default: %(default)s)")
    p.add_argument("--seeds", type=int, default=1, help="runs, with seeds --seed, --seed + 1, ... (default: %(default)s)")
    p.add_argument("--eval-prompts", type=int, default=100, help="held-out problems per evaluation (default: %(default)s)")
    p.add_argument("--eval-interval", type=int, default=10, help="evaluate every N steps (default: %(default)s)")
    p.add_argument("--out", type=output_folder, default=RESULTS, help="output folder (default: benchmarks/results)")
    p.add_argument("--figure", type=output_file, help="the curves as PNG (default: benchmarks/figures/learning.png, or "
                   "OUT/learning.png when --out names another folder)")
    p.add_argument("--run-name", default=None, help="run name (default: learning-<time>)")
    p.add_argument("train_args", nargs="*", help="extra options for train.py, after --")
    args = p.parse_args(argv)
    if args.steps is None:  # train.py's own --max-steps on a CPU (DEVICE_DEFAULTS), which its recipe was measured at
        args.steps = load_experiment(args.experiment).DEVICE_DEFAULTS["max_steps"][1]
    if min(args.steps, args.eval_prompts, args.eval_interval, args.seeds) < 1 or args.samples < 0:
        p.error("--steps, --eval-prompts, --eval-interval and --seeds must be at least 1, --samples at least 0")
    for given in args.train_args:  # an option after -- is train.py's, which takes a prefix of an option's name too
        name = given.split("=", 1)[0]
        for option, instead in SET_HERE.items():
            if name.startswith("--") and len(name) > 2 and option.startswith(name):
                p.error(f"{given} after --: learning.py sets train.py's {option} itself; {instead}")
    return args


def plot(lines, path, title):
    """Training reward and held-out accuracy over the steps, one line per {label: a run's curves} (a seed, an algorithm),
    and the held-out set's best guess that needs no skill (its eval/baseline_* curves, where the runs logged them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for label, curves in lines.items():
        top.plot(*zip(*curves["rollout/reward_mean"]), label=label)
        bottom.plot(*zip(*curves["eval/accuracy"]), marker="o", label=label)
    guesses = {tag: curve for tag, curve in next(iter(lines.values()), {}).items() if tag.startswith("eval/baseline_")}
    if guesses:  # the same held-out set for every line: its best guess that needs no skill, for scale
        tag, curve = max(guesses.items(), key=lambda item: max(value for _, value in item[1]))
        bottom.plot(*zip(*curve), linestyle="--", color="grey",
                    label=f"best guess needing no skill ({tag.removeprefix('eval/baseline_')})")
    top.set_ylabel("training reward (mean)")
    bottom.set_ylabel("held-out greedy accuracy")
    bottom.set_xlabel("step")
    bottom.set_ylim(-0.02, 1.02)
    top.legend(fontsize=8)
    bottom.legend(fontsize=8, ncol=2, loc="upper left")  # the accuracies rise to the right, below the legend
    for axes in (top, bottom):
        axes.grid(alpha=0.3)
    figure.suptitle(textwrap.fill(title, 90), fontsize=10)  # a long title in lines, not cut at the figure's edge
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def faithful(question, completion, task="sequence"):
    """Whether the completion's reasoning computes its answer: tiny_grpo/skill.py's `faithful` (None where a task's
    reasoning cannot be checked, every task but sequence). The reward never sees this; it says whether right answers
    come with right reasons."""
    return skill.faithful(task, question, completion)


def sample_at_end(args, checkpoint, train_args, seed):
    """One completion, sampled as in training, for each of the first --samples held-out problems, with the adapter
    of `checkpoint`: [{"question", "answer", "completion", "correct"}]. Read them: a right answer copied from the
    prompt or from the worked example is no answer."""
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    base = load_experiment(args.experiment)
    options = base.parse_args(["--model-name", args.model_name, "--task", args.task, "--seed", str(seed),
                               *recipe(args.task, args.experiment), *train_args])
    tasks = base.load_tasks(options.eval_data_path, options.prompt_key, options.answer_key, options.filter, args.samples,
                            options.data_config, options.eval_split, options.task)
    model, tokenizer = base.load_model(options)
    set_peft_model_state_dict(model, load_file(checkpoint / "adapter_model.safetensors"))
    base.add_prompts(model, tokenizer, options, tasks, [])
    score = base.Scorer(options.task, options.reasoning_format, options.partial_credit)
    torch.manual_seed(options.seed)
    with torch.no_grad(), base.sampling_weights(model, options):  # as train.py samples (4-bit weights dequantized once)
        result = base.rollout(model.eval(), tokenizer, tasks, 1, options.max_length, options.temperature, options.top_p,
                              options.generation_batch_size, score)
    return [{"question": t["question"], "answer": t["answer"], "completion": c, "correct": bool(right == 1)}
            for t, c, right in zip(tasks, result.completions, result.terms["correctness"].tolist())]


def train(args, seed, run_name):
    """One run of --experiment's train.py with this seed: its figures, curves and samples."""
    log_dir, checkpoints = args.out / "runs", args.out / "checkpoints"
    command = [sys.executable, str(ROOT / args.experiment / "train.py"), "--model-name", args.model_name,
               "--task", args.task, "--max-steps", str(args.steps), "--eval-interval", str(args.eval_interval),
               "--eval-prompts", str(args.eval_prompts), "--seed", str(seed), "--run-name", run_name,
               "--log-dir", str(log_dir), "--checkpoint-path", str(checkpoints), "--checkpoint-interval", "0",
               "--keep-checkpoints", "1", *recipe(args.task, args.experiment), *args.train_args]
    print(" ".join(command), flush=True)
    started = time.perf_counter()
    if subprocess.run(command).returncode != 0:
        sys.exit(f"error: {args.experiment}/train.py failed (its output is above)")
    minutes = (time.perf_counter() - started) / 60
    curves = scalars(log_dir / run_name)
    first, last = (lambda tag: curves[tag][0][1]), (lambda tag: curves[tag][-1][1])
    before = {"accuracy": first("eval/accuracy"), "format_rate": first("eval/format_rate")}
    after = {"accuracy": last("eval/accuracy"), "format_rate": last("eval/format_rate")}
    checkpoint = checkpoints / run_name / f"step_{args.steps:06d}"
    samples = sample_at_end(args, checkpoint, args.train_args, seed) if args.samples else []
    right = [s for s in samples if s["correct"]]
    reasoning = None
    verdicts = [faithful(s["question"], s["completion"], args.task) for s in samples]
    if any(verdict is not None for verdict in verdicts):  # a task whose reasoning can be checked (sequence)
        for s, verdict in zip(samples, verdicts):
            s["faithful"] = verdict
        computed = sum(bool(s["faithful"]) for s in right)  # None (a question it cannot read) is not computed
        reasoning = {"right": len(right), "faithful": computed, "share": computed / len(right) if right else None}
    return {"seed": seed, "before": before, "after": after, "gain": after["accuracy"] - before["accuracy"],
            "minutes": minutes, "samples": samples, "reasoning": reasoning, "curves": curves, "command": command}


def spread(values):
    values = [v for v in values if v is not None]
    return {"min": min(values), "median": statistics.median(values), "max": max(values)} if values else None


def main(argv=None):
    args = parse_args(argv)
    run_name = args.run_name or f"learning-{time.strftime('%Y%m%d-%H%M%S')}"
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = load_experiment(args.experiment).parse_args(["--model-name", args.model_name, *args.train_args]).dtype  # after --, or auto
    where = machine(resolved_dtype(dtype))
    seeds = range(args.seed, args.seed + args.seeds)
    runs = [train(args, seed, f"{run_name}-seed{seed}" if args.seeds > 1 else run_name) for seed in seeds]
    summary = {"gain": spread([r["gain"] for r in runs]), "minutes": spread([r["minutes"] for r in runs]),
               "faithful_share": spread([(r["reasoning"] or {}).get("share") for r in runs])}
    result = {"experiment": args.experiment, "task": args.task, "steps": args.steps, "model": args.model_name, "eval_prompts": args.eval_prompts,
              "machine": where, "summary": summary, "runs": runs}
    png, figures = args.figure or (FIGURE if args.out == RESULTS else args.out / "learning.png"), args.out / "learning.json"
    png.parent.mkdir(parents=True, exist_ok=True)
    title = f"{args.experiment}, --task {args.task}, {len(runs)} seed(s), on {where['cpu']} ({where['cores']} cores, {where['dtype']})"
    plot({f"seed {r['seed']}": r["curves"] for r in runs}, png, title)
    figures.write_text(json.dumps(result, indent=2))
    print(f"\n{args.steps} steps, {args.eval_prompts} held-out problems, greedy; on {where['cpu']}, {where['dtype']}\n")
    print("| seed | accuracy before | after | gain | format rate before | after | minutes | right answers with faithful reasoning |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        why = f"{r['reasoning']['faithful']} of {r['reasoning']['right']}" if r["reasoning"] else "-"
        print(f"| {r['seed']} | {r['before']['accuracy']:.0%} | {r['after']['accuracy']:.0%} | {r['gain']:+.0%} | "
              f"{r['before']['format_rate']:.0%} | {r['after']['format_rate']:.0%} | {r['minutes']:.1f} | {why} |")
    gain = summary["gain"]
    print(f"\ngain over {len(runs)} seed(s): min {gain['min']:+.0%}, median {gain['median']:+.0%}, max {gain['max']:+.0%}")
    for r in runs:
        if r["samples"]:
            print(f"\nseed {r['seed']}: {len(r['samples'])} held-out problems, one completion each sampled with the trained "
                  f"adapter ({sum(s['correct'] for s in r['samples'])} right); the first five:")
            for s in r["samples"][:5]:
                print(f"  [{'right' if s['correct'] else 'wrong'}] answer {s['answer']}: {s['completion']!r}")
    print(f"\nwrote {png} and {figures}")


if __name__ == "__main__":
    main()
