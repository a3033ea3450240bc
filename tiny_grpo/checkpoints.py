"""Checkpoints: written atomically, never overwritten, never claimed by another run, never unpickled, never resumed
with weights missing."""

import fcntl, glob, hashlib, os, pickle, random, re, resource, shutil, sys, time  # noqa: E401
from pathlib import Path

import torch

from tiny_grpo.data import FOLDER_FORMATS, hub_id
from tiny_grpo.errors import InputError
from tiny_grpo.files import write_atomically
from tiny_grpo.models import PACKAGED_GEMMA, model_fingerprint, safetensors_problem
from tiny_grpo.options import recorded_options
from tiny_grpo.report import check_wandb
from tiny_grpo.rollout_log import NAME as ROLLOUT_LOG
from tiny_grpo.stopping import say

HELD_LOCKS = {}  # run folder -> a descriptor of it; flock holds it while this process lives, however it ends

# What a resume cannot change: what the weights are, and the data whose position the checkpoint holds. Everything
# else may change; --lr and --warmup-steps apply from the next update (the optimizer's state carries on).
RESUME_MUST_MATCH = ("model_name", "quantization", "lora", "lora_r", "lora_alpha", "task", "data_path", "data_config",
                     "data_split", "filter", "prompt_key", "answer_key", "max_prompts", "seed")

def claim_run(args, problem=None):
    """(the checkpoint --resume names, or None; the run folder). Before a minute goes into loading the model: the
    checkpoint and log folders are writable, no other live run writes to the run folder, and every checkpoint in
    it will be this run's. A run folder holding checkpoints is only continued by --resume from it; resuming from an
    older step moves the newer ones aside (to superseded-TIME/), so that they are never taken for this run's."""
    # absolute, once: reward code that changes the working directory must not move the run's files elsewhere
    args.checkpoint_path, args.log_dir = os.path.abspath(args.checkpoint_path), os.path.abspath(args.log_dir)
    for option, data in (("--data-path", args.data_path), ("--eval-data-path", getattr(args, "eval_data_path", None))):
        for inside, folder in (("--checkpoint-path", args.checkpoint_path), ("--log-dir", args.log_dir)):
            if data and Path(data).is_dir() and Path(folder).resolve().is_relative_to(Path(data).resolve()):
                raise InputError(f"{inside} {folder} lies inside {option} {data}, a folder whose files datasets reads "
                                 f"as data (a checkpoint's .json too): give {inside} a folder outside it")
    checkpoint_dir = find_checkpoint(args.resume, args, problem) if args.resume else None
    args.data_fingerprint = data_fingerprint(args.data_path)  # the data as read: what every checkpoint records
    # a step an earlier --resume set aside (RUN/superseded-TIME/step_N) belongs to RUN, as its training state says
    aside = checkpoint_dir is not None and checkpoint_dir.parent.name.startswith("superseded-") and \
        load_state_file(checkpoint_dir).get("run_name") == checkpoint_dir.parent.parent.name
    owner = checkpoint_dir and (checkpoint_dir.parent.parent if aside else checkpoint_dir.parent)  # the run's folder
    if checkpoint_dir:
        args.run_name = args.run_name or owner.name  # keep logging into the same run
    state = load_state_file(checkpoint_dir) if checkpoint_dir else {}
    # the held-out evaluation a stop cut short at the checkpoint's step: the resumed run makes it first (Bookkeeping)
    args.evaluation_owed = bool(state.get("evaluation_owed"))
    args.held_out = held_out_so_far(state.get("held_out"), state.get("step"))  # the resumed run's curve, from step 0
    # the starts whose rollout-log lines the checkpoint's branch holds (RolloutLog keeps those); None: not recorded
    starts = state.get("log_starts") if checkpoint_dir else []
    args.log_starts = starts if isinstance(starts, list) else None
    args.run_name = args.run_name or f"{args.experiment}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_wandb(args)  # what W&B would refuse after the model loads
    run_dir = Path(args.checkpoint_path) / args.run_name
    for folder, option in ((run_dir, "--checkpoint-path"), (Path(args.log_dir) / args.run_name, "--log-dir")):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise InputError(f"{option}: cannot write to {folder}: {e.strerror or e}")
    log_dir = Path(args.log_dir) / args.run_name
    lock_folder(run_dir)
    lock_folder(log_dir)
    steps = checkpoints_in(run_dir)
    for odd in sorted(f for f in run_dir.glob("step_*") if re.fullmatch(r"step_\d+", f.name) and not real_folder(f)):
        print(f"{odd}: not a folder of its own (a file or a symbolic link), so no checkpoint of this run: it is neither "
              "resumed nor removed by --keep-checkpoints", file=sys.stderr)
    resuming_here = checkpoint_dir is not None and owner.resolve() == run_dir.resolve()
    if steps and not resuming_here:
        raise InputError(f"{run_dir} already holds the checkpoints of a run ({steps[-1].name}): --resume {run_dir} "
                         "continues it; another --run-name starts a new one")
    claim_log_folder(log_dir, run_dir, resuming_here)
    newer = []
    if resuming_here:  # the steps after the checkpoint; from a step set aside (superseded-TIME/), all since it was
        first = min(map(step_number, checkpoints_in(checkpoint_dir.parent))) if aside else step_number(checkpoint_dir) + 1
        newer = [s for s in steps if step_number(s) >= first]
    if newer:
        folder = new_aside_folder(run_dir)
        for step in newer:
            os.replace(step, folder / step.name)
        print(f"resuming from {checkpoint_dir.name}: moved the newer {', '.join(s.name for s in newer)} to {folder}",
              file=sys.stderr)
    if getattr(args, "model_fingerprint", None) is None:  # (find_checkpoint took it to compare)
        args.model_fingerprint = model_fingerprint(args.model_name)  # what every checkpoint records
    if args.model_name == PACKAGED_GEMMA:
        reason = "no CUDA device" if not torch.cuda.is_available() else f"--device {args.device}"
        print(f"{reason}: training the packaged Gemma-3-270M on CPU with CPU-sized defaults ({args.rollouts_per_step} "
              f"prompts x {args.group_size} completions x {args.max_length} tokens, {args.max_steps} steps)")
    return checkpoint_dir, run_dir

def new_aside_folder(parent):
    """A new folder superseded-TIME in parent (superseded-TIME-2, -3, ... after one made in the same second)."""
    stamp, count = time.strftime("%Y%m%d-%H%M%S"), 1
    while True:
        folder = parent / (f"superseded-{stamp}" + (f"-{count}" if count > 1 else ""))
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            count += 1

def step_number(folder):
    return int(folder.name.removeprefix("step_"))

def checkpoints_in(folder):
    """The step_N checkpoint folders in folder, oldest first by step number (as text, step_1000000 sorts first). A
    step_N that is a file or a symbolic link is no checkpoint of this run: never resumed, never removed."""
    return sorted((f for f in Path(folder).glob("step_*") if re.fullmatch(r"step_\d+", f.name) and real_folder(f)),
                  key=step_number)

def real_folder(path):
    return path.is_dir() and not path.is_symlink()

def lock_folder(folder):
    """Hold an exclusive lock on folder while this process lives (the folder itself: no lock file in it)."""
    key = str(folder.resolve())
    if key not in HELD_LOCKS:
        lock = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            raise InputError(f"{folder}: another run is writing to this folder now; choose another --run-name")
        HELD_LOCKS[key] = lock

def claim_log_folder(log_dir, run_dir, resuming_here):
    """The log folder holds one run's curves and rollouts: the run whose checkpoints are in run_dir, as its file .run
    says. Another run's events (the same --run-name under another --checkpoint-path) refuse it; what an earlier start
    of this run that saved no checkpoint logged (its events, rollout log and page) is moved aside whole (to
    superseded-TIME/), not mixed into this one's."""
    owner, record = str(run_dir.resolve()), log_dir / ".run"
    recorded = record.read_text() if record.is_file() else None
    events = list(log_dir.glob("events.out.tfevents.*"))
    if not resuming_here and (recorded not in (None, owner) or (recorded is None and events)):
        raise InputError(f"{log_dir} holds the TensorBoard events of another run ({recorded or 'not recorded'}): "
                         "choose another --run-name or --log-dir")
    logged = events + [log_dir / name for name in (ROLLOUT_LOG, "rollouts.html") if (log_dir / name).exists()]
    if logged and not resuming_here:  # this run's own, from a start that saved no checkpoint
        aside = new_aside_folder(log_dir)
        for file in logged:
            os.replace(file, aside / file.name)
        print(f"{log_dir}: an earlier start of this run saved no checkpoint; its events and rollout log are moved to "
              f"{aside}", file=sys.stderr)
    write_atomically(record, owner)  # through a file of its own: never through a link left at .run

def training_state(args, step, position):
    return {"step": step, "data_position": list(position), "run_name": args.run_name, "experiment": args.experiment,
            "args": recorded_options(args), "data": args.data_fingerprint, "model": getattr(args, "model_fingerprint", {}),
            "evaluation_owed": getattr(args, "evaluation_owed", False),  # a stop cut the step's evaluation short
            "log_starts": getattr(args, "log_starts", None),  # the rollout log's starts of this branch (RolloutLog)
            "held_out": getattr(args, "held_out", [])}  # [[step, accuracy], ...]: the evaluations so far (Bookkeeping)

def held_out_so_far(saved, step):
    """A checkpoint's held-out accuracies ([[step, accuracy], ...] up to its step), for the resumed run's progress
    bar and closing line; [] where it has none (a checkpoint from before 2026-11-29) or they are not such pairs: they
    are only shown, so a resume never fails on them."""
    def pair(item):
        return (isinstance(item, (list, tuple)) and len(item) == 2 and type(item[0]) is int
                and isinstance(item[1], float) and 0 <= item[0] <= step and 0 <= item[1] <= 1)
    if not isinstance(saved, list) or not isinstance(step, int) or not all(map(pair, saved)):
        return []
    return [[s, accuracy] for s, accuracy in saved]

def data_fingerprint(path):
    """The training data whose position a checkpoint holds: its resolved path, and the size and SHA-256 of its
    files (for a hub id, its name alone). Taken once, when the run claims its folders, and compared on --resume. A
    folder's files are the ones datasets reads: FOLDER_FORMATS', none hidden."""
    local = Path(path).expanduser()
    if hub_id(path):
        return {"path": path}
    pattern = not local.exists() and any(c in path for c in "*?[")
    files = sorted(Path(f) for f in glob.glob(str(local))) if pattern else [local]
    if local.is_dir():
        files = sorted(f for f in local.rglob("*") if f.is_file() and f.suffix in FOLDER_FORMATS
                       and not any(part.startswith((".", "__")) for part in f.relative_to(local).parts))
    digest, size = hashlib.sha256(), 0
    for file in files:
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
        size += file.stat().st_size
    return {"path": resolved(path), "files": len(files), "bytes": size, "sha256": digest.hexdigest()}

def resolved(path):
    """A data path as --resume compares it: './data/x' and 'data/x' are one file; a hub id is its name."""
    return path if hub_id(path) else str(Path(path).expanduser().resolve())

def options_differ(state, args):
    """The RESUME_MUST_MATCH options whose value here is not the checkpoint's, as '--name there, here' texts. The
    data path is compared resolved, --filter as a set of fields and values, in any order."""
    saved = state.get("args", {})

    def same(name, there, here):
        if name == "data_path":  # by SHA-256 (find_checkpoint), wherever the repository is now; checkpoints before
            data = state.get("data", {})  # 2026-11-27 hold the path as given
            return "sha256" in data or data.get("path", resolved(there)) == resolved(here)
        if name == "filter":
            return filter_sets(there) == filter_sets(here)
        return there == here

    return [f"--{name.replace('_', '-')} {saved[name]} there, {getattr(args, name)} here" for name in RESUME_MUST_MATCH
            if name in saved and not same(name, saved[name], getattr(args, name, saved[name]))]

def filter_sets(filters):
    return {(field, frozenset(values.split(","))) for field, _, values in (item.partition("=") for item in filters)}

def save_checkpoint(folder, model, optimizer, scheduler, state, keep):
    """Write folder atomically: everything goes to folder.partial, which is renamed when complete."""
    folder = Path(folder)
    partial = partial_folder(folder)
    if partial is None:  # saved already by this run
        return
    shutil.rmtree(partial, ignore_errors=True)
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    try:
        model.save_pretrained(partial)  # the LoRA adapter (PEFT format), or the full model with --no-lora
        torch.save({**state, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng},
                   partial / "training_state.pt")
        os.replace(partial, folder)
    except Exception as e:  # a full disk, a folder gone: no half checkpoint, the earlier ones kept
        raise save_failed(folder, partial, e)
    if keep:
        for old in checkpoints_in(folder.parent)[:-keep]:
            shutil.rmtree(old)

def partial_folder(folder):
    """folder.partial, where a save writes folder's checkpoint before renaming it folder; None where folder is a
    checkpoint already. A file or symbolic link named folder is refused, and a left-over link named folder.partial
    removed."""
    if real_folder(folder):  # saved already by this run (claim_run keeps other runs' checkpoints out)
        return None
    if folder.exists() or folder.is_symlink():
        raise InputError(f"saving {folder} failed: a file or symbolic link of that name is in the way; nothing was "
                         "overwritten")
    partial = folder.with_name(folder.name + ".partial")
    if partial.is_symlink():  # a left-over name must not lead the save out of the run folder
        partial.unlink()
    return partial

def save_failed(folder, partial, error):
    """After error while saving folder (a full disk, a folder gone): partial removed, the InputError that says so."""
    shutil.rmtree(partial, ignore_errors=True)  # no half checkpoint, the earlier ones kept
    return InputError(f"saving {folder} failed ({type(error).__name__}: {str(error)[:200]})"
                      f"{save_failure_cause(folder)}; nothing else was touched: the earlier checkpoints are kept")

def save_failure_cause(folder):
    """Why a write may have failed, as torch.save's own message ("unexpected pos 153344 vs 153232") does not say."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return f": a file-size limit of {limit:,} bytes is in force (ulimit -f)"
    try:
        free = shutil.disk_usage(folder.parent).free
    except OSError:
        return ""
    return f": the disk has only {free:,} bytes free" if free < 2**30 else ""

def find_checkpoint(path, args, problem=None):
    """A checkpoint folder, or the newest complete step_N inside a run folder (a damaged newer one is passed over,
    with a message). An error, naming what differs, if it was written by another experiment or for other weights.
    problem(folder): what is wrong with a checkpoint, or None (checkpoint_problem; accelerate_checkpoints.py's)."""
    path = Path(path)
    explicit = (path / "training_state.pt").is_file()
    candidates = [path] if explicit else checkpoints_in(path)[::-1]
    if not candidates:
        raise InputError(f"--resume {path}: no checkpoint there (expected training_state.pt or step_N folders)")
    for folder in candidates:
        damage = (problem or checkpoint_problem)(folder)
        if damage is None:
            break
        if explicit:
            raise InputError(f"--resume {folder}: {damage}")
        print(f"--resume: {folder.name} is damaged ({damage}); trying the step before it", file=sys.stderr)
    else:
        raise InputError(f"--resume {path}: no complete checkpoint there")
    state = load_state_file(folder)
    experiment = state.get("experiment", args.experiment)  # checkpoints before 2026-11-23 did not record it
    if experiment != args.experiment:
        raise InputError(f"--resume {folder}: a checkpoint of {experiment}; resume it with {experiment}/train.py")
    differs = options_differ(state, args) + data_differs(state.get("data", {}), args.data_path)
    if differs:
        raise InputError(f"--resume {folder}: its weights were trained with other options, on data whose position it "
                         f"holds: {'; '.join(differs)}. Resume with the checkpoint's values, or start a new run")
    recorded = state.get("model") or {}  # none before 2026-11-28
    args.model_fingerprint = model_fingerprint(args.model_name) if recorded else None
    now = args.model_fingerprint or recorded  # {}: a hub id not in the local hub cache, nothing to compare
    changed = sorted(f for f in recorded.keys() | now.keys() if recorded.get(f) != now.get(f))
    if changed:
        raise InputError(f"--resume {folder}: --model-name {args.model_name} is not the model it was trained from: its "
                         f"{', '.join(changed)} changed since the checkpoint was written (other weights or another "
                         "tokenizer under that name); resume with that model, or start a new run")
    return folder

def data_differs(saved, path):
    """What differs between the data a checkpoint recorded (data_fingerprint) and --data-path's now, as a list of one
    text, or []: the files' SHA-256 decides, so that a moved or copied repository resumes its runs."""
    if "sha256" not in saved:  # a hub id, or a checkpoint before 2026-11-27: options_differ compared the path
        return []
    here = data_fingerprint(path)
    if here.get("sha256") == saved["sha256"]:
        return []
    if here["path"] == saved.get("path"):
        return [f"--data-path {path}: its files changed since the checkpoint was written ({here.get('bytes', 0):,} "
                f"bytes now, {saved.get('bytes', 0):,} then; another SHA-256)"]
    return [f"--data-path {path}: {here['path']} ({here.get('bytes', 0):,} bytes) is not the data it was trained on, "
            f"{saved.get('path')} ({saved.get('bytes', 0):,} bytes; another SHA-256)"]

# What training_state.pt must hold, and of which type, for a resume to restore the run
STATE_KEYS = {"step": int, "data_position": list, "optimizer": dict, "scheduler": dict, "rng": dict}

def checkpoint_problem(folder, keys=None):
    """Why a checkpoint folder cannot be resumed (its training state does not load or lacks a part, its weights are
    missing, empty or cut short), or None. Read before the model loads: a damaged newest step is passed over.
    keys: what training_state.pt must hold, {name: type}; STATE_KEYS unless given (accelerate_checkpoints' own)."""
    try:
        state = load_state_file(folder)
    except InputError as e:
        return str(e).removeprefix(f"--resume {folder}: ")
    if not isinstance(state, dict):
        return f"training_state.pt holds a {type(state).__name__}, not the training state"
    wrong = [f"{key} ({kind.__name__})" for key, kind in (keys or STATE_KEYS).items()
             if not isinstance(state.get(key), kind)]
    if wrong:
        return f"training_state.pt lacks {', '.join(wrong)}"
    weights = list(folder.glob("*.safetensors"))
    if not weights or any(w.stat().st_size == 0 for w in weights):
        return "its weights (*.safetensors) are missing or empty"
    return next(filter(None, map(safetensors_problem, weights)), None)  # a header cut short, say

def check_weight_names(folder, saved, expected):
    """Refuse weights whose names are not exactly the model's trainable ones (a missing tensor would be left as it
    is, the base model's or a fresh LoRA's, in silence), or whose shapes are not (a size mismatch deep in torch)."""
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise InputError(f"--resume {folder}: its weights do not match this model: {len(missing)} missing "
                         f"{missing[:3]}, {len(unexpected)} unexpected {unexpected[:3]}; resume the step before it, or "
                         "start a new run")
    shapes = [(name, tuple(saved[name].shape), tuple(expected[name].shape)) for name in sorted(saved)
              if saved[name].shape != expected[name].shape]
    if shapes:
        name, there, here = shapes[0]
        raise InputError(f"--resume {folder}: its weights do not fit this model: {name} is {list(there)} in the "
                         f"checkpoint, {list(here)} in the model ({len(shapes)} of {len(saved)} tensors differ): it was "
                         "trained on another model or LoRA rank; load it with that one")

def load_state_file(folder):
    """training_state.pt as plain data and tensors (weights_only): a pickled object in it could run any code."""
    try:
        return torch.load(folder / "training_state.pt", weights_only=True)
    except pickle.UnpicklingError as e:
        raise InputError(f"--resume {folder}: training_state.pt holds more than tensors and plain data, so it is not "
                         f"loaded (it could run code): {str(e).splitlines()[0][:200]}")
    except (OSError, RuntimeError, EOFError, ValueError) as e:  # cut short, or not a torch file at all
        raise InputError(f"--resume {folder}: training_state.pt is damaged ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]})")

def resume(folder, model, optimizer, scheduler):
    """(step, data position) of the checkpoint in folder, its weights, optimizer, schedule and random state restored;
    (0, (0, 0)) without one."""
    if folder is None:
        return 0, (0, 0)
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    if hasattr(model, "peft_config"):
        weights = load_file(folder / "adapter_model.safetensors")
        check_weight_names(folder, weights, get_peft_model_state_dict(model))
        set_peft_model_state_dict(model, weights)
    else:
        weights = {}
        for file in folder.glob("*.safetensors"):
            weights.update(load_file(file))
        check_weight_names(folder, weights, dict(model.named_parameters()))  # tied weights once, as saved
        model.load_state_dict(weights, strict=False)  # buffers are not saved: they keep the model's own
    state = load_state_file(folder)
    rates = [group["initial_lr"] for group in optimizer.param_groups]  # this run's --lr, before the checkpoint's
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    apply_learning_rate(optimizer, scheduler, rates, state)
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    say(f"resumed from {folder} at step {state['step']}", sys.stdout)
    return state["step"], tuple(state["data_position"])

def apply_learning_rate(optimizer, scheduler, rates, state):
    """After a checkpoint's optimizer and schedule are loaded (they hold its --lr), put this run's rates back, at the
    schedule's step; its lambda, and so --warmup-steps, is this run's already (LambdaLR saves no lambda)."""
    scheduler.base_lrs = list(rates)
    scheduler._last_lr = [rate * factor(scheduler.last_epoch) for rate, factor in zip(rates, scheduler.lr_lambdas)]
    for group, rate, now in zip(optimizer.param_groups, rates, scheduler._last_lr):
        group["initial_lr"], group["lr"] = rate, now
    before = state.get("args", {}).get("lr", rates[0])
    if before != rates[0]:
        print(f"--lr {rates[0]:g} from here on (the checkpoint's run had {before:g})")
