"""What the benchmarks share: loading an experiment's train.py, the GRPO step workload that step_time.py and
levers.py time, running one side in a fresh process, and reading TensorBoard scalars. tests/conftest.py loads the
experiments through load_experiment too."""

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_module(path, name=None):
    """A Python file imported by path as its own module (named after the file unless named)."""
    spec = importlib.util.spec_from_file_location(name or Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_experiment(name="experiment_base"):
    """An experiment's train.py as a module of its own, experiment_base's unless named."""
    return load_module(ROOT / name / "train.py", f"{name}_train")


def workload_parser(description, steps, only):
    """The options both benchmarks of a GRPO step share: model, sizes, steps, dtype, data, --only, --json."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-name", default="packaged:gemma-3-270m", help="hub id, local folder or .gguf (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=4, help="completions per prompt (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="completion budget (default: %(default)s)")
    p.add_argument("--steps", type=int, default=steps, help="steps per run; the first is a warm-up (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="model dtype, as experiment_base's --dtype (default: %(default)s)")
    p.add_argument("--data-path", default=str(ROOT / "data" / "math_tasks.jsonl"), help="prompts (default: data/math_tasks.jsonl)")
    p.add_argument("--only", choices=only, help="run one of them in this process and print its JSON")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    return p


def check_steps(parser, args):
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is a warm-up")
    return args


def workload(args, base):
    """(model folder, dtype, device, tasks): the same for both sides; each task carries its formatted prompt."""
    device = "cuda" if base.torch.cuda.is_available() else "cpu"
    path = base.resolve_model_path(args.model_name)
    dtype = base.resolve_dtype(args.dtype, device)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tasks = base.load_tasks(args.data_path, max_rows=args.prompts * args.steps)
    for task in tasks:
        task["prompt"] = base.format_prompt(tokenizer, task["question"])
    return path, dtype, device, tasks


def peak_memory(device):
    import torch

    peak = {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if device == "cuda":
        peak["gpu_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return peak


def project_steps(base, options, tasks, args):
    """Load the model and run args.steps GRPO steps of experiment_base, timing sampling and the whole step."""
    base.torch.manual_seed(0)
    model, tokenizer = base.load_model(options)
    optimizer = base.make_optimizer(model, options)
    scheduler = base.torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0)  # constant, as --warmup-steps 0
    steps = []
    for step in range(args.steps):
        started = time.perf_counter()
        model.eval()
        result = base.rollout(model, tokenizer, tasks[step * args.prompts : (step + 1) * args.prompts], args.group_size,
                              args.max_new_tokens)
        sampled = time.perf_counter()
        advantages = base.group_advantages(result.rewards.view(-1, args.group_size)).flatten()
        model.train()
        base.train_step(model, (result.sequence_ids, result.attention_mask, result.action_mask, advantages), options, optimizer,
                        scheduler)
        steps.append({"seconds": time.perf_counter() - started, "sampling_seconds": sampled - started,
                      "tokens": int(result.action_mask.sum())})
    return steps


def run_alone(script, only, argv):
    """Run `script --only ONLY ARGV` in a fresh process (its peak memory is its own); returns its RESULT JSON."""
    process = subprocess.run([sys.executable, str(script), "--only", only, *argv], capture_output=True, text=True)
    lines = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
    if process.returncode != 0 or not lines:
        sys.exit(f"error: {only} failed:\n{process.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def write_json(path, results):
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {path}")


def scalars(log_dir):
    """{tag: [(step, value), ...]} from the TensorBoard event files under log_dir, one value per step (the last)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = {}
    for events in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            values.setdefault(tag, {}).update({e.step: e.value for e in accumulator.Scalars(tag)})
    return {tag: sorted(points.items()) for tag, points in values.items()}
