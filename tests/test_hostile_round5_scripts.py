"""Nothing lost, round five (issue 75), items 6, 7, 10, 17, 19 and 20: the GPU scripts and evaluate.py. Without a GPU or
network here, a fake stands in only for those (a python that hides its packages, a pip download that fails or writes
small wheels, a part that sleeps); the files are real. Each test failed on the code before its fix."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile

import pytest

from conftest import ROOT, run_command

PYTHON = sys.executable


def gpu_results(folder):
    """What a GPU run brought back into folder: each part's JSON and the log, as {name: text}."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {"gpu_check.log": "part 1 (tests, 95 s): graph: 1 passed; rest: 180 passed\n",
             **{f"part{n}_{name}.json": json.dumps({"part": n, "status": "done", "device": "NVIDIA H200"})
                for n, name in [(1, "tests"), (2, "decode"), (3, "default_steps")]}}
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


def texts(folder):
    return {f.name: f.read_text() for f in folder.iterdir() if f.is_file()}


def hiding_python(tmp_path):
    """A python without its site-packages (python -S): torch and the rest are missing from it."""
    path = tmp_path / "python-without-torch"
    path.write_text(f'#!/bin/sh\nexec "{PYTHON}" -S "$@"\n')
    path.chmod(0o755)
    return path


# ---- item 6: gpu_check.sh's refusal and its dry run keep a GPU run's files ----

def test_item6_refusal_and_dry_run_keep_a_gpu_runs_log_and_json(tmp_path):
    """Without CUDA, gpu_check.sh opened (emptied) $OUT/gpu_check.log with tee before gpu_check.py refused; --dry-run
    wrote its part*.json over a GPU run's in $OUT. Now the refusal comes before anything is made, and a dry run writes
    in $OUT/dry_run/."""
    import torch

    out = tmp_path / "out"
    brought_back = gpu_results(out)
    env = {"OUT": str(out), "PYTHON": PYTHON}
    if not torch.cuda.is_available():  # the refusal needs a machine without CUDA
        refused = run_command(["bash", ROOT / "benchmarks" / "gpu_check.sh"], env=env, timeout=120)
        assert texts(out) == brought_back and not (out / "dry_run").exists()
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        assert refused.stderr.strip().splitlines()[-1].startswith("error: no CUDA device here"), refused.stderr

    # --seconds 1 (after the script's own): every part skipped at once, each still written with its status
    dry = run_command(["bash", ROOT / "benchmarks" / "gpu_check.sh", "--dry-run", "--seconds", "1"], env=env, timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert texts(out) == brought_back
    written = texts(out / "dry_run")
    assert sorted(written) == ["gpu_check.log"] + [f"part{n}_{name}.json" for n, name in
                                                  [(1, "tests"), (2, "decode"), (3, "default_steps"), (4, "estimate"), (5, "trl")]]
    assert all(json.loads(written[f"part{n}_{name}.json"])["status"].startswith("skipped") for n, name in
               [(1, "tests"), (5, "trl")])
    assert written["gpu_check.log"] == dry.stdout and dry.stdout.count("skipped") == 5


# ---- item 7: gpu_wheels.sh without network keeps the wheels it had ----

FAKE_PIP = '''
import os, sys, zipfile
args = sys.argv[1:]
if os.environ.get("FAKE_PIP_OFFLINE"):
    sys.exit("ERROR: Could not find a version that satisfies the requirement (network is unreachable)")
folder = args[args.index("-d") + 1]
for requirement in [a for a in args if "==" in a]:
    name, version = requirement.split("==")
    with zipfile.ZipFile(os.path.join(folder, f"{name}-{version}-py3-none-any.whl"), "w") as wheel:
        libraries = ["cuda121", "cuda130", "cpu"] if name == "bitsandbytes" else []
        for library in libraries:
            wheel.writestr(f"bitsandbytes/libbitsandbytes_{library}.so", b"\\0" * 1000)
        wheel.writestr(f"{name}-{version}.dist-info/RECORD",
                       "".join(f"bitsandbytes/libbitsandbytes_{library}.so,,\\n" for library in libraries))
'''


def test_item7_gpu_wheels_without_network_keeps_the_wheels_it_had(tmp_path):
    """gpu_wheels.sh removed .gpu-wheels/ before it downloaded: a run without network left no wheels at all. Now it
    downloads beside it and renames when complete: offline the old set stays whole and nothing is left beside it; a
    complete download replaces it whole (a repository of its own here: the script writes in the one it is in)."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "gpu_wheels.sh", repo / "benchmarks")
    for requirements in ("requirements.txt", "benchmarks/requirements.txt"):
        shutil.copy(ROOT / requirements, repo / requirements)
    (repo / ".gitignore").write_text(".gpu-wheels/\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    old = repo / ".gpu-wheels"
    old.mkdir()
    (old / "transformers-4.0.0-py3-none-any.whl").write_bytes(b"a wheel from the last complete run")
    (tmp_path / "fake_pip.py").write_text(FAKE_PIP)
    python = tmp_path / "python"  # pip download goes to the fake, everything else to the real python
    python.write_text(f'#!/bin/bash\nif [[ "$1 $2 $3" == "-m pip download" ]]; then shift 3; '
                      f'exec "{PYTHON}" "{tmp_path / "fake_pip.py"}" "$@"; fi\nexec "{PYTHON}" "$@"\n')
    python.chmod(0o755)
    script = ["bash", repo / "benchmarks" / "gpu_wheels.sh"]

    offline = run_command(script, env={"PYTHON": str(python), "FAKE_PIP_OFFLINE": "1"}, cwd=repo, timeout=120)
    assert old.is_dir() and [f.name for f in old.iterdir()] == ["transformers-4.0.0-py3-none-any.whl"]
    assert sorted(f.name for f in repo.iterdir()) == [".git", ".gitignore", ".gpu-wheels", "benchmarks",
                                                      "requirements.txt"]
    assert offline.returncode == 1
    assert offline.stderr.strip().splitlines()[-1] == "error: pip download failed (no network, or no PyPI?); " \
                                                      ".gpu-wheels/ is kept as it was"

    online = run_command(script, env={"PYTHON": str(python)}, cwd=repo, timeout=120)
    assert online.returncode == 0, online.stderr
    wheels = sorted(f.name for f in old.iterdir())
    assert len(wheels) == 8 and "transformers-4.0.0-py3-none-any.whl" not in wheels, wheels
    bitsandbytes = next(old.glob("bitsandbytes-*.whl"))
    assert sorted(zipfile.ZipFile(bitsandbytes).namelist())[1:] == ["bitsandbytes/libbitsandbytes_cpu.so",
                                                                    "bitsandbytes/libbitsandbytes_cuda130.so"]
    assert sorted(f.name for f in repo.iterdir()) == [".git", ".gitignore", ".gpu-wheels", "benchmarks",
                                                      "requirements.txt"]


# ---- item 10: a python without torch ----

def test_item10_a_python_without_torch_is_named_in_one_line(tmp_path):
    """gpu_check.sh (and gpu_check.py itself) with a python that lacks torch ended in common.py's ModuleNotFoundError
    traceback. Now one line names the python and the packages it lacks, and nothing is written."""
    python = hiding_python(tmp_path)
    out = tmp_path / "out"
    for command in (["bash", ROOT / "benchmarks" / "gpu_check.sh"], [python, ROOT / "benchmarks" / "gpu_check.py"],
                    [python, ROOT / "benchmarks" / "gpu_check.py", "--dry-run"]):
        result = run_command(command, env={"OUT": str(out), "PYTHON": str(python)}, timeout=120)
        assert "Traceback" not in result.stdout + result.stderr and result.returncode == 1, result.stdout + result.stderr
        assert not out.exists()
        said = result.stderr.strip().splitlines()
        assert len(said) == 1 and said[0].startswith(f"error: {os.path.realpath(PYTHON)} (Python ") or \
            said[0].startswith(f"error: {PYTHON} (Python "), said
        assert "has no torch, transformers, peft, safetensors, tokenizers" in said[0]


# ---- item 17: a copy of experiment_base's train.py ----

def test_item17_a_copy_of_train_py_is_evaluated_as_experiment_base(tiny_model_dir, tmp_path, capsys):
    """train.py records its folder's name in each checkpoint; evaluate.py refused any name not among its four as
    "multi-turn", a copy of experiment_base's train.py in my_exp/ too. Now the options it recorded decide: a copy of
    experiment_base's is evaluated as its; one whose options are a multi-turn experiment's is refused in a line that
    says what evaluate.py knows and what it evaluates."""
    import torch

    import evaluate
    from conftest import earlier_cpu_defaults, load_experiment, run_main, write_jsonl

    copy = tmp_path / "my_exp" / "train.py"
    copy.parent.mkdir()
    shutil.copy(ROOT / "experiment_base" / "train.py", copy)
    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)])
    run_main(copy.parent, ["--model-name", tiny_model_dir, "--data-path", data, "--device", "cpu", "--dtype", "float32",
                           "--max-steps", "1", "--group-size", "2", "--rollouts-per-step", "2", "--max-length", "4",
                           "--eval-interval", "0", "--lora-r", "4", "--run-name", "run", "--log-dir", tmp_path / "runs",
                           "--checkpoint-path", tmp_path / "out", *earlier_cpu_defaults(load_experiment())], tmp_path)
    capsys.readouterr()  # the run's own output
    step = tmp_path / "out" / "run" / "step_000001"
    assert torch.load(step / "training_state.pt", weights_only=True)["experiment"] == "my_exp"

    args = evaluate.parse_args(["--checkpoint", str(tmp_path / "out" / "run")])  # the run folder: its newest step
    assert args.checkpoint == step and args.lora_options[:2] == ["--lora-r", "4"]
    assert "a checkpoint of 'my_exp', no experiment in this repository; its options are experiment_base's: " \
           "evaluated as experiment_base's" in capsys.readouterr().err
    evaluate.main(["--model-name", str(tiny_model_dir), "--checkpoint", str(step), "--tasks", "gsm8k", "--data",
                   f"gsm8k={data}", "--eval-prompts", "2", "--max-length", "2", "--dtype", "float32"])
    assert re.search(r"^\| gsm8k \| 2 \| \d+% \| \d+% \|$", capsys.readouterr().out, re.M)

    state = torch.load(step / "training_state.pt", weights_only=True)
    multi_turn = {**state["args"], "max_turns": 3, "corpus_dir": "corpus"}  # a copy of experiment_multiturn_qa's
    for recorded, said in [(multi_turn, "whose options are none of theirs (corpus_dir, max_turns: not experiment_base's)"),
                           ({}, "records no options to tell whose copy it is")]:
        torch.save({**state, "args": recorded}, step / "training_state.pt")
        with pytest.raises(SystemExit) as stop:
            evaluate.parse_args(["--checkpoint", str(step)])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert stop.value.code == 2 and "a checkpoint of 'my_exp', no experiment in this repository" in err, err
        assert said in err and err.endswith("evaluate.py evaluates the checkpoints of experiment_base, "
                                            "experiment_drgrpo, experiment_accelerate, experiment_accelerate_ddp"), err


# ---- item 19: Ctrl-C or SIGTERM during gpu_check.py ----

SLEEPING_PART = '''
import os, subprocess, sys, time
folder, pids = sys.argv[1:]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # what a part starts: pytest's workers
with open(pids + ".partial", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.replace(pids + ".partial", pids)
while True:  # writes in the folder, as a part building the random model does
    with open(os.path.join(folder, "writing"), "w") as f:
        f.write(str(time.time()))
    time.sleep(0.05)
'''

DRIVER = '''
import json, os, shutil, sys
sys.path.insert(0, os.path.join({root!r}, "benchmarks"))
import gpu_check

def alive(pid):
    try:
        return open(f"/proc/{{pid}}/stat").read().rsplit(") ", 1)[1][0] not in "ZX"
    except FileNotFoundError:
        return False

def rmtree(folder, **kwargs):  # when the folder goes: is anything of the part still there to write in it?
    pids = open({pids!r}).read().split()
    with open({record!r}, "w") as f:
        json.dump({{"folder": str(folder), "alive": [alive(int(p)) for p in pids]}}, f)
    real_rmtree(folder, **kwargs)

real_rmtree = shutil.rmtree
gpu_check.part_command = lambda args, part, folder: [sys.executable, {part!r}, str(folder), {pids!r}]
gpu_check.shutil.rmtree = rmtree
sys.argv = [gpu_check.__file__, "--dry-run", "--out", {out!r}]
gpu_check.command_line()
'''


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_item19_a_stopped_check_stops_its_part_before_removing_its_folder(tmp_path, signum):
    """Ctrl-C (or SIGTERM) during gpu_check.py ended the check and removed the folder of the random model while the
    part, in a session of its own, ran on writing in it. Now the part and all it started are stopped and waited for,
    its JSON says it was interrupted, then the folder goes. gpu_check.py's command line runs here with a part that
    sleeps (no GPU) and shutil.rmtree watched."""
    (tmp_path / "part.py").write_text(SLEEPING_PART)
    pids, record, out = tmp_path / "pids", tmp_path / "at_rmtree.json", tmp_path / "out"
    (tmp_path / "driver.py").write_text(DRIVER.format(root=str(ROOT), part=str(tmp_path / "part.py"), pids=str(pids),
                                                      record=str(record), out=str(out)))
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:  # files: a part left
        check = subprocess.Popen([PYTHON, tmp_path / "driver.py"], stdout=stdout, stderr=stderr)  # running holds no pipe
    try:
        deadline = time.monotonic() + 120
        while not pids.exists() and check.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pids.exists(), "the part did not start"
        check.send_signal(signum)
        check.wait(timeout=60)
        stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    finally:
        check.kill()
        for pid in map(int, pids.read_text().split() if pids.exists() else []):  # on a failure here: none left running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert check.returncode == 130, stderr
    at_rmtree = json.loads(record.read_text())
    assert at_rmtree["alive"] == [False, False]  # the part and the process it started, gone before the folder went
    assert not os.path.exists(at_rmtree["folder"])
    name = signal.Signals(signum).name
    assert json.loads((out / "part1_tests.json").read_text())["status"] == f"interrupted ({name})"
    assert re.search(rf"^part 1 \(tests, \d+ s\): interrupted \({name}\) -> ", stdout, re.M), stdout
    assert stderr.strip().splitlines()[-1] == f"interrupted ({name}): the part running was stopped; the parts that ended are kept"


# ---- item 20: docs/gpu.md is for a GPU user ----

def test_item20_the_gpu_page_gives_the_commands_wheels_and_parts_and_no_lending():
    """docs/gpu.md told of this workplace's machine-lending tool (its run call, carry, a call's 64 MiB). A GPU user
    needs the two commands, the wheels, what each part measures and where the results go."""
    page = (ROOT / "docs" / "gpu.md").read_text()
    for word in ("lend", "lent", "lease", "budget", "device time", "carry", "carries", "workplace", "`run`", "session"):
        assert not re.search(rf"\b{re.escape(word)}\b", page, re.I), word
    for command in ("bash benchmarks/gpu_wheels.sh", "bash benchmarks/gpu_check.sh", "bash benchmarks/gpu_check.sh --dry-run"):
        assert f"`{command}`" in page, command
    for part in ("tests/test_cuda.py", "GraphDecode", "memory_estimate.py", "GRPOTrainer", "peak GPU memory"):
        assert part in page, part
    for where in ("part1_tests.json", "part5_trl.json", "gpu_check.log", "output/gpu_check/", "dry_run/", ".gpu-wheels/"):
        assert where in page, where
