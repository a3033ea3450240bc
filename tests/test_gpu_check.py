"""benchmarks/gpu_check.sh, the command a GPU machine runs first: its dry run on the CPU goes through each part's
code (each part in a process of its own, under its own time limit), writes each part's JSON under $OUT with the keys
a GPU run writes, and prints each part's line as the part ends; a part out of time is recorded and the next one runs."""

import json
import os
import re
import subprocess
import sys

import gpu_check  # benchmarks/, on the path through conftest
import gpu_run
from conftest import ROOT

KEYS = {1: {"graph", "rest"},
        2: {"eager", "graph", "graph_over_eager", "completions_unlike", "graph_captured", "graph_trouble", "settings"},
        3: {"settings", "steps", "prompt_tokens", "peak_gb", "summary", "hours_for_500_steps"},
        4: {"settings", "estimate_gb", "reserved_gb", "estimate_over_reserved"},
        5: {"settings", "steps", "trl", "side_by_side", "step_time_over_trl"}}


def test_the_dry_run_writes_and_prints_each_part_as_it_ends(tmp_path, capsys):
    """The dry run writes in $OUT/dry_run/ (a GPU run's results in $OUT stay: tests/test_hostile_round5_scripts.py);
    its part 5 is the only run of TRL's side by side in the suite, so gpu_run.py's table of it is checked here."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    tmp_path = tmp_path / "dry_run"
    process = subprocess.Popen(["bash", ROOT / "benchmarks" / "gpu_check.sh", "--dry-run"], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ended, output = [], []
    for line in process.stdout:  # read as printed: when a part's line comes, its JSON is there and the next's is not
        output.append(line)
        if match := re.match(r"part (\d) \((\w+), \d+ s\): (.*) -> ", line):
            ended.append(int(match[1]))
            assert sorted(p.name for p in tmp_path.glob("part*.json")) == [gpu_check.json_path(tmp_path, n).name for n in ended]
    assert process.wait() == 0, "".join(output)[-3000:]
    assert ended == [1, 2, 3, 4, 5], "".join(output)[-3000:]
    parts = {n: json.loads(gpu_check.json_path(tmp_path, n).read_text()) for n in ended}
    for n, part in parts.items():
        assert part["status"] == "done" and set(part["result"]) == KEYS[n] and part["machine"]["cpu"], part
    tests, decode, steps, estimate, trl = (parts[n]["result"] for n in ended)
    assert tests["graph"]["tests"] == {"test_the_graph_decode_step_on_cuda": "skipped"}  # no CUDA here
    assert tests["rest"]["skipped"] > 10 and not tests["rest"]["failed"] and gpu_check.GRAPH_TEST not in tests["rest"]["tests"]
    assert decode["graph"]["tokens"] == decode["eager"]["tokens"] == 2 * 2 * 8 and decode["completions_unlike"] == 0
    assert [s["tokens"] for s in steps["steps"]] == [2 * 2 * 8] * 3 and steps["peak_gb"] is None  # no GPU peaks
    assert estimate["estimate_gb"]["training"] > 0 and estimate["reserved_gb"] is None
    assert len(trl["trl"]["steps"]) == 2 and trl["step_time_over_trl"] > 0
    gpu_run.print_side_by_side(trl["side_by_side"])  # as gpu_run.py prints it, TRL's steps beside experiment_base's
    assert re.search(r"^\| seconds per step \(median\) \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", capsys.readouterr().out, re.M)
    assert (tmp_path / "gpu_check.log").read_text() == "".join(output)  # the whole output, kept beside the JSON


def test_a_part_out_of_time_is_recorded_and_the_next_runs(tmp_path, monkeypatch, capsys):
    """Each part stopped after a second (itself and the processes it started), one left without time skipped, and a
    part stopped after saving some of its result keeps it, its status saying both."""
    monkeypatch.setattr(gpu_check, "LIMITS", {1: 1, 2: 1, 3: 1, 4: 1, 5: 100})
    monkeypatch.setattr(gpu_check, "LEAST", 0.5)
    gpu_check.main(["--dry-run", "--out", str(tmp_path), "--seconds", "4.5"])
    statuses = [json.loads(gpu_check.json_path(tmp_path, n).read_text())["status"] for n in range(1, 6)]
    assert statuses == ["timed out after 1 s"] * 4 + [statuses[4]] and statuses[4].startswith("skipped: 0 s left")
    assert re.findall(r"^part (\d) .*: (timed out|skipped)", capsys.readouterr().out, re.M) == \
        [("1", "timed out"), ("2", "timed out"), ("3", "timed out"), ("4", "timed out"), ("5", "skipped")]
    path = gpu_check.json_path(tmp_path, 5)
    path.write_text(json.dumps({"part": 5, "status": "experiment_base done, TRL running", "result": {"steps": [1]}}))
    gpu_check.finish(path, 5, "timed out after 9 s", 9.0)
    part = json.loads(path.read_text())
    assert part["status"] == "timed out after 9 s (experiment_base done, TRL running)" and part["result"] == {"steps": [1]}
