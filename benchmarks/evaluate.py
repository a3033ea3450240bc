"""Greedy accuracy and format rate of a model, or of a trained checkpoint, on held-out tasks.

Uses experiment_base's own prompts, sampling loop and reward terms (accuracy = mean correctness).

    python benchmarks/evaluate.py                                    # packaged Gemma-3-270M, every task, 100 problems
    python benchmarks/evaluate.py --tasks math --checkpoint output/RUN/step_000050
    python benchmarks/evaluate.py --model-name DIR --eval-prompts 20 --max-length 64
    python benchmarks/evaluate.py --tasks gsm8k --data gsm8k=/tmp/gsm8k/test-00000-of-00001.parquet
    python benchmarks/evaluate.py --tasks math --filter num_terms=2 --filter num_digits=2 --filter ops=+,-,+- --samples 16

With --samples K it also samples K completions per problem at --temperature (1, as GRPO's rollouts do),
and reports their accuracy and pass@K (the share of problems with at least one correct completion
among the K). A problem no completion gets right gives GRPO nothing to reinforce: pass@K at the
group size bounds how many groups can carry a correctness signal.

A task whose default held-out data cannot be read (GSM8K comes from the hub, openai/gsm8k; offline,
give a local copy with --data gsm8k=FILE) is reported as not run, with the reason, not as a failure;
a --data file that cannot be read is an error, before the model loads.

A checkpoint of experiment_drgrpo or of the accelerate copies is evaluated as experiment_base's (they
share its prompts and rewards); a multi-turn experiment's is refused: its own train.py evaluates it.
A copy's (train.py records its folder's name: my_exp/train.py, "my_exp") is evaluated as the first of
those whose options hold every option it recorded that an experiment here has (experiment_base, for a
copy of its train.py), and refused otherwise.
"""

import argparse
import functools
import json
import re
import sys
from pathlib import Path

import torch
from common import ROOT, load_experiment, machine, output_file, resolved_dtype, write_json
import tiny_grpo.checkpoints

BASE = load_experiment()  # whose options main() hands the values on to: they are checked here, with its types
TASKS = list(BASE.TASKS)  # experiment_base's --task choices
DTYPES = ["auto", "bfloat16", "float16", "float32"]  # experiment_base's --dtype choices
# The experiments whose prompts, rollouts and rewards are experiment_base's (they change how it trains): their
# checkpoints are evaluated here as its own. The multi-turn ones sample episodes of their own (tool calls, searches).
SAME_PROMPTS = ["experiment_base", "experiment_drgrpo", "experiment_accelerate", "experiment_accelerate_ddp"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-name", default="packaged:gemma-3-270m", help="model (default: %(default)s)")
    p.add_argument("--checkpoint", type=Path, help="a step_N folder written by experiment_base, or its run folder (the "
                   "newest complete step_N in it, as --resume takes): its LoRA adapter is loaded, built as its "
                   "adapter_config.json says")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=TASKS, help="tasks (default: all)")
    # Refused here, not by experiment_base's parser in main(): that one would print train.py's usage under this name
    p.add_argument("--eval-prompts", type=BASE.integer("[1, inf)"), default=100,
                   help="held-out problems per task (default: %(default)s)")
    p.add_argument("--max-length", type=BASE.integer("[1, inf)"), default=256,
                   help="completion budget in tokens (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="as experiment_base's --dtype (default: %(default)s)")
    p.add_argument("--data", action="append", default=[], metavar="TASK=PATH",
                   help="held-out file of a task instead of its default, e.g. gsm8k=/tmp/gsm8k_test.jsonl; repeatable")
    p.add_argument("--filter", action="append", default=[], metavar="FIELD=V1,V2",
                   help="as experiment_base's --filter: keep rows whose FIELD is one of the values; repeatable")
    p.add_argument("--samples", type=BASE.integer("[0, inf)"), default=0, help="also sample K completions per problem at --temperature "
                   "and report their accuracy and pass@K (default: 0, greedy only)")
    p.add_argument("--temperature", type=BASE.real("(0, inf)"), default=1.0, help="temperature of those samples (default: %(default)s)")
    p.add_argument("--generation-batch-size", type=BASE.integer("[1, inf)"), default=64, help="sequences sampled at once (default: %(default)s)")
    p.add_argument("--json", type=output_file, help="also write the results as JSON here")
    args = p.parse_args(argv)
    try:
        args.data = dict(item.split("=", 1) for item in args.data)
    except ValueError:
        p.error(f"--data expects TASK=PATH, got {args.data}")
    unknown = set(args.data) - set(TASKS)
    if unknown:
        p.error(f"--data: unknown task {sorted(unknown)} (tasks: {', '.join(TASKS)})")
    args.lora_options = []
    if args.checkpoint:  # checked before the model loads; the adapter is built with the rank and scale it was trained with
        args.checkpoint, args.lora_options = checked_checkpoint(p, args.checkpoint)
    return args


def checked_checkpoint(parser, path):
    """(the step_N folder to load, experiment_base's LoRA options for it). A run folder gives its newest complete
    step: a damaged newer one is passed over, as --resume passes over it (judged by the train.py that wrote it)."""
    if not path.is_dir():
        parser.error(f"--checkpoint {path}: no such folder")
    if (path / "adapter_model.safetensors").is_file():
        try:
            written_by(parser, path)
        except BASE.InputError as e:
            parser.error(f"--checkpoint {str(e).removeprefix('--resume ')}")
    else:
        steps = tiny_grpo.checkpoints.checkpoints_in(path)[::-1]
        if not steps:
            parser.error(f"--checkpoint {path}: neither a checkpoint (adapter_model.safetensors, adapter_config.json) "
                         "nor a run folder holding step_N checkpoints")
        for step in steps:
            try:
                writer = load_experiment(written_by(parser, step))  # the accelerate copies judge their own state files
                problem = getattr(writer, "checkpoint_problem", tiny_grpo.checkpoints.checkpoint_problem)(step)
            except BASE.InputError as e:  # its training_state.pt cannot be read
                problem = str(e).removeprefix(f"--resume {step}: ")
            if problem is None:
                break
            print(f"--checkpoint: {step.name} is damaged ({problem}); trying the step before it", file=sys.stderr)
        else:
            parser.error(f"--checkpoint {path}: no complete checkpoint there")
        path = step
        print(f"--checkpoint: the newest checkpoint of that run, {path.name}")
    try:
        config = json.loads((path / "adapter_config.json").read_text())
        r, alpha = int(config["r"]), int(config["lora_alpha"])
        if min(r, alpha) < 1:
            raise ValueError(f"r {r} and lora_alpha {alpha}, where both must be at least 1")
        options = ["--lora-r", str(r), "--lora-alpha", str(alpha)]
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"--checkpoint {path}: its adapter_config.json does not say the adapter's r and lora_alpha ({e})")
    if not (path / "adapter_model.safetensors").is_file():
        parser.error(f"--checkpoint {path}: no adapter_model.safetensors in it")
    problem = tiny_grpo.checkpoints.safetensors_problem(path / "adapter_model.safetensors")  # cut short, a bad header
    if problem:
        parser.error(f"--checkpoint {path}: {problem}")
    return path, options


def written_by(parser, folder):
    """The experiment whose train.py wrote the checkpoint in folder, as its training_state.pt records it (raises
    InputError where that file cannot be read; experiment_base where it is absent, an adapter saved alone, or records
    none, as before 2026-11-23). A multi-turn experiment's is refused: its prompts and rewards are not experiment_base's.
    A name that is no experiment here (train.py records its folder's name: a copy in my_exp/ records "my_exp") is
    judged by the options it recorded that some experiment here has: the first of SAME_PROMPTS that has all of them
    (experiment_base, for a copy of its train.py); else refused."""
    if not (folder / "training_state.pt").exists():
        return "experiment_base"
    state = tiny_grpo.checkpoints.load_state_file(folder)
    state = state if isinstance(state, dict) else {}
    experiment = state.get("experiment", "experiment_base")
    if experiment in SAME_PROMPTS:
        return experiment
    evaluated = "evaluate.py evaluates the checkpoints of " + ", ".join(SAME_PROMPTS)
    if not isinstance(experiment, str) or not re.fullmatch(r"[^/\\\0]+", experiment) or experiment in (".", ".."):
        parser.error(f"--checkpoint {folder}: a checkpoint of {experiment!r}, which no train.py records (it records "
                     f"its folder's name); {evaluated}")
    if (ROOT / experiment / "train.py").is_file():
        parser.error(f"--checkpoint {folder}: a checkpoint of {experiment!r}, whose prompts and rewards are not "
                     f"experiment_base's ({evaluated}; a multi-turn experiment's train.py evaluates its own: --eval-interval)")
    options = state.get("args")
    known = set(options) & set().union(*map(experiment_options, EXPERIMENTS)) if isinstance(options, dict) else set()
    if not known:
        parser.error(f"--checkpoint {folder}: a checkpoint of {experiment!r}, no experiment in this repository, whose "
                     f"training_state.pt records no options to tell whose copy it is; {evaluated}")
    for same in SAME_PROMPTS:
        if known <= experiment_options(same):
            print(f"--checkpoint: {folder.name} is a checkpoint of {experiment!r}, no experiment in this repository; "
                  f"its options are {same}'s: evaluated as {same}'s", file=sys.stderr)
            return same
    parser.error(f"--checkpoint {folder}: a checkpoint of {experiment!r}, no experiment in this repository, whose "
                 f"options are none of theirs ({', '.join(sorted(known - experiment_options('experiment_base'))[:5])}: "
                 f"not experiment_base's); {evaluated}")


# The experiments here: their options tell whose copy a checkpoint of another name is
EXPERIMENTS = sorted(path.parent.name for path in ROOT.glob("experiment_*/train.py"))


@functools.cache
def experiment_options(name):
    """The names of an experiment's options (its parser's), as its checkpoints record them under "args" (with what the
    shared plumbing adds there as it runs, which no experiment's parser has: left out of the comparison)."""
    return set(vars(load_experiment(name).parse_args([])))


@torch.no_grad()
def sampled(base, model, tokenizer, tasks, options, score, samples, temperature=1.0):
    """Accuracy of `samples` completions per problem at `temperature`, and pass@samples."""
    model.eval()
    with base.sampling_weights(model, options):  # as train.py samples (4-bit weights dequantized once)
        result = base.rollout(model, tokenizer, tasks, samples, options.max_length, temperature=temperature,
                              generation_batch_size=options.generation_batch_size, score=score)
    correct = (result.terms["correctness"] == 1).view(len(tasks), samples)
    return {"sample_accuracy": correct.float().mean().item(), f"pass@{samples}": correct.any(1).float().mean().item(),
            "sample_format_rate": result.terms["format"].mean().item()}


def main(argv=None):
    args = parse_args(argv)
    base = load_experiment()
    model = tokenizer = None
    results, held_out = {}, {}
    for task in args.tasks:  # every task's data first: a --data file that cannot be read stops before the model loads
        options = base.parse_args(["--model-name", args.model_name, "--task", task, "--eval-prompts", str(args.eval_prompts),
                                   "--max-length", str(args.max_length), "--dtype", args.dtype,
                                   "--generation-batch-size", str(args.generation_batch_size), *args.lora_options])
        path = args.data.get(task, options.eval_data_path)
        try:
            held_out[task] = options, base.load_tasks(path, filters=args.filter, max_rows=args.eval_prompts,
                                                      config=options.data_config, split=options.eval_split, task=task)
        except base.InputError as e:  # a default not made yet, a hub dataset offline: said in the table, the rest run
            if task in args.data:  # a file given is an error
                sys.exit(f"evaluate.py: error: --data {task}: {e}")
            results[task] = {"missing": str(e)}
    for task, (options, tasks) in held_out.items():
        if model is None:
            model, tokenizer = base.load_model(options)
            if args.checkpoint:
                from peft import get_peft_model_state_dict, set_peft_model_state_dict
                from safetensors.torch import load_file

                weights = load_file(args.checkpoint / "adapter_model.safetensors")
                try:  # a tensor missing would stay a fresh LoRA's, in silence
                    tiny_grpo.checkpoints.check_weight_names(args.checkpoint, weights, get_peft_model_state_dict(model))
                except base.InputError as e:
                    sys.exit(f"evaluate.py: error: {str(e).removeprefix('--resume ')}")
                set_peft_model_state_dict(model, weights)
        for t in tasks:
            t["prompt"] = base.format_prompt(tokenizer, t["question"], task)
        score = base.Scorer(task=task)
        metrics, _ = base.evaluate(model, tokenizer, tasks, options, score)  # (metrics, the rollout)
        results[task] = {**metrics, "problems": len(tasks)}
        if args.samples:
            results[task].update(sampled(base, model, tokenizer, tasks, options, score, args.samples, args.temperature))
        print(f"{task}: {results[task]}", flush=True)
    results = {task: results[task] for task in args.tasks}  # in --tasks' order, the tasks not run among them
    name = args.model_name + (f" + {args.checkpoint}" if args.checkpoint else "")
    k = args.samples
    print(f"\n{name}, greedy" + (f" and {k} samples at temperature {args.temperature:g}" if k else "") + f", up to {args.max_length} tokens\n")
    head = "| task | problems | accuracy | format rate |" + (f" sampled accuracy | pass@{k} |" if k else "")
    print(head + "\n|" + " --- |" * head.count(" |"))
    for task, r in results.items():
        if "missing" in r:
            print(f"| {task} | - | not run: {r['missing']} | |" + " |" * (2 if k else 0))
        else:
            row = f"| {task} | {r['problems']} | {r['eval/accuracy']:.0%} | {r['eval/format_rate']:.0%} |"
            print(row + (f" {r['sample_accuracy']:.1%} | {r[f'pass@{k}']:.0%} |" if k else ""))
    write_json(args.json, results, machine(resolved_dtype(args.dtype)))


if __name__ == "__main__":
    sys.exit(main())
