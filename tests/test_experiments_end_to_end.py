"""Each train.py as a user runs it: a fresh process, the tiny model in 4-bit on CPU."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (EXPERIMENTS, ROOT, TASK_EXPERIMENTS, earlier_cpu_defaults, hang_guard, help_text, load_experiment,
                      run_main, run_script, seven_reward, tensorboard_scalars, write_jsonl)

LOGGED = {
    "rollout/reward_mean", "rollout/reward_std", "rollout/reward_min", "rollout/reward_max", "rollout/format_rate",
    "rollout/accuracy", "rollout/completion_length", "rollout/zero_spread_groups", "rollout/completions_with_signal",
    "rollout/tokens_with_signal", "train/loss", "train/kl",
    "train/grad_norm", "train/lr", "train/entropy", "train/clip_fraction", "perf/step_seconds",
    "perf/tokens_per_second", "perf/memory_gb", "eval/accuracy", "eval/format_rate",
}


@pytest.fixture
def tasks(tmp_path):
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(20)]
    return write_jsonl(tmp_path / "tasks.jsonl", rows)


def tiny_args(model_dir, tasks, tmp_path, *extra):
    return ["--model-name", model_dir, "--device", "cpu", "--quantization", "4bit", "--dtype", "float32",
            "--data-path", tasks, "--eval-data-path", tasks, "--eval-prompts", "4", "--group-size", "4",
            "--rollouts-per-step", "2", "--max-length", "12", "--lr", "1e-2", "--run-name", "e2e",
            "--log-dir", tmp_path / "runs", "--checkpoint-path", tmp_path / "out", *extra]


def adapter(tmp_path, step):
    return load_file(tmp_path / "out" / "e2e" / f"step_{step:06d}" / "adapter_model.safetensors")


def tensorboard_texts(log_dir):
    """The text tags (sample completions) in the event files under log_dir."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in Path(log_dir).rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events), size_guidance={"tensors": 0})
        accumulator.Reload()
        tags.update(accumulator.Tags()["tensors"])
    return tags


@pytest.mark.parametrize("name", TASK_EXPERIMENTS)
def test_two_steps_then_resume(name, tiny_model_dir, tasks, tmp_path, capsys):
    """`python train.py` for two steps, then a resume in this process (main(argv), the same code after the
    interpreter starts: one fresh interpreter a copy is enough, each costs seconds of imports)."""
    script = ROOT / name / "train.py"
    pinned = earlier_cpu_defaults(load_experiment(name))  # a KL term, every reward term: what the tags need
    first = run_script(script, *tiny_args(tiny_model_dir, tasks, tmp_path, "--max-steps", "2", "--eval-interval", "1",
                                          "--log-completions-interval", "1", *pinned))
    assert first.returncode == 0, first.stderr[-3000:]
    # a clean first screen: peft's FutureWarning (is_gradient_checkpointing) and bitsandbytes' notice that it found no
    # hub kernel (AVX512-BF16 CPUs) were printed at every start
    assert "Warning" not in first.stderr and "kernels-community" not in first.stderr, first.stderr[-3000:]
    # the closing line says what the run did to held-out accuracy (issue 61)
    assert re.search(r"held-out accuracy \d+% at step 0 -> \d+% at step 2 \(4 problems, greedy\)", first.stdout), first.stdout
    scalars = tensorboard_scalars(tmp_path / "runs" / "e2e")
    # experiment_drgrpo's default, Dr.GRPO, has beta = 0: no reference pass, so no KL is measured or logged
    expected = LOGGED - {"train/kl"} if name == "experiment_drgrpo" else LOGGED
    assert expected <= set(scalars), f"missing tags: {expected - set(scalars)}"
    assert ("train/kl" in scalars) == (name != "experiment_drgrpo")
    assert sorted(step for step, _ in scalars["train/loss"]) == [1, 2]
    assert sorted(step for step, _ in scalars["eval/accuracy"]) == [0, 1, 2]  # before training, then every step
    assert "rollout/completions/text_summary" in tensorboard_texts(tmp_path / "runs" / "e2e")  # sample completions
    checkpoint = tmp_path / "out" / "e2e" / "step_000002"
    assert (checkpoint / "adapter_model.safetensors").is_file() and (checkpoint / "training_state.pt").is_file()
    assert not list((tmp_path / "out" / "e2e").glob("*.partial"))

    load_experiment(name).main(list(map(str, tiny_args(tiny_model_dir, tasks, tmp_path, "--max-steps", "3",
                                                        "--eval-interval", "0", "--resume", tmp_path / "out" / "e2e",
                                                        *pinned))))
    resumed = capsys.readouterr().out
    assert "resumed from" in resumed and "at step 2" in resumed
    # its closing line gives the whole run's held-out accuracy, from the first start's step 0 (it evaluates nothing)
    curve = re.search(r"held-out accuracy \d+% at step 0 -> \d+% at step 2", first.stdout)[0]
    assert "done: 3 steps; checkpoint in" in resumed and curve in resumed, resumed
    scalars = tensorboard_scalars(tmp_path / "runs" / "e2e")
    assert sorted(step for step, _ in scalars["train/loss"]) == [1, 2, 3]
    state = torch.load(tmp_path / "out" / "e2e" / "step_000003" / "training_state.pt", weights_only=False)
    assert state["step"] == 3 and state["data_position"] == [0, 6]  # 3 steps x 2 prompts into the first pass
    assert [step for step, _ in state["held_out"]] == [0, 1, 2]  # the evaluations so far, for the next resume


def test_resume_reproduces_an_uninterrupted_run(task_experiment, tiny_model_dir, tasks, tmp_path, monkeypatch):
    """4 steps in one go and 2 + 2 with a resume in between end with the same weights: the checkpoint
    holds everything that matters (weights, optimizer, RNG, data position), and a resumed step draws the same
    shuffled mini-batches (two updates a step here)."""
    monkeypatch.setattr(task_experiment, "reward_terms", seven_reward)  # a reward that varies, so weights move
    straight, split = tmp_path / "straight", tmp_path / "split"
    updates = {"experiment_accelerate": ["--train-batch-size", "4", "--gradient-accumulation-steps", "1"],
               "experiment_accelerate_ddp": ["--epochs-per-step", "2"]}  # no --updates-per-step in these two
    common = ["--max-steps", "4", "--eval-interval", "0", "--checkpoint-interval", "2", "--keep-checkpoints", "0",
              *updates.get(task_experiment.EXPERIMENT, ["--updates-per-step", "2"])]
    task_experiment.main(list(map(str, tiny_args(tiny_model_dir, tasks, straight, *common))))
    task_experiment.main(list(map(str, tiny_args(tiny_model_dir, tasks, split, *common[:1], "2", *common[2:]))))
    task_experiment.main(list(map(str, tiny_args(tiny_model_dir, tasks, split, *common, "--resume", split / "out" / "e2e"))))
    a, b = adapter(straight, 4), adapter(split, 4)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], adapter(straight, 2)[k]) for k in a)  # and training did change them


def test_ctrl_c_saves_a_checkpoint(tiny_model_dir, tasks, tmp_path):
    script = ROOT / "experiment_base" / "train.py"
    args = tiny_args(tiny_model_dir, tasks, tmp_path, "--max-steps", "100000", "--eval-interval", "0",
                     "--checkpoint-interval", "0")  # no periodic checkpoints: only Ctrl-C can write one
    process = subprocess.Popen([sys.executable, str(script), *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    deadline = time.time() + 120
    while time.time() < deadline and len(tensorboard_scalars(tmp_path / "runs").get("train/loss", [])) < 2:
        time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    try:
        stdout, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # once in a CI run it printed "interrupted: saving step 4" and went no further
        process.send_signal(signal.SIGABRT)  # faulthandler (PYTHONFAULTHANDLER) writes every thread's stack to stderr
        with hang_guard("the interrupted run, after SIGABRT (a process it started holds its output open?)", 30):
            _, stderr = process.communicate(timeout=30)
        pytest.fail(f"the interrupted run did not exit within 120 s; where each thread was:\n{stderr[-8000:]}")
    assert process.returncode == 130, stderr[-3000:]
    steps = sorted((tmp_path / "out" / "e2e").glob("step_*[0-9]"))
    assert len(steps) == 1 and int(steps[0].name.split("_")[1]) >= 2
    assert "interrupted: saving step" in stderr


@pytest.mark.parametrize("name", TASK_EXPERIMENTS)
def test_ctrl_c_during_the_first_evaluation_saves_nothing_and_blocks_nothing(name, tiny_model_dir, tasks, tmp_path,
                                                                              monkeypatch, capsys):
    """Ctrl-C raises KeyboardInterrupt wherever the run is outside an update: in the step-0 evaluation too, which
    runs before the first step. The run exits with 130 and writes no checkpoint of zero steps (one was written, and
    it blocked the run name: the same command again was refused); the same command then starts the run."""
    module = load_experiment(name)
    real_evaluate = module.evaluate

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt("SIGINT")

    monkeypatch.setattr(module, "evaluate", interrupted)
    argv = [str(a) for a in tiny_args(tiny_model_dir, tasks, tmp_path, "--max-steps", "1", "--eval-interval", "1")]
    with pytest.raises(SystemExit) as stop:
        module.main(argv)
    assert stop.value.code == 130
    assert "before the first step; nothing to save" in capsys.readouterr().err
    assert list((tmp_path / "out" / "e2e").iterdir()) == []
    monkeypatch.setattr(module, "evaluate", real_evaluate)
    module.main(argv)  # the same command, not refused
    assert [p.name for p in (tmp_path / "out" / "e2e").iterdir()] == ["step_000001"]


@pytest.mark.parametrize("name", TASK_EXPERIMENTS)
def test_help_lists_every_option_with_its_default(name):
    text = " ".join(help_text(name).split())
    temperature = "0.8" if name == "experiment_drgrpo" else "0.35"  # its algorithms were measured at 0.8
    weights = "format=0,reasoning=0" if name == "experiment_drgrpo" else "format=0.1,reasoning=0"  # and without it
    for option in ["--model-name", "--data-path", "--max-prompts", "--group-size", "--rollouts-per-step",
                   "--train-batch-size", "--epochs-per-step", "--lr", "--kl-weight", "--clip-eps", "--temperature",
                   "--top-p", "--max-length", "--max-steps", "--seed", "--device", "--quantization", "--no-lora",
                   "--lora-r", "--lora-alpha", "--checkpoint-path", "--checkpoint-interval", "--resume",
                   "--eval-interval", "--eval-prompts", "--log-dir", "--run-name", "--wandb", "--wandb-project",
                   "--log-completions-interval"]:
        assert option in text, option
    for default in ["(default: 16 on CUDA, 8 on CPU)", "(default: math on CUDA, sequence on CPU)", "(default: runs)",
                    "(default: 0.2)", "(default: 42)", f"(default: 1.0 on CUDA, {temperature} on CPU)",
                    f"(default: none on CUDA, {weights} on CPU)"]:
        assert default in text, default


def test_the_cpu_default_task_is_sequence(task_experiment):
    """On CPU the packaged Gemma-3-270M learns --task sequence (README, "Does it learn?"); --task still chooses."""
    args = task_experiment.parse_args(["--device", "cpu"])
    assert (args.task, args.data_path, args.eval_data_path) == ("sequence", "data/sequence.jsonl", "data/sequence_eval.jsonl")
    args = task_experiment.parse_args(["--device", "cpu", "--task", "math"])
    assert (args.task, args.data_path) == ("math", "data/math_tasks.jsonl")


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_help_gives_every_options_default(name):
    """Every option argparse lists (flags, and options whose default is none, included) states its default."""
    # an option's entry: its line, and the lines of its help that follow, up to the next option or heading
    entries = re.findall(r"^  (--?[a-z][^\n]*(?:\n(?! *-|\S)[^\n]*)*)", help_text(name), re.MULTILINE)
    assert len(entries) > 40
    assert not [entry.split()[0] for entry in entries if "default" not in entry and not entry.startswith("-h")]


def test_wandb_offline(tiny_model_dir, tasks, tmp_path, monkeypatch):
    """--wandb without an account or a network (WANDB_MODE=offline): the same metrics also go to a local W&B run,
    in the run's own log folder. It wrote ./wandb/ where the run was started, outside --log-dir, and took --run-name
    as its id: two runs of one name under other --checkpoint-paths would have merged on sync."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    started_in = tmp_path / "started-here"
    started_in.mkdir()
    ids = []
    for root in ("out", "other-out"):
        result = run_script(ROOT / "experiment_base" / "train.py",
                            *tiny_args(tiny_model_dir, tasks, tmp_path, "--max-steps", "1", "--eval-interval", "0",
                                       "--wandb", "--wandb-project", "smoke", "--checkpoint-path", tmp_path / root,
                                       "--log-dir", tmp_path / root / "runs"), cwd=started_in)
        assert result.returncode == 0, result.stderr[-3000:]
        runs = list((tmp_path / root / "runs").glob("*/wandb/offline-run-*/run-*.wandb"))
        assert len(runs) == 1, list(tmp_path.rglob("*"))
        log = runs[0].read_bytes()
        assert b"rollout/reward_mean" in log and b"train/loss" in log
        ids.append(runs[0].stem.removeprefix("run-"))
    assert list(started_in.iterdir()) == []  # nothing written where the run was started
    assert ids[0] != ids[1]  # one W&B run per run folder


def test_each_phase_logs_its_own_memory_peak(tiny_model_dir, tasks, tmp_path, monkeypatch):
    """perf/memory_gb was the run's running peak alone (issue 62): a phase's peak could not be told from an earlier
    one's. Each step now logs its sampling and training phases' own peaks, reset at each phase's start (on a CPU the
    process's resident peak, VmHWM). A rollout that briefly holds 400 MB more shows in the sampling peak of every
    step, and not in the training peak that follows it; the run's peak stays above both."""
    module = load_experiment("experiment_base")
    rollout = module.rollout

    def heavy_rollout(*args, **kwargs):
        block = torch.ones(100 * 2**20)  # 400 MB, written
        block.add_(1)
        del block
        return rollout(*args, **kwargs)

    monkeypatch.setattr(module, "rollout", heavy_rollout)
    module.main(list(map(str, tiny_args(tiny_model_dir, tasks, tmp_path, "--max-steps", "2", "--eval-interval", "0",
                                        "--quantization", "none"))))
    scalars = {tag: dict(values) for tag, values in tensorboard_scalars(tmp_path / "runs" / "e2e").items()}
    for step in (1, 2):
        sampling, training = scalars["perf/sampling_peak_gb"][step], scalars["perf/training_peak_gb"][step]
        assert sampling - training > 0.3, (step, sampling, training)
        assert scalars["perf/memory_gb"][step] >= sampling


def test_cuda_memory_is_mapped_in_pages_unless_the_user_says_otherwise():
    """Importing a train.py asks PyTorch's allocator for expandable segments (a CUDA run's reserved peak then stays
    near its allocated one, #62), before any CUDA allocation; a user's own PYTORCH_ALLOC_CONF or
    PYTORCH_CUDA_ALLOC_CONF stands. Every copy, in one process each way."""
    program = ("import os, sys; sys.path.insert(0, 'tests'); from conftest import EXPERIMENTS, load_experiment\n"
               "for name in EXPERIMENTS:\n    load_experiment(name)\n"
               "print(os.environ.get('PYTORCH_ALLOC_CONF'), os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))")
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    def run(**env):
        done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env={**clean, **env}, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()[-2:]

    assert run() == ["expandable_segments:True", "None"]
    assert run(PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:128") == ["None", "max_split_size_mb:128"]
    assert run(PYTORCH_ALLOC_CONF="garbage_collection_threshold:0.8") == ["garbage_collection_threshold:0.8", "None"]


@pytest.mark.parametrize("name, extra", [("experiment_base", ()), ("experiment_multiturn_qa", ("--retriever", "bm25"))])
def test_the_default_data_is_found_from_any_working_directory(name, extra, tiny_model_dir, tmp_path):
    """`python experiment_x/train.py` from a folder outside the repository: the task's data files, the held-out ones
    and the QA corpus are the repository's (they were looked up under the working directory: 'data/sequence.jsonl:
    no such file'), and what the run writes goes under the working directory. (Its main() in this process, started
    from there: the paths are resolved as a fresh process resolves them, without 10 s of imports.)"""
    run_main(name, ["--model-name", tiny_model_dir, "--device", "cpu", "--dtype", "float32", "--group-size", "2",
                    "--rollouts-per-step", "2", "--max-length", "8", "--max-steps", "1", "--eval-prompts", "2",
                    "--run-name", "elsewhere", *extra], tmp_path)
    assert (tmp_path / "output" / "elsewhere" / "step_000001").is_dir() and (tmp_path / "runs" / "elsewhere").is_dir()
