"""Bad input gets one clear line naming what is wrong and where, before any model is loaded."""

import pytest

from conftest import fails_with, write_jsonl


def data_args(path):
    return ["--device", "cpu", "--model-name", "unused", "--data-path", path, "--eval-interval", "0"]


def test_malformed_jsonl_line(task_experiment, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "1+1", "answer": "2"}\n\n{"question": "2+2", "answer": \n')
    message = fails_with(task_experiment, data_args(path), capsys)
    assert f"{path}:3: not valid JSON" in message


def test_missing_field_names_file_line_and_option(task_experiment, tmp_path, capsys):
    path = write_jsonl(tmp_path / "tasks.jsonl", [{"question": "1+1", "answer": "2"}, {"question": "2+2", "solution": "4"}])
    message = fails_with(task_experiment, data_args(path), capsys)
    assert f"{path}:2: no field 'answer' (--answer-key)" in message and "solution" in message


def test_other_field_names_map_with_keys(task_experiment, tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", [{"src": "1+1", "tgt": 2, "level": 1}])
    assert task_experiment.load_tasks(path, "src", "tgt") == [{"question": "1+1", "answer": "2", "metadata": {"level": 1}}]


def test_empty_after_filters(task_experiment, tmp_path, capsys):
    path = write_jsonl(tmp_path / "tasks.jsonl", [{"question": "1+1", "answer": "2", "num_terms": 2}])
    message = fails_with(task_experiment, data_args(path) + ["--filter", "num_terms=3,4"], capsys)
    assert f"{path}: no tasks after --filter num_terms=3,4" in message
    assert [t["question"] for t in task_experiment.load_tasks(path, filters=["num_terms=2"])] == ["1+1"]


def test_filter_on_a_field_the_data_lacks(task_experiment, tmp_path, capsys):
    path = write_jsonl(tmp_path / "tasks.jsonl", [{"question": "1+1", "answer": "2"}])
    assert "--filter level=...: the row has no field 'level'" in fails_with(task_experiment, data_args(path) + ["--filter", "level=1"], capsys)


def test_missing_data_file(task_experiment, tmp_path, capsys):
    assert f"{tmp_path / 'nope.jsonl'}: no such file" in fails_with(task_experiment, data_args(tmp_path / "nope.jsonl"), capsys)


@pytest.mark.parametrize("argv, expected", [
    (["--group-size", "1"], "argument --group-size: must be an integer in [2, inf), got 1"),
    (["--quantization", "3bit"], "argument --quantization: invalid choice: '3bit'"),
    (["--device", "tpu"], "--device: expected auto, cuda, cuda:N or cpu, got 'tpu'"),
    (["--top-p", "1.5"], "argument --top-p: must be a finite number in (0, 1], got 1.5"),
    (["--clip-eps", "5"], "argument --clip-eps: must be a finite number in (0, 1], got 5"),
    (["--lr", "inf"], "argument --lr: must be a finite number in (0, 1], got inf"),
    (["--kl-weight", "nan"], "argument --kl-weight: must be a finite number in [0, inf), got nan"),
    (["--lora-dropout", "1.5"], "argument --lora-dropout: must be a finite number in [0, 1), got 1.5"),
    (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["--no-lora", "--quantization", "4bit"], "--no-lora trains every weight"),
    (["--sampling-weights", "fast"], "argument --sampling-weights: invalid choice: 'fast'"),
    (["--sampling-weights", "dequantized", "--quantization", "none"], "--sampling-weights dequantized needs --quantization 4bit (it is none)"),
    (["--filter", "num_terms"], "argument --filter: expected FIELD=V1,V2, got 'num_terms'"),
    (["--max-steps", "0"], "argument --max-steps: must be an integer in [1, inf), got 0"),
    (["--max-steps", "2.5"], "argument --max-steps: invalid int value: '2.5'"),
])
def test_bad_option_values(task_experiment, capsys, argv, expected):
    assert expected in fails_with(task_experiment, argv, capsys)


def test_resume_from_nothing(task_experiment, tmp_path, capsys):
    path = write_jsonl(tmp_path / "tasks.jsonl", [{"question": "1+1", "answer": "2"}])
    message = fails_with(task_experiment, data_args(path) + ["--resume", tmp_path], capsys)
    assert f"--resume {tmp_path}: no checkpoint there" in message


def test_unloadable_model(task_experiment, tmp_path, capsys):
    path = write_jsonl(tmp_path / "tasks.jsonl", [{"question": "1+1", "answer": "2"}])
    argv = data_args(path) + ["--model-name", "no-such-owner/no-such-model", "--checkpoint-path", tmp_path / "out",
                              "--log-dir", tmp_path / "runs"]  # the run claims its folders before the model loads
    assert "--model-name no-such-owner/no-such-model: cannot load it" in fails_with(task_experiment, argv, capsys)
