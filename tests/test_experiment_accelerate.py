"""experiment_accelerate: gradient accumulation through accelerate equals one pass over the same data;
`python` and `accelerate launch` both run it; save_state / load_state checkpoints resume at the right step."""

import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import (ROOT, assert_seeded_shuffles, four_sequences, load_experiment, rows_per_pass, run_command, run_script,
                      tensorboard_scalars, write_jsonl)
SCRIPT = ROOT / "experiment_accelerate" / "train.py"


@pytest.fixture
def tasks(tmp_path):
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(20)]
    return write_jsonl(tmp_path / "tasks.jsonl", rows)


def length_reward(completion, answer, *args, **kwargs):
    """Reward terms that vary within a group: the completion's length."""
    return {"correctness": len(completion) / 12, "format": 0.0, "reasoning": 0.0}


def tiny_args(model_dir, tasks, out, *extra):
    return [str(a) for a in ["--model-name", model_dir, "--device", "cpu", "--dtype", "float32", "--data-path", tasks,
                             "--eval-data-path", tasks, "--eval-prompts", "4", "--group-size", "4", "--rollouts-per-step", "2",
                             "--max-length", "12", "--lr", "1e-2", "--run-name", "acc", "--log-dir", out / "runs",
                             "--checkpoint-path", out / "out", *extra]]


def test_gradient_accumulation_equals_one_pass(tiny_model_dir, tasks, tmp_path, monkeypatch):
    """8 sequences a step: 2 micro-batches of 4 accumulated into one update give the loss, the gradient norm and the
    weights of one micro-batch of 8. With 2 epochs per step the logged loss includes the second epoch's, after the
    first update, so it depends on that update being right."""
    experiment = load_experiment("experiment_accelerate")
    monkeypatch.setattr(experiment, "reward_terms", length_reward)  # rewards that vary: a real gradient
    common = ["--quantization", "none", "--max-steps", "1", "--epochs-per-step", "2", "--kl-weight", "0.1",
              "--eval-interval", "0", "--log-completions-interval", "0"]
    runs = {"one_pass": ["--train-batch-size", "8"],
            "accumulated": ["--train-batch-size", "4", "--gradient-accumulation-steps", "2"],
            "two_updates": ["--train-batch-size", "4", "--gradient-accumulation-steps", "1"]}  # differs: a control
    results = {}
    for name, extra in runs.items():
        experiment.main(tiny_args(tiny_model_dir, tasks, tmp_path / name, *common, *extra))
        scalars = tensorboard_scalars(tmp_path / name / "runs")
        adapter = load_file(tmp_path / name / "out" / "acc" / "step_000001" / "adapter_model.safetensors")
        results[name] = (scalars["train/loss"][0][1], scalars["train/grad_norm"][0][1], adapter, scalars["rollout/reward_std"][0][1])

    loss, grad_norm, adapter, reward_std = results["one_pass"]
    assert reward_std > 0 and grad_norm > 0 and abs(loss) > 1e-4  # something to get right
    assert results["accumulated"][0] == pytest.approx(loss, rel=1e-4, abs=1e-6)
    assert results["accumulated"][1] == pytest.approx(grad_norm, rel=1e-4)
    # the weights: Adam divides by sqrt(v), which turns the last-bit differences of summing in another order into
    # ~1e-3 on weights whose gradient is ~1e-8 (measured 1.6e-3 over all weights); two updates move them by ~3
    distance = lambda a, b: sum(((a[k] - b[k]) ** 2).sum() for k in b).sqrt().item()  # noqa: E731
    assert distance(results["accumulated"][2], adapter) < 0.01 * distance(results["two_updates"][2], adapter)
    assert results["two_updates"][0] != pytest.approx(loss, rel=1e-3)


def test_python_and_accelerate_launch_then_resume(tiny_model_dir, tasks, tmp_path):
    """Two 4-bit steps under `accelerate launch` with the folder's single-GPU config (on this CPU: one CPU process)
    and bf16 autocast, then `python train.py --resume`: it continues at step 3 from accelerate's saved state."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ROOT / "experiment_accelerate" / "single_gpu.yaml",
              SCRIPT, *tiny_args(tiny_model_dir, tasks, tmp_path, "--quantization", "4bit", "--max-steps", "2",
                                 "--eval-interval", "2", "--mixed-precision", "bf16")]
    first = run_command(launch)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoint = tmp_path / "out" / "acc" / "step_000002"
    state_dir = checkpoint / "accelerate_state"
    for name in ["model.safetensors", "optimizer.bin", "random_states_0.pkl"]:
        assert (state_dir / name).is_file(), name
    assert not list(state_dir.glob("custom_checkpoint_*"))  # the schedule is in training_state.pt: nothing to unpickle
    saved = load_file(state_dir / "model.safetensors")
    assert saved and all(".lora_" in name for name in saved)  # trainable weights only: no frozen 4-bit base model
    assert (checkpoint / "adapter_model.safetensors").is_file() and (checkpoint / "training_state.pt").is_file()

    resumed = run_script(SCRIPT, *tiny_args(tiny_model_dir, tasks, tmp_path, "--quantization", "4bit", "--max-steps", "3",
                                            "--eval-interval", "0", "--resume", tmp_path / "out" / "acc"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint} at step 2" in resumed.stdout
    assert sorted(step for step, _ in tensorboard_scalars(tmp_path / "runs" / "acc")["train/loss"]) == [1, 2, 3]
    state = torch.load(tmp_path / "out" / "acc" / "step_000003" / "training_state.pt", weights_only=False)
    assert state["step"] == 3 and state["data_position"] == [0, 6]
    # the optimizer went on from the saved one: its step count is 3, not 1
    optimizer = torch.load(tmp_path / "out" / "acc" / "step_000003" / "accelerate_state" / "optimizer.bin", weights_only=False)
    assert {float(s["step"]) for s in optimizer["state"].values()} == {3.0}


def test_accumulation_steps_must_divide_the_micro_batches(capsys):
    experiment = load_experiment("experiment_accelerate")
    with pytest.raises(SystemExit):
        experiment.parse_args(["--device", "cpu", "--rollouts-per-step", "3", "--group-size", "4", "--train-batch-size", "4",
                               "--gradient-accumulation-steps", "2"])
    assert "--gradient-accumulation-steps must divide the 3 micro-batches of a step" in capsys.readouterr().err


def test_refuses_several_processes(tiny_model_dir, tasks, tmp_path):
    """Every process would sample the same prompts: it says to use experiment_accelerate_ddp instead."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--main_process_port", port, SCRIPT, *tiny_args(tiny_model_dir, tasks, tmp_path, "--max-steps", "1")]
    result = run_command(launch, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    assert "experiment_accelerate trains in one process, not 2" in result.stderr + result.stdout


def test_mini_batches_are_a_seeded_shuffle_each_pass(tiny_model_dir, monkeypatch):
    """The shared test of the same name, for this copy (whose train_step takes the accelerator): each pass splits a
    new shuffle of the rollout, seeded by --seed, the step and the pass, into mini-batches of K micro-batches, one
    optimizer update each, accelerate's count ending each update."""
    from accelerate import Accelerator

    experiment = load_experiment("experiment_accelerate")
    args = experiment.parse_args(["--model-name", str(tiny_model_dir), "--device", "cpu", "--quantization", "none",
                                  "--dtype", "float32", "--group-size", "2", "--rollouts-per-step", "2", "--lr", "1e-2",
                                  "--train-batch-size", "1", "--gradient-accumulation-steps", "2", "--epochs-per-step", "3"])
    torch.manual_seed(0)
    model, _ = experiment.load_model(args)
    optimizer = experiment.make_optimizer(model, args)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.gradient_accumulation_steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = four_sequences()

    def passes(step):  # the rows each forward pass with gradients took, and the updates made, as 3 passes of 4 rows
        model.train()
        train = lambda: experiment.train_step(model, batch, args, optimizer, scheduler, accelerator, step=step)  # noqa: E731
        rows, updates = rows_per_pass(experiment, batch[0], train, optimizer)
        assert updates == [2, 4, 6, 8, 10, 12]  # an update after every K = 2 micro-batches of one sequence
        return rows

    assert_seeded_shuffles(passes(7), passes(7), passes(8))
    assert scheduler.last_epoch == 18
