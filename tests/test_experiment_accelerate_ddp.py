"""experiment_accelerate_ddp on two CPU processes (gloo), launched the way GPU users launch it.

The step's prompts split between the processes (3 prompts: 2 and 1, whole groups); DDP averages the LoRA
gradients so that both processes hold the same weights after each update, and that average is the gradient
of the mean over all the step's sequences; only the main process logs and writes the checkpoint; both
resume from it."""

import json
import os
import socket
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from conftest import (HANG_GUARD_SECONDS, ROOT, four_sequences, rows_per_pass, run_command,
                      tensorboard_scalars, write_jsonl)

SCRIPT = ROOT / "experiment_accelerate_ddp" / "train.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # two processes on two cores: one thread each


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args, cwd, timeout=HANG_GUARD_SECONDS):
    """`accelerate launch` with the folder's multi-GPU config: two processes, on gloo here (no CUDA)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ROOT / "experiment_accelerate_ddp" / "multi_gpu.yaml",
               "--num_processes", "2", "--main_process_port", free_port(), SCRIPT, *args]
    return run_command(command, timeout, cwd, ENV)


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory):
    """Two 4-bit steps on two processes, 3 prompts a step (2 + 1), with a reward that varies (completion length)."""
    folder = tmp_path_factory.mktemp("ddp")
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(20)]
    write_jsonl(folder / "tasks.jsonl", rows)
    (folder / "length_reward.py").write_text("def reward(completion, answer, metadata):\n    return len(completion) / 12\n")
    return folder


def ddp_args(model_dir, folder, *extra):
    return ["--model-name", model_dir, "--device", "cpu", "--quantization", "4bit", "--dtype", "float32",
            "--data-path", folder / "tasks.jsonl", "--eval-data-path", folder / "tasks.jsonl", "--eval-prompts", "2",
            "--group-size", "4", "--rollouts-per-step", "3", "--max-length", "10", "--lr", "1e-2", "--run-name", "ddp",
            "--reward-fn", "length_reward:reward", "--log-dir", folder / "runs", "--checkpoint-path", folder / "out",
            "--debug-ranks", "--log-completions-interval", "1", *extra]


def rank_lines(folder):
    """{rank: [one dict per step]} from --debug-ranks."""
    return {rank: [json.loads(line) for line in (folder / "runs" / "ddp" / f"rank_{rank}.jsonl").read_text().splitlines()]
            for rank in (0, 1)}


@pytest.fixture(scope="module")
def first_run(tiny_model_dir, run_dir):
    result = launch(*ddp_args(tiny_model_dir, run_dir, "--max-steps", "2", "--eval-interval", "2"), cwd=run_dir)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def test_two_processes_split_the_prompts_and_stay_in_sync(first_run, run_dir):
    lines = rank_lines(run_dir)
    assert [line["step"] for line in lines[0]] == [line["step"] for line in lines[1]] == [1, 2]
    for mine, theirs in zip(lines[0], lines[1]):
        # 3 prompts on 2 processes: the first takes one more; whole groups of 4 completions each
        assert mine["prompts"] == [0, 1] and theirs["prompts"] == [2]
        assert len(mine["rewards"]) == 8 and len(theirs["rewards"]) == 4
        assert not set(mine["questions"]) & set(theirs["questions"])  # different prompts
        assert len(set(mine["rewards"])) > 1 and len(set(theirs["rewards"])) > 1  # rewards spread: a real gradient
        # the same weights on both processes before and after each update, and the update changed them
        assert mine["weights_before"] == theirs["weights_before"] and mine["weights_after"] == theirs["weights_after"]
        assert mine["weights_after"] != mine["weights_before"]
    assert lines[0][1]["weights_before"] == lines[0][0]["weights_after"]

    # one set of TensorBoard events, from the main process, with the statistics of both processes' rollouts
    assert len(list((run_dir / "runs").rglob("events.out.tfevents.*"))) == 1
    scalars = tensorboard_scalars(run_dir / "runs" / "ddp")
    assert sorted(step for step, _ in scalars["train/loss"]) == [1, 2]
    assert sorted(step for step, _ in scalars["eval/accuracy"]) == [0, 2]
    for step, value in scalars["rollout/reward_mean"]:
        rewards = lines[0][step - 1]["rewards"] + lines[1][step - 1]["rewards"]
        assert value == pytest.approx(sum(rewards) / 12, rel=1e-5)
    assert all(value > 0 for _, value in scalars["train/grad_norm"])

    # one checkpoint: the adapter, the trainable weights, one RNG state per process
    steps = sorted(p.name for p in (run_dir / "out" / "ddp").iterdir())
    assert steps == ["step_000002"]
    state_dir = run_dir / "out" / "ddp" / "step_000002" / "accelerate_state"
    assert (state_dir / "random_states_0.pkl").is_file() and (state_dir / "random_states_1.pkl").is_file()
    saved = load_file(state_dir / "model.safetensors")
    assert saved and all(".lora_" in name and not name.startswith("module.") for name in saved)
    assert first_run.stdout.count("done: 2 steps") == 1  # only the main process reports


def test_resume_on_two_processes(first_run, tiny_model_dir, run_dir):
    result = launch(*ddp_args(tiny_model_dir, run_dir, "--max-steps", "3", "--eval-interval", "0",
                              "--resume", run_dir / "out" / "ddp"), cwd=run_dir)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("resumed from") == 1 and "step_000002 at step 2" in result.stdout  # the main process
    assert "held-out accuracy 0% at step 0 -> 0% at step 2" in result.stdout  # the first start's, kept in the checkpoint
    lines = rank_lines(run_dir)
    assert [line["step"] for line in lines[0]] == [line["step"] for line in lines[1]] == [1, 2, 3]
    for rank in (0, 1):  # both processes continued from the saved weights
        assert lines[rank][2]["weights_before"] == lines[rank][1]["weights_after"]
    assert lines[0][2]["weights_after"] == lines[1][2]["weights_after"]
    assert sorted(step for step, _ in tensorboard_scalars(run_dir / "runs" / "ddp")["train/loss"]) == [1, 2, 3]
    state = torch.load(run_dir / "out" / "ddp" / "step_000003" / "training_state.pt", weights_only=False)
    assert state["step"] == 3 and state["data_position"] == [0, 9]  # 3 steps x 3 prompts


GRADIENT_CHECK = textwrap.dedent('''
    """Run by torchrun on 2 processes: train_step's gradient must be the mean over both processes' sequences."""
    import importlib.util, json, sys
    from pathlib import Path
    import torch
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    spec = importlib.util.spec_from_file_location("ddp_train", sys.argv[1])
    ddp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ddp)
    args = ddp.parse_args(["--model-name", sys.argv[2], "--device", "cpu", "--quantization", "4bit", "--dtype", "float32",
                           "--lora-r", "4", "--kl-weight", "0.1", "--train-batch-size", "4", "--max-grad-norm", "1e9",
                           "--temperature", "1.0", "--reward-weights", ""])  # every reward term: gradients to check
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    torch.manual_seed(0)
    model, _ = ddp.load_model(args)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    with torch.no_grad():  # LoRA B starts at 0, which leaves A without gradient: give every adapter weight a value
        for _, p in trainable:
            p.normal_(std=0.1)

    # this process's share: 8 sequences on rank 0 (2 micro-batches of 4), 4 on rank 1 (one micro-batch)
    n, prompt, actions = (8, 4)[rank], 6, 5
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(10, 60, (n, prompt + actions), generator=g)
    attention = torch.ones_like(ids)
    attention[: n // 2, :2] = 0  # some left padding
    attention[1, -2:] = 0  # and a completion that ended early
    action_mask = attention[:, -actions:].clone()
    advantages = torch.randn(n, generator=g)
    total = 12

    # expected: the gradient of the mean loss over all 12 sequences, from each process's summed per-sequence loss
    with torch.no_grad(), model.disable_adapter():
        ref = ddp.sequence_log_probs(model, ids, attention, actions)[0]
    log_probs, _ = ddp.sequence_log_probs(model, ids, attention, actions)
    loss, _ = ddp.grpo_loss(log_probs, log_probs.detach(), advantages, action_mask, 0.2, ref, args.kl_weight)
    (loss * n).backward()
    local = [p.grad.clone() for _, p in trainable]
    model.zero_grad(set_to_none=True)
    everyone = gather_object([(n, local)])
    expected = [sum(part[1][i] for part in everyone) / total for i in range(len(local))]
    naive = [sum(part[1][i] / part[0] for part in everyone) / 2 for i in range(len(local))]  # mean of per-process means

    optimizer = torch.optim.SGD([p for _, p in trainable], lr=0.0)
    policy, optimizer = accelerator.prepare(ddp.PolicyLogProbs(model), optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0)
    ddp.train_step(policy, (ids, attention, action_mask, advantages), args, optimizer, schedule, accelerator, total)
    synced = [p.grad for _, p in trainable]
    close = lambda a, b: all(((x - y).norm() / y.norm()).item() < 1e-4 for x, y in zip(a, b))  # relative to the norm
    frozen = [p for p in model.parameters() if not p.requires_grad]
    Path(f"result_{rank}.json").write_text(json.dumps({
        "rank": rank, "names_are_lora": all(".lora_" in name for name, _ in trainable), "trainable": len(trainable),
        "frozen_without_grad": all(p.grad is None for p in frozen), "frozen": len(frozen),
        "synced_is_mean": close(synced, expected), "synced_is_naive": close(synced, naive),
        "local_is_mean": close([x / n for x in local], expected),
        "nonzero": sum(bool(x.abs().sum() > 0) for x in synced),
    }))
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()  # gloo's threads stopped before the interpreter exits (an abort seen once)
''')


def test_gradients_are_the_mean_over_all_sequences(tiny_model_dir, tmp_path):
    """torchrun, 2 processes holding 8 and 4 sequences: after train_step each process's gradient of the LoRA weights
    equals the gradient of the mean loss over all 12 sequences (computed without DDP and gathered), not the naive
    mean of the two processes' means; the frozen 4-bit weights get no gradient."""
    helper = tmp_path / "gradient_check.py"
    helper.write_text(GRADIENT_CHECK)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(),
               helper, SCRIPT, tiny_model_dir]
    result = run_command(command, cwd=tmp_path, env=ENV)
    assert result.returncode == 0, result.stderr[-4000:]
    results = [json.loads((tmp_path / f"result_{rank}.json").read_text()) for rank in (0, 1)]
    for r in results:
        assert r["names_are_lora"] and r["trainable"] == 28 and r["frozen_without_grad"] and r["frozen"] > 0
        assert r["nonzero"] == r["trainable"]
        assert r["synced_is_mean"] and not r["synced_is_naive"] and not r["local_is_mean"]


def test_each_pass_is_a_seeded_shuffle_of_this_process_rows(tiny_model_dir, monkeypatch):
    """The shared test_mini_batches_are_a_seeded_shuffle_each_pass, for this copy (one process, in this one): each
    pass takes a new shuffle of the process's rows, seeded by --seed, the step and the pass, as its micro-batches, and
    makes one optimizer update (no --updates-per-step: every process makes the same updates, one all-reduce each)."""
    from accelerate import Accelerator

    from conftest import load_experiment

    ddp = load_experiment("experiment_accelerate_ddp")
    args = ddp.parse_args(["--model-name", str(tiny_model_dir), "--device", "cpu", "--quantization", "none",
                           "--dtype", "float32", "--group-size", "2", "--rollouts-per-step", "2", "--lr", "1e-2",
                           "--train-batch-size", "1", "--epochs-per-step", "3", "--kl-weight", "0.01"])
    torch.manual_seed(0)
    model, _ = ddp.load_model(args)
    optimizer = ddp.make_optimizer(model, args)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0)
    accelerator = Accelerator(cpu=True)
    policy, optimizer = accelerator.prepare(ddp.PolicyLogProbs(model), optimizer)
    batch = four_sequences()

    def passes(step):  # the rows each forward pass with gradients took, and the updates made, as 3 passes of 4 rows
        policy.train()
        stats = {}
        train = lambda: stats.update(ddp.train_step(policy, batch, args, optimizer, scheduler, accelerator, 4, step=step))  # noqa: E731
        rows, updates = rows_per_pass(ddp, batch[0], train, optimizer)
        assert updates == [4, 8, 12]  # one update a pass, after its 4 micro-batches of one sequence
        assert "kl" in stats  # measured: --kl-weight 0.01
        return rows

    first, again, later = passes(7), passes(7), passes(8)
    assert all(sorted(order) == [0, 1, 2, 3] for order in first + later)  # every sequence once a pass
    assert first == again  # the same step, the same order: a resume stays exact
    assert len(set(first + later)) > 1 and first != later  # a new shuffle per pass and per step
    assert scheduler.last_epoch == 9


def test_fewer_prompts_than_processes_is_an_error(tiny_model_dir, run_dir, tmp_path):
    result = launch(*ddp_args(tiny_model_dir, run_dir, "--rollouts-per-step", "1", "--max-steps", "1",
                              "--checkpoint-path", tmp_path), cwd=run_dir)
    assert result.returncode != 0
    assert "--rollouts-per-step 1 is fewer than the 2 processes" in result.stderr


def test_configs_hold_only_fields_accelerate_knows():
    """Every ready config loads in accelerate 1.15 (unknown top-level keys fail there), and every key of its
    deepspeed_config is an option of `accelerate launch` (unknown ones would be ignored silently). No FSDP config:
    train.py refuses FSDP (each process samples with the whole model), so none is shipped that could not run."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    launch_options = vars(launch_command_parser().parse_args(["script.py"]))
    expected = {"experiment_accelerate/single_gpu.yaml": "NO", "experiment_accelerate_ddp/multi_gpu.yaml": "MULTI_GPU",
                "experiment_accelerate_ddp/multi_node.yaml": "MULTI_GPU",
                "experiment_accelerate_ddp/zero2.yaml": "DEEPSPEED"}
    for path, distributed_type in expected.items():
        config = ClusterConfig.from_yaml_file(ROOT / path)
        assert config.distributed_type == distributed_type, path
        for section in (config.deepspeed_config or {},):
            unknown = [key for key in section if key not in launch_options]
            assert not unknown, (path, unknown)
    assert ClusterConfig.from_yaml_file(ROOT / "experiment_accelerate_ddp/multi_node.yaml").num_machines == 2
    assert not list((ROOT / "experiment_accelerate_ddp").glob("*fsdp*"))


# -- Nothing lost, round three (issue 59)


def test_a_stray_world_size_says_what_it_waits_for_and_stops_soon(tiny_model_dir, tmp_path):
    """WORLD_SIZE=2 left in the environment (after torchrun, or by a job script) made `python train.py` wait 30
    minutes without a word: the rendezvous waits for a second process that nobody starts. Now the run says at once
    what it waits for and that no launcher set it, and stops after --rendezvous-timeout with one line naming
    WORLD_SIZE; with no MASTER_ADDR it stops at once, naming it."""
    import subprocess
    import time

    from conftest import hang_guard

    def run(env):  # env as it is: run_command would add this process's environment back
        with hang_guard("train.py with a stray WORLD_SIZE", 90):
            return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=90)

    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)])
    args = ["--model-name", tiny_model_dir, "--device", "cpu", "--quantization", "none", "--dtype", "float32",
            "--data-path", data, "--group-size", "2", "--rollouts-per-step", "1", "--max-length", "4", "--max-steps", "1",
            "--eval-interval", "0", "--log-dir", tmp_path / "runs", "--checkpoint-path", tmp_path / "out",
            "--rendezvous-timeout", "5"]
    env = {key: value for key, value in ENV.items() if not key.startswith(("ACCELERATE_", "TORCHELASTIC_", "LOCAL_"))}
    stray = {**env, "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    started = time.monotonic()
    result = run(stray)
    assert time.monotonic() - started < 90
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    waiting = next(line for line in lines if line.startswith("waiting up to 5 s"))
    assert "WORLD_SIZE=2" in waiting and "no launcher" in waiting and "MASTER_PORT" in waiting
    assert lines[-1].startswith("error: ") and "WORLD_SIZE=2" in lines[-1] and "--rendezvous-timeout 5" in lines[-1]
    assert [line for line in lines if line.startswith("error")] == [lines[-1]]
    no_master = {key: value for key, value in stray.items() if key != "MASTER_ADDR"}
    result = run(no_master)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "WORLD_SIZE=2" in last and "MASTER_ADDR" in last
