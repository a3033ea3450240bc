"""Nothing lost, round four (issue 71), items 9 and 15 and the poor list: input a run took badly. Each test failed on
the code before its fix."""

import datetime
import io
import subprocess
import sys

import pytest

from conftest import ROOT, earlier_cpu_defaults, fails_with, load_experiment, run_main, run_script, write_jsonl
import tiny_grpo.errors
import tiny_grpo.rewards
import tiny_grpo.stopping
from tiny_grpo.data import load_tasks

BASE = ROOT / "experiment_base" / "train.py"


def run_args(model_dir, data, tmp_path, *extra, steps=1):
    """A run of the tiny model on data, its folders under tmp_path."""
    return ["--model-name", model_dir, "--device", "cpu", "--quantization", "none", "--dtype", "float32",
            "--data-path", data, "--max-steps", steps, "--group-size", "2", "--rollouts-per-step", "2", "--max-length", "4",
            "--eval-interval", "0", "--log-dir", tmp_path / "runs", "--checkpoint-path", tmp_path / "out",
            *earlier_cpu_defaults(load_experiment("experiment_base")), *extra]


def parquet_with(tmp_path, **columns):
    """A parquet file of 4 tasks, each row also holding one value of each column (a pyarrow array's first item)."""
    import pyarrow
    import pyarrow.parquet

    table = pyarrow.table({"question": [f"Say {i}" for i in range(4)], "answer": ["7"] * 4,
                           **{name: pyarrow.array([value] * 4, kind) for name, (value, kind) in columns.items()}})
    path = tmp_path / "tasks.parquet"
    pyarrow.parquet.write_table(table, path)
    return path


def start_reward_server():
    """tools/reward_server.py on a free port: (process, its /reward address)."""
    server = subprocess.Popen([sys.executable, str(ROOT / "tools" / "reward_server.py"), "--port", "0", "--quiet"],
                              stdout=subprocess.PIPE, text=True)
    return server, server.stdout.readline().split()[-1]


# ---- item 9: metadata JSON cannot encode, with --reward-url ----

def test_reward_url_with_a_timestamp_column_stops_in_one_line(tiny_model_dir, tmp_path):
    """A parquet timestamp column (the row's metadata) made json.dumps raise TypeError outside the reward client's
    error handling: the run ended in a traceback. Now one line names the field and its type."""
    import pyarrow

    data = parquet_with(tmp_path, when=(datetime.datetime(2024, 1, 2, 3, 4, 5), pyarrow.timestamp("us")))
    server, url = start_reward_server()
    try:
        result = run_script(BASE, *run_args(tiny_model_dir, data, tmp_path, "--run-name", "r", "--reward-url", url))
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "field 'when'" in result.stderr and "datetime" in result.stderr, result.stderr[-3000:]


def test_columns_json_cannot_encode_are_refused_at_read_for_reward_url_and_kept_for_reward_fn(tmp_path):
    """load_tasks(json_metadata=True), what a run with --reward-url reads its data with, refuses a bytes or timestamp
    column by file, row, field and type; without it (--reward-fn, the built-in terms) the values stay as read."""
    import pyarrow

    data = parquet_with(tmp_path, blob=(b"\x00\xff", pyarrow.binary()), note=("kept", pyarrow.string()))
    with pytest.raises(tiny_grpo.errors.InputError, match=rf"{data}: row 1: --reward-url cannot send field 'blob' "
                                                          r"\(Object of type bytes is not JSON serializable\)"):
        load_tasks(data, json_metadata=True)
    assert load_tasks(data)[0]["metadata"] == {"blob": b"\x00\xff", "note": "kept"}


def test_reward_fn_still_gets_a_timestamp_column_as_a_datetime(tiny_model_dir, tmp_path):
    """A --reward-fn receives the metadata through its worker process as Python objects: a datetime, bytes."""
    import pyarrow

    data = parquet_with(tmp_path, when=(datetime.datetime(2024, 1, 2), pyarrow.timestamp("us")),
                        blob=(b"\x00\xff", pyarrow.binary()))
    (tmp_path / "typed_reward.py").write_text(
        "import datetime\n\ndef reward(completion, answer, metadata):\n"
        "    assert isinstance(metadata['when'], datetime.datetime) and metadata['blob'] == b'\\x00\\xff', metadata\n"
        "    return 1.0\n")
    run_main("experiment_base", run_args(tiny_model_dir, data, tmp_path, "--run-name", "r", "--reward-fn",
                                         "typed_reward:reward"), tmp_path)  # (the worker is a fresh process still)
    assert (tmp_path / "out" / "r" / "step_000001").is_dir()


# ---- item 15: a run name the output's encoding, or the locale, cannot write ----

def test_say_writes_what_the_encoding_lacks_as_escapes():
    """say() is the run's closing line's print: a character the stream's encoding lacks is written escaped."""
    stream = io.TextIOWrapper(io.BytesIO(), encoding="latin-1")
    tiny_grpo.stopping.say("done: checkpoint in out/名前/step_000001 (naïve)", stream)
    stream.flush()
    assert stream.buffer.getvalue() == b"done: checkpoint in out/\\u540d\\u524d/step_000001 (na\xefve)\n"


def test_a_latin1_output_and_a_japanese_run_name_end_with_the_closing_line(tiny_model_dir, tmp_path, monkeypatch):
    """With PYTHONIOENCODING=latin-1 and --run-name 名前 the run trained and saved, then its closing print raised
    UnicodeEncodeError: exit 1 and a traceback after a good run. A --resume of it failed the same way at its start
    (run in this process, its output a latin-1 stream as that variable makes it: a fresh start costs 10 s)."""
    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"Say {i}", "answer": "7"} for i in range(8)])
    result = run_script(BASE, *run_args(tiny_model_dir, data, tmp_path, "--run-name", "名前"),
                        env={"PYTHONIOENCODING": "latin-1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "out" / "名前" / "step_000001").is_dir()
    assert "done: 1 steps" in result.stdout and "\\u540d\\u524d" in result.stdout
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="latin-1")  # strict, as Python's own
    monkeypatch.setattr(sys, "stdout", stdout)
    run_main("experiment_base", run_args(tiny_model_dir, data, tmp_path, "--run-name", "名前", "--resume",
                                         tmp_path / "out" / "名前", steps=2), ROOT)  # its "resumed from" line raised
    stdout.flush()
    assert "resumed from" in stdout.buffer.getvalue().decode("latin-1") and (tmp_path / "out" / "名前" / "step_000002").is_dir()


def test_a_utf8_run_name_under_an_ascii_locale_blames_the_locale(tmp_path):
    """Under LC_ALL=C with PYTHONUTF8=0 (Python's UTF-8 mode off: file names are ASCII) --run-name naïve was refused
    as "must be valid UTF-8", which it is. (Under LC_ALL=C alone Python 3.7+ turns UTF-8 mode on: it is taken.)"""
    result = run_script(BASE, "--device", "cpu", "--run-name", "naïve", "--checkpoint-path", tmp_path / "out",
                        env={"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""})
    assert result.returncode == 2
    assert "--run-name" in result.stderr and "must be valid UTF-8" not in result.stderr, result.stderr[-2000:]
    assert "locale" in result.stderr and "LC_ALL=C.UTF-8" in result.stderr and "(ascii)" in result.stderr
    assert not (tmp_path / "out").exists()


# ---- the poor list ----

@pytest.mark.parametrize("value", ["numpy.True_", "numpy.array(False)", "torch.tensor(True)"],
                         ids=["numpy-bool", "numpy-0d-bool", "torch-bool"])
def test_a_reward_fn_returning_a_boolean_of_any_library_is_refused(tmp_path, monkeypatch, value):
    """True was refused as a reward, numpy.True_ (what `numpy_score > 0.5` gives) taken as 1.0."""
    module = f"bool_reward_{value.split('.')[0]}"
    (tmp_path / f"{module}.py").write_text(f"import {value.split('.')[0]}\n\ndef reward(completion, answer, metadata):\n"
                                           f"    return {value}\n")
    monkeypatch.chdir(tmp_path)
    function = tiny_grpo.rewards.load_reward_fn(f"{module}:reward")
    with pytest.raises(tiny_grpo.errors.RewardError, match="not a finite number"):
        function("c", "a", {})


def test_a_run_name_too_long_for_a_folder_is_blamed_on_run_name(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A 300-character --run-name was reported as "--checkpoint-path: cannot write to ...: File name too long"."""
    monkeypatch.chdir(tmp_path)
    module = load_experiment("experiment_base")
    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": "Say 1", "answer": "7"}])
    for name, size in (("a" * 300, 300), ("名前" * 50, 300)):  # bytes in UTF-8, what a file system counts
        said = fails_with(module, ["--device", "cpu", "--model-name", tiny_model_dir, "--data-path", data,
                                   "--eval-interval", "0", "--run-name", name], capsys)
        assert "--run-name" in said and f"is {size} bytes long" in said and "at most 255" in said, said
        assert "--checkpoint-path" not in said.splitlines()[-1]
    assert list(tmp_path.iterdir()) == [data]  # refused before any folder is made
    assert module.parse_args(["--device", "cpu", "--run-name", "a" * 255]).run_name == "a" * 255


@pytest.mark.parametrize("name, field", [("experiment_multiturn_tool_calling", field) for field in
                                         ("turns", "tool_calls", "tool_errors")] +
                         [("experiment_multiturn_qa", field) for field in ("searches", "queries", "answer_retrieved")])
def test_multi_turn_copies_refuse_data_fields_their_episode_record_replaces(name, field, tiny_model_dir, tmp_path,
                                                                            capsys):
    """A data field named as a field of the episode's record (tool calling's turns or tool_calls, QA's searches or
    queries) was replaced in silence by that record in what the reward received. It is refused at load, by file and
    line, before the model loads."""
    module = load_experiment(name)
    rows = [{"question": "What is 2 + 2?", "answer": "4"}, {"question": "What is 3 + 3?", "answer": "6", field: 1}]
    data = write_jsonl(tmp_path / "tasks.jsonl", rows)
    said = fails_with(module, ["--device", "cpu", "--model-name", tiny_model_dir, "--data-path", data,
                               "--eval-interval", "0", "--max-steps", "1", "--group-size", "2", "--rollouts-per-step",
                               "2", "--max-length", "4", "--checkpoint-path", tmp_path / "out", "--log-dir",
                               tmp_path / "runs"], capsys)
    assert f"{data}:2: field {field!r} is a name of the episode's record" in said and "rename" in said, said
    assert not (tmp_path / "out").exists()  # refused with the data, before the run claims its folders
