"""Fingerprints of a short run: the same completions and the same weights, before and after a restructure.

Each train.py named runs two steps of its own main() in float32 on the CPU, on a tiny random Llama built here (seed
0) and the math task's data, with a fixed seed, beta 0.01, two updates a step and a reward the model earns
from the start (the share of 7s in a completion); it prints a SHA-256 of every rollout's completions and sequence ids,
and one of every tensor the final checkpoint holds (its safetensors files, keys sorted). Two commits compute the
same thing when their fingerprints match:

    mkdir -p /tmp/old && git archive OLD experiment_base | tar -x -C /tmp/old
    python benchmarks/same_run.py /tmp/old/experiment_base experiment_base   # the old copy, then the new one

A folder must be named as the experiment it holds, with the files beside its train.py (multiturn_qa's search.py).
"""

import argparse
import hashlib
import os
import sys
import tempfile
from pathlib import Path

from common import ROOT, load_module

STEPS = ["--max-steps", "2", "--rollouts-per-step", "2", "--group-size", "4", "--max-length", "24",
         "--train-batch-size", "4", "--device", "cpu", "--dtype", "float32", "--quantization", "none",
         "--lora-r", "8", "--lr", "1e-2", "--task", "math", "--eval-interval", "0", "--seed", "7",
         "--log-completions-interval", "0", "--checkpoint-interval", "0", "--sampling-weights", "auto",
         "--kl-weight", "0.01", "--updates-per-step", "2", "--reward-fn", "benchmarks.same_run:sevens"]
# Per experiment, the options that differ: experiment_accelerate makes two updates a step by accumulating one
# micro-batch each, experiment_accelerate_ddp one update a step; the multi-turn copies have no --task (their data)
CHANGED = {"experiment_accelerate": {"--updates-per-step": ("--gradient-accumulation-steps", "1")},
           "experiment_accelerate_ddp": {"--updates-per-step": None},
           "experiment_multiturn_qa": {"--task": None}, "experiment_multiturn_tool_calling": {"--task": None}}


def options_for(name):
    """STEPS as the experiment `name` spells them."""
    options = []
    for option, value in zip(STEPS[::2], STEPS[1::2]):
        changed = CHANGED.get(name, {}).get(option, (option, value))
        options += changed or []
    return options


def sevens(completion, answer, metadata):
    """A reward the tiny random model earns in part from its first samples: the share of its characters that are 7s
    (the tests' seven_reward), so that advantages, and so the weights' change, are not 0."""
    return completion.count("7") / max(1, len(completion))


def build_tiny(folder):
    """The tests' tiny Llama (tests/conftest.py), so that the fingerprint needs no download."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_model

    return build_tiny_model(folder)


def two_steps(folder, model_dir, work, *extra):
    """(hash of every rollout's completions and sequence ids, the final checkpoint's tensors as (key, tensor) pairs,
    its files in order, each file's keys sorted) of two steps of the train.py in folder, with the options extra too."""
    from safetensors.torch import load_file

    module = load_module(Path(folder) / "train.py", f"{Path(folder).name}_{abs(hash(str(folder)))}")
    seen = hashlib.sha256()
    original = module.rollout

    def recorded(*args, **kwargs):
        result = original(*args, **kwargs)
        seen.update(repr(result.completions).encode())
        seen.update(result.sequence_ids.cpu().numpy().tobytes())
        return result

    module.rollout = recorded
    name = Path(folder).name
    options = options_for(name)
    run = f"same-{abs(hash(str(folder)))}"
    module.main(["--model-name", str(model_dir), *options, *extra, "--checkpoint-path", str(work / "out"),
                 "--log-dir", str(work / "runs"), "--run-name", run])
    files = sorted((work / "out" / run).glob("step_000002/**/*.safetensors"))
    if not files:
        raise SystemExit(f"{folder}: no safetensors in the final checkpoint")
    tensors = [(key, tensors[key]) for tensors in map(load_file, files) for key in sorted(tensors)]
    return seen.hexdigest()[:16], tensors


def fingerprint(folder, model_dir, work):
    """(completions' hash, weights' hash) of two steps of the train.py in folder."""
    import torch

    completions, tensors = two_steps(folder, model_dir, work)
    weights = hashlib.sha256()
    for key, tensor in tensors:
        weights.update(key.encode())
        weights.update(tensor.to(torch.float32).numpy().tobytes())
    return completions, weights.hexdigest()[:16]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", help="folders holding a train.py, each named as its experiment")
    args = p.parse_args()
    folders = [Path(folder) if Path(folder).is_absolute() else ROOT / folder for folder in args.folders]
    for folder in folders:  # checked before the model is built and any copy runs
        if not (folder / "train.py").is_file():
            p.error(f"{folder}: no train.py in it")
    os.chdir(ROOT)  # the tasks' data paths are relative to the repository root
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny(Path(tmp) / "tiny")
        for i, folder in enumerate(folders):
            work = Path(tmp) / f"run{i}"
            completions, weights = fingerprint(folder, model_dir, work)
            print(f"{folder}: completions {completions}  weights {weights}", flush=True)


if __name__ == "__main__":
    main()
