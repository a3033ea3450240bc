"""Checkpoints through accelerate's save_state and load_state: the trainable weights only, under the model's own names;
never unpickled (every file load_state would read is read first as tensors and plain data, and load_state is shown
those files alone). The save itself is each accelerate copy's, in one process or in several, never overwriting
(step_N.partial renamed when complete: tiny_grpo/checkpoints.py's partial_folder and save_failed). The run folder,
--resume's choice of a checkpoint and training_state.pt are tiny_grpo/checkpoints.py's."""

import os, pickle, re, tempfile  # noqa: E401
from pathlib import Path

import torch

from tiny_grpo import checkpoints
from tiny_grpo.checkpoints import apply_learning_rate, check_weight_names, load_state_file
from tiny_grpo.models import safetensors_problem


def save_trainable_weights(models, weights, output_dir):
    """accelerator.save_state hook. Left alone, save_state writes every weight, the frozen (4-bit) base model
    included, under the names of the wrapper around it (DDP: "module.model..."); instead, write the trainable
    weights only (the LoRA adapter, or everything with --no-lora), under the model's own names."""
    from accelerate.utils import extract_model_from_parallel

    for i, model in enumerate(models[: len(weights)]):  # DeepSpeed and FSDP save their own weights: no entries
        named = extract_model_from_parallel(model).named_parameters()
        weights[i] = {name: p.detach() for name, p in named if p.requires_grad}


def load_trainable_weights(models, input_dir):
    """accelerator.load_state hook, the other half: load those weights, then leave accelerate no model to load."""
    from accelerate.utils import extract_model_from_parallel
    from safetensors.torch import load_file

    for model in models:  # one: the policy
        model = extract_model_from_parallel(model)
        file = Path(input_dir) / "model.safetensors"  # a link to the checkpoint's (resume shows load_state a view)
        saved = load_file(file)
        check_weight_names(file.resolve().parent.parent, saved,
                           {n: p for n, p in model.named_parameters() if p.requires_grad})
        model.load_state_dict(saved, strict=False)  # the frozen weights are not in it
    models.clear()


# What training_state.pt must hold, and of which type, for a resume to restore the run
STATE_KEYS = {"step": int, "data_position": list}  # the rest is in accelerate_state/ (the schedule: in both)


def checkpoint_problem(folder, experiment):
    """Why a checkpoint folder cannot be resumed, or None: tiny_grpo.checkpoints' checks with this training state's
    keys (STATE_KEYS), then every file of its accelerate_state/ (accelerate_state_problem). Read before the model
    loads: a damaged newest step is passed over. experiment: the one resuming."""
    return (checkpoints.checkpoint_problem(folder, STATE_KEYS)
            or accelerate_state_problem(folder, load_state_file(folder), experiment))


def accelerate_state_problem(folder, state, experiment):
    """Why accelerate_state/ cannot be loaded, or None. Every file that load_state would read (state_files) is read
    here first, as tensors and plain data only (weights_only; memory-mapped, not copied): a damaged one is passed
    over, and a pickled object never runs. The schedule of a checkpoint before 2026-11-27 is custom_checkpoint_0.pkl.
    A checkpoint that another experiment than experiment wrote is not judged here."""
    from accelerate.utils import load

    if state.get("experiment", experiment) != experiment:  # find_checkpoint names the experiment that wrote it
        return None
    state_dir = folder / "accelerate_state"
    needed = ["model.safetensors", "optimizer.bin", "random_states_0.pkl"] + ([] if "scheduler" in state else
                                                                             ["custom_checkpoint_0.pkl"])
    missing = [name for name in needed if not (state_dir / name).is_file()]
    if missing:
        return f"accelerate_state/ lacks {', '.join(missing)}"
    for file in state_files(state_dir) + [state_dir / name for name in needed[3:]]:
        if file.suffix == ".safetensors":
            problem = safetensors_problem(file)
            if problem:
                return f"accelerate_state/{problem}"
            continue
        try:
            load(file, map_location="cpu", mmap=True)  # accelerate's torch.load: weights_only, numpy's RNG state too
        except pickle.UnpicklingError:
            return (f"accelerate_state/{file.name} holds more than tensors and plain data, so it is not loaded "
                    "(it could run code)")
        except Exception as e:  # cut short, or no torch file
            return f"accelerate_state/{file.name} is damaged ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return None


def state_files(state_dir):
    """The files of accelerate_state/ that accelerator.load_state reads here: the weights, the optimizer, each
    process's RNG state, fp16's gradient scaler."""
    return sorted(f for f in Path(state_dir).iterdir()
                  if re.fullmatch(r"model\.safetensors|optimizer\.bin|random_states_\d+\.pkl|scaler\.pt", f.name))


def resume(folder, accelerator, optimizer, scheduler):
    """(step, data position) of the checkpoint in folder, its weights, optimizer, schedule and random state restored;
    (0, (0, 0)) without one. Every process restores them (each its own random state, if saved by as many processes);
    the main process says so."""
    if folder is None:
        return 0, (0, 0)
    state = load_state_file(folder)
    rates = [group["initial_lr"] for group in optimizer.param_groups]  # this run's --lr, before the checkpoint's
    with tempfile.TemporaryDirectory(prefix="tiny-grpo-resume-") as view:  # load_state sees the files checked
        for file in state_files(folder / "accelerate_state"):  # (checkpoint_problem), and no custom_checkpoint_N.pkl,
            os.symlink(file.resolve(), Path(view) / file.name)  # which it would unpickle
        accelerator.load_state(view)  # with load_trainable_weights for the weights
    scheduler.load_state_dict(state["scheduler"] if "scheduler" in state else  # before 2026-11-27: accelerate's file
                              torch.load(folder / "accelerate_state" / "custom_checkpoint_0.pkl", weights_only=True))
    apply_learning_rate(optimizer, scheduler, rates, state)
    if accelerator.is_main_process:
        print(f"resumed from {folder} at step {state['step']}")
    return state["step"], tuple(state["data_position"])
