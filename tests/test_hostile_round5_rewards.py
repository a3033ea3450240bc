"""Nothing lost, round five (issue 75), items 2, 13, 14 and 18: a --reward-fn's process, what it starts, prints and
imports. Each test failed on the code before its fix."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, hang_guard, run_script, write_jsonl
from test_hostile_round4_inputs import run_args
import tiny_grpo.errors
import tiny_grpo.rewards

BASE = ROOT / "experiment_base" / "train.py"


@pytest.fixture
def beside(tmp_path, monkeypatch):
    """Write a reward module into tmp_path, where the run starts (load_reward_fn finds it there); returns its name."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_reward_fn appends the working directory
    names = []

    def write(name, text):
        (tmp_path / f"{name}.py").write_text(text)
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


def running(pid):
    """Whether process pid runs: not gone, nor a zombie (dead, waiting for whoever adopted it to collect it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def ends(pid, seconds=30):
    """Whether process pid has stopped running within `seconds` (a guard: a SIGKILL takes effect at once)."""
    deadline = time.monotonic() + seconds
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running(pid)


def killed_if_left(pid_file):
    """Kill the process whose pid the reward wrote, should a test fail with it still running."""
    if pid_file.exists() and running(int(pid_file.read_text())):
        os.kill(int(pid_file.read_text()), signal.SIGKILL)


# ---- item 2: a process the function starts outlives the deadline, a failure and the run ----

STARTS_A_CHILD = """import pathlib, subprocess, time

def reward(completion, answer, metadata):
    if not pathlib.Path("child.pid").exists():  # one child, started by the first call
        child = subprocess.Popen(["sleep", "4242"])
        pathlib.Path("child.pid").write_text(str(child.pid))
    {then}
"""


@pytest.mark.parametrize("then, says", [("time.sleep(3600)", "TimeoutError: no result within 1.0 s"),
                                        ("raise ValueError('no score')", "ValueError: no score")],
                         ids=["past-its-deadline", "raising"])
def test_a_process_the_reward_fn_started_ends_with_its_call(then, says, beside, tmp_path):
    """A function that runs generated code in a subprocess (`sleep 4242` here) was stopped at its deadline, or failed,
    but only its worker was killed: `sleep` ran on, re-parented to init. Its whole process group is killed now."""
    name = beside("spawner", STARTS_A_CHILD.format(then=then))
    function = tiny_grpo.rewards.load_reward_fn(f"{name}:reward", timeout=1.0)
    try:
        with pytest.raises(tiny_grpo.errors.RewardError, match=says):
            function("c", "a", {})
        assert ends(int((tmp_path / "child.pid").read_text()))
    finally:
        killed_if_left(tmp_path / "child.pid")


@pytest.mark.parametrize("how", ["ends", "sigterm"])
def test_a_process_the_reward_fn_started_ends_with_the_run(how, tiny_model_dir, tmp_path):
    """A run that ends, or is stopped by SIGTERM while its reward runs: the `sleep 4242` the function started (and
    left running, returning normally or sleeping) is gone after the run's end."""
    then = "return 0.5" if how == "ends" else "pathlib.Path('scoring').touch()\n    time.sleep(3600)"
    (tmp_path / "spawner.py").write_text(STARTS_A_CHILD.format(then=then))
    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"Say {i}", "answer": "7"} for i in range(8)])
    argv = run_args(tiny_model_dir, data, tmp_path, "--run-name", "r", "--reward-fn", "spawner:reward")
    said = tmp_path / "said.txt"  # a file, not a pipe: a child left running would hold a pipe open, the test waiting
    try:
        with open(said, "w") as output:
            process = subprocess.Popen([sys.executable, BASE, *map(str, argv)], cwd=tmp_path, stdout=output,
                                       stderr=output)
        if how == "sigterm":
            deadline = time.monotonic() + 600  # a guard against a hang
            while not (tmp_path / "scoring").exists() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            process.send_signal(signal.SIGTERM)
        with hang_guard(f"a run that {how}", 600):
            process.wait(timeout=600)
        assert process.returncode == (0 if how == "ends" else 130), said.read_text()[-3000:]
        assert ends(int((tmp_path / "child.pid").read_text()))
    finally:
        killed_if_left(tmp_path / "child.pid")


# ---- item 13: a printing --reward-fn, the run's output piped into head ----

def test_a_printing_reward_fn_survives_a_closed_output_pipe(tiny_model_dir, tmp_path):
    """`train.py | head -n 1` with a reward that prints (flushed, as print debugging in a pipe must be): the run's
    own output survived the closed pipe, the function's print raised BrokenPipeError and the run stopped with 'the
    reward failed'. What the function prints is seen while the pipe is open, and dropped once it is closed."""
    (tmp_path / "chatty.py").write_text("def reward(completion, answer, metadata):\n"
                                        "    print('scoring', repr(completion), flush=True)\n    return 0.5\n")
    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"Say {i}", "answer": "7"} for i in range(8)])
    argv = run_args(tiny_model_dir, data, tmp_path, "--run-name", "r", "--reward-fn", "chatty:reward", steps=3)
    run = subprocess.Popen([sys.executable, BASE, *map(str, argv)], cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    head = subprocess.Popen(["head", "-n", "1"], stdin=run.stdout, stdout=subprocess.PIPE)
    run.stdout.close()  # head alone reads the run's output: once it has its line, the pipe is closed
    with hang_guard("a run piped into head", 600):
        shown, _ = head.communicate(timeout=600)
        _, said = run.communicate(timeout=600)
    assert shown.startswith(b"scoring ")  # the function's print, seen while the pipe was open
    assert run.returncode == 0 and b"reward failed" not in said, said.decode()[-3000:]
    assert sorted(p.name for p in (tmp_path / "out" / "r").iterdir()) == ["step_000003"]


# ---- item 14: a reward module whose import never ends ----

def test_a_reward_module_whose_import_never_ends_is_named_then_bounded(beside, monkeypatch, capsys):
    """A module whose top level never returns (a server started at import, a loop) held the run with no output and
    no bound. After a few seconds one line says what is being imported; past the bound, one line names the module
    and the option, and the worker is gone."""
    monkeypatch.setattr(tiny_grpo.rewards, "NOTICE_SECONDS", 0.5)
    monkeypatch.setattr(tiny_grpo.rewards, "IMPORT_SECONDS", 3)
    name = beside("never_done", "import time\n\ntime.sleep(10**6)\n\ndef reward(completion, answer, metadata):\n"
                                "    return 1.0\n")
    started = time.monotonic()
    with pytest.raises(tiny_grpo.errors.InputError) as error:
        tiny_grpo.rewards.load_reward_fn(f"{name}:reward", timeout=1.0)
    assert time.monotonic() - started < 60  # the bound held (a guard, not a timing: it is 3 s)
    said = str(error.value)
    assert said.startswith("--reward-fn never_done:reward: importing never_done took more than 3 s") and "\n" not in said
    notice = capsys.readouterr().err
    assert notice.count("\n") == 1 and "still importing never_done (--reward-fn never_done:reward)" in notice


def test_a_reward_fn_timeout_longer_than_the_import_bound_is_the_bound(beside, monkeypatch):
    """The import may take as long as one call may (--reward-fn-timeout), when that is longer than IMPORT_SECONDS."""
    monkeypatch.setattr(tiny_grpo.rewards, "NOTICE_SECONDS", 0.5)
    monkeypatch.setattr(tiny_grpo.rewards, "IMPORT_SECONDS", 0.5)
    name = beside("slow_import", "import time\n\ntime.sleep(2)\n\ndef reward(completion, answer, metadata):\n"
                                 "    return 1.0\n")
    assert tiny_grpo.rewards.load_reward_fn(f"{name}:reward", timeout=30)("c", "a", {}) == 1.0


# ---- item 18: a reward file named like a standard-library module ----

@pytest.mark.parametrize("name", ["gc", "json"])
def test_a_reward_file_named_like_a_standard_module_is_told_to_be_renamed(name, beside, tmp_path):
    """A gc.py (a module built into Python) or a json.py (one of its library's files) beside the run was reported as
    having no function: the standard library's module had been imported instead. The line says so."""
    beside(name, "def reward(completion, answer, metadata):\n    return 1.0\n")
    with pytest.raises(tiny_grpo.errors.InputError) as error:
        tiny_grpo.rewards.load_reward_fn(f"{name}:reward")
    assert str(error.value) == (f"--reward-fn {name}:reward: {name} is the standard library's module, imported instead "
                                f"of your {tmp_path / name}.py: rename that file")
