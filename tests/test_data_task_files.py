"""The task files in data/ and the scripts that make them."""

import json

from conftest import ROOT, run_script


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_math_tasks_are_reproducible_and_held_out(tmp_path):
    result = run_script(ROOT / "data" / "make_math_tasks.py", "--out-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ("math_tasks.jsonl", "math_tasks_eval.jsonl"):  # the committed files are what the script writes
        assert (tmp_path / name).read_bytes() == (ROOT / "data" / name).read_bytes(), name
    train, held_out = read_jsonl(tmp_path / "math_tasks.jsonl"), read_jsonl(tmp_path / "math_tasks_eval.jsonl")
    assert len(train) >= 50_000 and len(held_out) >= 1_000
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    assert len({r["question"] for r in train}) == len(train)


def test_math_task_fields_and_answers():
    rows = read_jsonl(ROOT / "data" / "math_tasks_eval.jsonl")
    for row in rows:
        expression = row["question"].removeprefix("What is ").removesuffix("?")
        assert int(row["answer"]) == eval(expression)  # noqa: S307 - the test's independent oracle, on our own data
        numbers = expression.split()[::2]
        assert len(numbers) == row["num_terms"] and max(len(n) for n in numbers) <= row["num_digits"]
        assert row["ops"] == "".join(sorted(set(expression.split()[1::2])))
    easy = [r for r in rows if r["num_terms"] == 2 and r["num_digits"] == 2 and r["ops"] in ("+", "-")]
    assert len(easy) >= 100  # enough held-out two-term two-digit addition/subtraction for the learning benchmark


def test_math_tasks_seed_changes_the_tasks(tmp_path):
    run_script(ROOT / "data" / "make_math_tasks.py", "--out-dir", tmp_path, "--seed", "1", "--train-rows", "100",
               "--eval-rows", "10")
    assert read_jsonl(tmp_path / "math_tasks.jsonl")[:5] != read_jsonl(ROOT / "data" / "math_tasks.jsonl")[:5]
    assert len(read_jsonl(tmp_path / "math_tasks.jsonl")) == 100
