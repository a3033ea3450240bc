"""Greedy accuracy and format rate of a model, or of a trained checkpoint, on held-out tasks.

Uses experiment_base's own prompts, sampling loop and reward terms (accuracy = mean correctness).

    python benchmarks/evaluate.py                                    # packaged Gemma-3-270M, every task, 100 problems
    python benchmarks/evaluate.py --tasks math --checkpoint output/RUN/step_000050
    python benchmarks/evaluate.py --model-name DIR --eval-prompts 20 --max-length 64

A task whose held-out file is missing (GSM8K needs data/prepare_gsm8k.py and the hub) is reported
as such, not as a failure.
"""

import argparse
import json
import sys
from pathlib import Path

from step_time import load_base

TASKS = ["math", "gsm8k", "knights_knaves"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-name", default="packaged:gemma-3-270m", help="model (default: %(default)s)")
    p.add_argument("--checkpoint", type=Path, help="a step_N folder written by experiment_base (its LoRA adapter is loaded)")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=TASKS, help="tasks (default: all)")
    p.add_argument("--eval-prompts", type=int, default=100, help="held-out problems per task (default: %(default)s)")
    p.add_argument("--max-length", type=int, default=256, help="completion budget in tokens (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="as experiment_base's --dtype (default: %(default)s)")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    base = load_base()
    model = tokenizer = None
    results = {}
    for task in args.tasks:
        options = base.parse_args(["--model-name", args.model_name, "--task", task, "--eval-prompts", str(args.eval_prompts),
                                   "--max-length", str(args.max_length), "--dtype", args.dtype])
        if not Path(options.eval_data_path).is_file():
            results[task] = {"missing": options.eval_data_path}
            continue
        tasks = base.load_tasks(options.eval_data_path, max_rows=args.eval_prompts)
        if model is None:
            model, tokenizer = base.load_model(options)
            if args.checkpoint:
                from peft import set_peft_model_state_dict
                from safetensors.torch import load_file

                set_peft_model_state_dict(model, load_file(args.checkpoint / "adapter_model.safetensors"))
        score = base.Scorer(task=task)
        results[task] = {**base.evaluate(model, tokenizer, tasks, options, score), "problems": len(tasks)}
        print(f"{task}: {results[task]}", flush=True)
    name = args.model_name + (f" + {args.checkpoint}" if args.checkpoint else "")
    print(f"\n{name}, greedy, up to {args.max_length} tokens\n")
    print("| task | problems | accuracy | format rate |\n| --- | --- | --- | --- |")
    for task, r in results.items():
        if "missing" in r:
            print(f"| {task} | - | not run: {r['missing']} is missing | |")
        else:
            print(f"| {task} | {r['problems']} | {r['eval/accuracy']:.0%} | {r['eval/format_rate']:.0%} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
