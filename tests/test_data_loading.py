"""--data-path as the datasets library opens it: JSONL, JSON, parquet and CSV files, a glob of them, a saved dataset,
a folder laid out as on the hub, a hub id (refused offline in one line); GSM8K's '####' answers read without a
preparation step; and --task math_latex, whose answers math-verify compares. In every experiment that shares
experiment_base's data loading; the files are written here."""

import csv
import json
import subprocess
import sys
import time

import pyarrow
import pyarrow.parquet
import pytest
from conftest import ROOT, fails_with, write_jsonl
import tiny_grpo.answers
import tiny_grpo.rewards
import tiny_grpo.errors

ROWS = [
    {"question": "What is 1 + 1?", "answer": "2", "level": 1},
    {"question": "What is half of 3?", "answer": "1/2 of 3 = 1.5", "level": 2},
    {"question": "Write 007 as a number.", "answer": "007", "level": 2},
]
TASKS = [{"question": row["question"], "answer": row["answer"]} for row in ROWS]


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_saved(folder, rows, splits=False):
    import datasets

    data = datasets.Dataset.from_list(rows)
    (datasets.DatasetDict({"train": data, "test": data.select([0])}) if splits else data).save_to_disk(str(folder))
    return folder


WRITERS = {  # format -> (write the rows under tmp_path, return what --data-path takes)
    "jsonl": lambda tmp, rows: write_jsonl(tmp / "t.jsonl", rows),
    "json": lambda tmp, rows: (tmp / "t.json").write_text(json.dumps(rows)) and tmp / "t.json",  # one JSON array
    "parquet": lambda tmp, rows: write_parquet(tmp / "t.parquet", rows),
    "csv": lambda tmp, rows: write_csv(tmp / "t.csv", rows),
    "saved dataset": lambda tmp, rows: write_saved(tmp / "saved", rows),
    "saved splits": lambda tmp, rows: write_saved(tmp / "saved", rows, splits=True),
    "hub layout": lambda tmp, rows: write_parquet(tmp / "repo" / "main" / "train-00000-of-00001.parquet", rows).parent,
    "glob": lambda tmp, rows: (write_parquet(tmp / "part-1.parquet", rows[1:]), write_parquet(tmp / "part-0.parquet", rows[:1]))
    and f"{tmp}/part-*.parquet",
}


@pytest.mark.parametrize("kind", list(WRITERS))
def test_each_format_gives_the_same_tasks(experiment, tmp_path, kind):
    tasks = experiment.load_tasks(WRITERS[kind](tmp_path, ROWS))
    assert [{"question": t["question"], "answer": t["answer"]} for t in tasks] == TASKS  # '007' stays text in CSV too
    levels = [t["metadata"]["level"] for t in tasks]
    assert levels == (["1", "2", "2"] if kind == "csv" else [1, 2, 2])  # a CSV's cells are read as the text they are


def test_filter_and_max_rows_on_a_parquet_column(experiment, tmp_path):
    path = write_parquet(tmp_path / "t.parquet", ROWS)
    assert [t["answer"] for t in experiment.load_tasks(path, filters=["level=2"])] == ["1/2 of 3 = 1.5", "007"]
    assert [t["answer"] for t in experiment.load_tasks(path, filters=["level=2"], max_rows=1)] == ["1/2 of 3 = 1.5"]
    with pytest.raises(experiment.InputError, match=r"t.parquet: no tasks after --filter level=3"):
        experiment.load_tasks(path, filters=["level=3"])


def test_columns_and_splits_are_chosen_by_option(experiment, tmp_path):
    rows = [{"problem": row["question"], "solution": row["answer"]} for row in ROWS]
    folder = write_saved(tmp_path / "saved", rows, splits=True)
    tasks = experiment.load_tasks(folder, "problem", "solution", split="test")
    assert [(t["question"], t["answer"]) for t in tasks] == [(ROWS[0]["question"], "2")]
    with pytest.raises(experiment.InputError, match=r"saved: no split 'validation' \(it has train, test\)"):
        experiment.load_tasks(folder, "problem", "solution", split="validation")


@pytest.mark.parametrize("kind, rows, said", [
    ("parquet", [ROWS[0], {"question": "q", "answer": None}], r"t.parquet: row 2: field 'answer' is empty \(null\)"),
    ("parquet", [{"question": "q", "label": "1"}], r"t.parquet: row 1: no field 'answer' \(--answer-key\); the row has "
                                                   r"\['label', 'question'\]"),
    ("parquet", [{"question": "q", "answer": 1.5}, {"question": "q", "answer": float("nan")}], r"t.parquet: row 2: field 'answer' is nan"),
    ("parquet", [{"question": "q", "answer": [1, 2]}], r"row 1: field 'answer' must be a string, got list"),
    ("csv", [ROWS[0], {"question": "q", "answer": "", "level": 1}], r"t.csv: row 2: field 'answer' is empty"),
    ("json", [ROWS[0], {"question": "", "answer": "1"}], r"t.json: row 2: field 'question' is empty"),
])
def test_bad_rows_are_named_by_file_and_row(experiment, tmp_path, kind, rows, said):
    with pytest.raises(experiment.InputError, match=said):
        experiment.load_tasks(WRITERS[kind](tmp_path, rows))


@pytest.mark.parametrize("name, content", [("broken.parquet", b"PAR1 not really"), ("broken.json", b'[{"question": "q"'),
                                           ("t.txt", b"question,answer\n1+1,2\n")])
def test_a_file_datasets_cannot_read_is_one_line_naming_it(experiment, tmp_path, name, content):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(experiment.InputError) as error:
        experiment.load_tasks(tmp_path / name)
    assert str(error.value).startswith(str(tmp_path / name)) and "\n" not in str(error.value)
    assert ("expected a .jsonl, .json, .parquet, .csv file" if name.endswith(".txt") else "datasets cannot read it") in str(error.value)


def test_missing_files_and_empty_globs_are_named(experiment, tmp_path):
    for path, said in ((tmp_path / "none.parquet", "none.parquet: no such file"), (f"{tmp_path}/*.csv", r"\*.csv: no file matches"),
                       ("./no/such/folder", "no/such/folder: no such file")):
        with pytest.raises(experiment.InputError, match=said):
            experiment.load_tasks(path)


def test_a_hub_id_offline_is_refused_in_one_line(experiment, tmp_path, capsys, monkeypatch):
    """The tests run with HF_HUB_OFFLINE=1 (conftest): datasets answers at once, as it does with no network. A hub id
    fails before the model loads, in one line that says what to do."""
    monkeypatch.chdir(tmp_path)
    said = fails_with(experiment, ["--data-path", "openai/gsm8k", "--data-config", "main", "--model-name", "/no/model",
                                   "--checkpoint-path", "out", "--log-dir", "runs"], capsys)
    lines = [line for line in said.splitlines() if line.strip()]
    assert len(lines) == 1, said
    assert lines[0].startswith("error: openai/gsm8k (config main, split train): cannot reach the Hugging Face hub")
    assert "to_parquet(FILE)" in lines[0] and "Traceback" not in said
    assert not (tmp_path / "out").exists()  # nothing was claimed or loaded


# GSM8K as the hub has it: worked solution with calculator notes, then "#### final answer"
GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 friends in April and half as many in May. How many in all?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"},
    {"question": "A farm has 400 cows that give 3 litres each. How many litres?", "answer": "400 * 3 = <<400*3=1200>>1200.\n#### 1,200"},
    {"question": "The temperature was 3 degrees and fell by 8. What is it now?", "answer": "3 - 8 = <<3-8=-5>>-5\n#### -5"},
    {"question": "How many seconds in a while?", "answer": "Many.\n####    1,234,567   "},
]


def write_gsm8k_copy(folder, train=GSM8K_ROWS, test=GSM8K_ROWS[1:3]):
    """A local copy of openai/gsm8k as its hub repository lays it out: main/{train,test}-00000-of-00001.parquet."""
    write_parquet(folder / "main" / "train-00000-of-00001.parquet", train)
    write_parquet(folder / "main" / "test-00000-of-00001.parquet", test)
    write_parquet(folder / "socratic" / "train-00000-of-00001.parquet", [{"question": "not me", "answer": "#### 1"}])
    return folder / "main"


def test_gsm8k_from_a_local_copy_needs_no_preparation(task_experiment, tmp_path):
    folder = write_gsm8k_copy(tmp_path / "gsm8k")
    args = task_experiment.parse_args(["--task", "gsm8k", "--data-path", str(folder)])
    assert (args.eval_data_path, args.data_split, args.eval_split) == (str(folder), "train", "test")  # its own test split
    _, train, held_out = task_experiment.load_inputs(args)
    assert [t["answer"] for t in train] == ["72", "1200", "-5", "1234567"]  # after '####', commas removed
    assert train[0]["metadata"]["solution"].startswith("Natalia sold 48/2 = <<48/2=24>>24") and "####" not in train[0]["metadata"]["solution"]
    assert [t["answer"] for t in held_out] == ["1200", "-5"]
    assert task_experiment.correctness("<answer>1,234,567</answer>", train[3]["answer"], "gsm8k") == 1.0


def test_gsm8k_defaults_to_the_hub_and_names_a_bad_final_answer(task_experiment, tmp_path):
    args = task_experiment.parse_args(["--task", "gsm8k"])
    assert (args.data_path, args.data_config, args.eval_data_path) == ("openai/gsm8k", "main", "openai/gsm8k")
    bad = write_parquet(tmp_path / "train.parquet", GSM8K_ROWS[:2] + [{"question": "q", "answer": "work\n#### ten"}])
    with pytest.raises(task_experiment.InputError, match=r"train.parquet: row 3: the final answer after '####' is not a number: 'ten'"):
        task_experiment.load_tasks(bad, task="gsm8k")
    assert [t["answer"] for t in task_experiment.load_tasks(bad, task="math", max_rows=1)] == [GSM8K_ROWS[0]["answer"]]  # only gsm8k splits it


def test_data_files_are_read_in_place(tmp_path):
    """Nothing is copied into an Arrow cache, or written at all, in the user's home or the Hugging Face cache."""
    home = tmp_path / "home"
    home.mkdir()
    paths = [WRITERS[kind](tmp_path, ROWS) for kind in ("parquet", "csv", "json", "hub layout", "saved dataset")]
    script = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); from conftest import load_experiment; "
              f"base = load_experiment('experiment_base'); print([len(base.load_tasks(p)) for p in {[str(p) for p in paths]!r}])")
    env = {"HOME": str(home), "HF_HOME": "", "HF_DATASETS_CACHE": "", "XDG_CACHE_HOME": ""}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                            env={k: v for k, v in {**__import__("os").environ, **env}.items() if v})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[3, 3, 3, 3, 3]"
    assert [p for p in home.rglob("*")] == []


# ---- --task math_latex: LaTeX answers, compared by math-verify ----

@pytest.mark.parametrize("given, reference, expected", [
    ("<answer> 0.5 </answer>", r"\frac{1}{2}", 1.0),
    ("<answer> 1/2 </answer>", r"\frac{1}{2}", 1.0),
    (r"<answer> \frac{1}{2} </answer>", "0.5", 1.0),
    (r"<answer> \boxed{3} </answer>", "3", 1.0),
    (r"so the answer is \boxed{3}.", "3", 1.0),  # no tags: the last \boxed{}
    (r"\boxed{2} or rather \boxed{\frac{6}{2}}", "3", 1.0),
    ("<answer> [2, 5) </answer>", "[2,5)", 1.0),
    ("<answer> (2, 5) </answer>", "[2, 5)", 0.0),  # another interval
    (r"<answer> 2\sqrt{2} </answer>", r"\sqrt{8}", 1.0),
    ("<answer> 0.7 </answer>", r"\frac{3}{4}", 0.0),
    (r"<answer> 4 </answer> \boxed{3}", "3", 0.0),  # the tags' answer counts where there are tags
    ("the answer is 3", "3", 0.0),
])
def test_math_latex_compares_by_math_verify(task_experiment, given, reference, expected):
    assert task_experiment.correctness(given, reference, "math_latex") == expected


def test_every_equivalent_form_in_the_sample_is_right(tmp_path):
    """data/math_latex*.jsonl list, for each answer, equivalent forms of it: each one, and the answer itself, earns the
    correctness and format reward; another row's answer does not (each row's is distinct)."""
    from conftest import load_experiment

    base = load_experiment("experiment_base")
    rows = base.load_tasks(ROOT / "data" / "math_latex.jsonl") + base.load_tasks(ROOT / "data" / "math_latex_eval.jsonl")
    assert 20 <= len(rows) <= 50 and {row["metadata"]["kind"] for row in rows} >= {"fraction", "root", "interval", "set"}
    for i, row in enumerate(rows):
        for form in [row["answer"], *row["metadata"]["equivalent"]]:
            completion = f"<think> worked </think> <answer> {form} </answer>"
            assert base.correctness(completion, row["answer"], "math_latex") == 1.0, (row, form)
            assert base.format_score(completion, "math_latex") == 1.0, (row, form)
        other = rows[i - 1]["answer"]
        if other != row["answer"]:
            assert base.correctness(f"<answer> {other} </answer>", row["answer"], "math_latex") == 0.0, (row, other)


def test_math_latex_format_wants_an_answer_not_words(task_experiment):
    assert task_experiment.format_score(r"<think> x </think> <answer> \frac{1}{2} </answer>", "math_latex") == 1.0
    assert task_experiment.format_score("<think> x </think> <answer> no idea </answer>", "math_latex") == 0.0  # parses as n*o*i*d*e*a
    assert task_experiment.format_score("<think> x </think> <answer> </answer>", "math_latex") == 0.0


def test_math_latex_gives_up_on_an_expression_that_would_hang(task_experiment, monkeypatch):
    """9^(9^(9^9)) has no end in sympy: math-verify's timeout scores it 0 instead of stalling the step. The guard
    below is against a hang, not a speed test: a second of timeout, per parse and per comparison."""
    monkeypatch.setattr(tiny_grpo.answers, "MATH_VERIFY_SECONDS", 1)
    start = time.monotonic()
    assert task_experiment.correctness(r"<answer> 9^{9^{9^{9}}} </answer>", "3", "math_latex") == 0.0
    assert time.monotonic() - start < 60
    assert task_experiment.correctness(r"<answer> 3 </answer>", "3", "math_latex") == 1.0  # and it goes on


# -- Nothing lost, round three (issue 59): data

@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_numbers_in_exponent_form_are_the_numbers_they_are(experiment, tmp_path, kind):
    """1e16, 0.00001 and 1e22 were stored as '1e+16', '1e-05' and '1e+22' (str(float)), which parse_number scores
    as 16, -5 and 22: a number becomes its shortest decimal, written out in full."""
    rows = [{"question": f"Q{i}", "answer": value} for i, value in enumerate([1e16, 0.00001, 1e22, -2.5e-7, 1.5, 7])]
    tasks = experiment.load_tasks(WRITERS[kind](tmp_path, rows))
    assert [t["answer"] for t in tasks] == ["10000000000000000", "0.00001", "10000000000000000000000", "-0.00000025",
                                            "1.5", "7"]


def test_a_float32_column_is_read_as_the_decimal_written(experiment, tmp_path):
    """A float32 parquet 0.1 became '0.10000000149011612', which no completion matches: a float32 column's values
    are the shortest decimals that are those float32 numbers; a float64 column's are its own shortest."""
    table = pyarrow.table({"question": ["a", "b", "c"], "answer": pyarrow.array([0.1, 1e16, 2.5], pyarrow.float32()),
                           "weight": pyarrow.array([0.1, 0.2, 0.3], pyarrow.float64())})
    pyarrow.parquet.write_table(table, tmp_path / "t.parquet")
    tasks = experiment.load_tasks(tmp_path / "t.parquet")
    assert [t["answer"] for t in tasks] == ["0.1", "10000000000000000", "2.5"]
    assert [t["metadata"]["weight"] for t in tasks] == [0.1, 0.2, 0.3]


@pytest.mark.parametrize("final", ["1e3", ".5", "1_000", "3,5", "1e99999999", "9" * 300])
def test_gsm8k_final_answers_are_checked_by_the_parser_that_scores(task_experiment, tmp_path, final):
    """The final answer was validated by Fraction and scored by parse_number: '1e3' scored as 3, '.5' as 5, '1_000'
    as 0, '3,5' as 35; '#### 1e99999999' hung the loader (a 100-million-digit integer: 5 minutes measured).
    Numbers as parse_number reads them still load, and score as themselves."""
    bad = write_parquet(tmp_path / "train.parquet", GSM8K_ROWS[:1] + [{"question": "q", "answer": f"work\n#### {final}"}])
    started = time.monotonic()
    with pytest.raises(task_experiment.InputError, match=r"train.parquet: row 2: the final answer after '####' is not a number"):
        task_experiment.load_tasks(bad, task="gsm8k")
    assert time.monotonic() - started < 30  # a guard against the hang, not a speed test
    rows = [{"question": "q", "answer": f"work\n#### {final}"} for final in ["1,200", "-5", "3/4", "2.50", "1,234,567"]]
    tasks = task_experiment.load_tasks(write_jsonl(tmp_path / "t.jsonl", rows), task="gsm8k")
    assert [t["answer"] for t in tasks] == ["1200", "-5", "3/4", "2.50", "1234567"]
    for task in tasks:
        assert task_experiment.correctness(f"<answer>{task['answer']}</answer>", task["answer"], "gsm8k") == 1.0


@pytest.mark.parametrize("text, said", [
    ("question,answer\nWhat is 2+2?,4\nWhat is 1+1?,2,oops,9\n", r"t.csv: row 2 \(line 3\): 4 fields, the header has 2"),
    ("question,answer\n\nWhat is 2+2?,4\n\"What is\n1+1?\",2,oops\n", r"t.csv: row 2 \(line 5\): 3 fields, the header has 2"),
    ("question,answer,answer\nq,1,2\n", r"t.csv: the header names 'answer' more than once \(columns 2 and 3\)"),
    ("question,,answer\nq,x,1\n", r"t.csv: the header's column 2 has no name"),
])
def test_a_ragged_csv_or_a_bad_header_is_refused(experiment, tmp_path, text, said):
    """A row with more fields than the header was read from the wrong columns (pandas took the first as an index:
    question 'oops', answer '9'); a duplicated column was dropped without a word; an empty name was not named."""
    (tmp_path / "t.csv").write_text(text)
    with pytest.raises(experiment.InputError, match=said):
        experiment.load_tasks(tmp_path / "t.csv")


def test_a_folder_whose_shards_mix_formats_is_refused(experiment, tmp_path):
    """datasets read the parquet shards of such a folder and dropped the JSON one without a word."""
    write_parquet(tmp_path / "data" / "train-00000-of-00002.parquet", ROWS[:2])
    write_jsonl(tmp_path / "data" / "train-00001-of-00002.jsonl", ROWS[2:])
    with pytest.raises(experiment.InputError, match=r"data: it holds json and parquet files"):
        experiment.load_tasks(tmp_path / "data")


def test_an_empty_data_path_is_refused(experiment, tmp_path, capsys, monkeypatch):
    """--data-path "" was read as the current folder."""
    monkeypatch.chdir(tmp_path)
    said = fails_with(experiment, ["--data-path", "", "--model-name", "/no/model"], capsys)
    assert "--data-path" in said and "got nothing" in said
    with pytest.raises(experiment.InputError, match="empty"):
        experiment.load_tasks("")


def test_a_file_whose_name_looks_like_a_glob_is_read_as_the_file(experiment, tmp_path):
    path = write_jsonl(tmp_path / "tasks[1].jsonl", ROWS)
    assert [t["answer"] for t in experiment.load_tasks(path)] == [row["answer"] for row in ROWS]
    write_jsonl(tmp_path / "x1.jsonl", ROWS[:1])  # a path that is no file is a glob, as before
    assert len(experiment.load_tasks(f"{tmp_path}/x[0-9].jsonl")) == 1


@pytest.mark.parametrize("answer", [r"\frac{1}{2", "hello", r"\$3"])
def test_math_latex_answers_math_verify_cannot_read_are_refused(task_experiment, tmp_path, answer):
    """Such an answer was taken, and every completion then scored 0. The task's own files still load: all 40 of
    their answers are parsed in about 0.5 s on a 2-core AMD EPYC (0.40 s the 30 of math_latex.jsonl, the first parse
    included, 0.07 s the 10 held out), after math-verify's import (0.4 s)."""
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "q", "answer": r"\frac{1}{2}"}, {"question": "q", "answer": answer}])
    with pytest.raises(task_experiment.InputError, match=r"t.jsonl:2: field 'answer' .*math-verify"):
        task_experiment.load_tasks(path, task="math_latex")
    assert len(task_experiment.load_tasks(path, task="math")) == 2  # only math_latex's answers are LaTeX
    started = time.monotonic()
    count = sum(len(task_experiment.load_tasks(ROOT / "data" / name, task="math_latex"))
                for name in ("math_latex.jsonl", "math_latex_eval.jsonl"))
    assert count == 40 and time.monotonic() - started < 60  # a guard against a hang, not a speed test


MATH_VERIFY_REWARD = """import math_verify

def reward(completion, answer, metadata):
    return float(math_verify.verify(math_verify.parse(answer), math_verify.parse(completion)))
"""


def test_a_reward_fn_that_uses_math_verify_works(experiment, tmp_path, monkeypatch):
    """Reward functions ran in a worker thread, where math-verify's signal.alarm raises ValueError: every call failed."""
    name = f"mv_reward_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(MATH_VERIFY_REWARD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    function = tiny_grpo.rewards.load_reward_fn(f"{name}:reward", timeout=30)
    assert function(r"so it is $\frac{1}{2}$", "$0.5$", {}) == 1.0
    assert function("so it is $3$", "$0.5$", {}) == 0.0
    # the deadline holds, called in this thread, even when the function swallows the first TimeoutError and goes on
    name = f"stubborn_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text("import time\n\ndef reward(completion, answer, metadata):\n"
                                         "    for _ in range(3):\n        try:\n            time.sleep(20)\n"
                                         "        except Exception:\n            pass\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    function = tiny_grpo.rewards.load_reward_fn(f"{name}:reward", timeout=0.5)
    started = time.monotonic()
    with pytest.raises(tiny_grpo.errors.RewardError, match="TimeoutError: no result within 0.5 s"):
        function("c", "a", {})
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("table", [pyarrow.table({"question": pyarrow.array([], pyarrow.string()),
                                                  "answer": pyarrow.array([], pyarrow.string())}), pyarrow.table({})],
                         ids=["no-rows", "no-columns"])
def test_an_empty_parquet_file_has_no_tasks(experiment, tmp_path, table):
    pyarrow.parquet.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(experiment.InputError, match=r"t.parquet: no tasks$"):
        experiment.load_tasks(tmp_path / "t.parquet")


def test_a_json_column_of_numbers_and_strings_keeps_the_text(experiment, tmp_path):
    """datasets turns such a column into JSON text: the answer "7" became '"7"', quotes included."""
    rows = [{"question": "a", "answer": 7}, {"question": "b", "answer": "seven"}, {"question": "c", "answer": "7 \"ok\""},
            {"question": "d", "answer": 2.5}]
    (tmp_path / "t.json").write_text(json.dumps(rows))
    assert [t["answer"] for t in experiment.load_tasks(tmp_path / "t.json")] == ["7", "seven", '7 "ok"', "2.5"]


def test_filters_compare_values_as_written_and_show_what_a_column_holds(experiment, tmp_path):
    rows = [{"question": f"Q{i}", "answer": str(i), "flag": i % 2 == 0, "x": i / 4} for i in range(4)]
    path = write_parquet(tmp_path / "t.parquet", rows)
    assert [t["answer"] for t in experiment.load_tasks(path, filters=["flag=true"])] == ["0", "2"]
    assert [t["answer"] for t in experiment.load_tasks(path, filters=["x=0.5"])] == ["2"]
    assert [t["answer"] for t in experiment.load_tasks(path, filters=["flag=False", "x=0.25,.75"])] == ["1", "3"]
    with pytest.raises(experiment.InputError, match=r"t.parquet: no tasks after --filter x=2; x holds 0.0, 0.25, 0.5, 0.75"):
        experiment.load_tasks(path, filters=["x=2"])


def test_split_slices_work_on_a_local_hub_layout_folder(experiment, tmp_path):
    folder = WRITERS["hub layout"](tmp_path, ROWS)
    assert [t["answer"] for t in experiment.load_tasks(folder, split="train[:2]")] == ["2", "1/2 of 3 = 1.5"]
    assert [t["answer"] for t in experiment.load_tasks(folder, split="train[-1:]")] == ["007"]
    saved = write_saved(tmp_path / "saved", ROWS, splits=True)
    assert [t["answer"] for t in experiment.load_tasks(saved, split="train[1:2]")] == ["1/2 of 3 = 1.5"]


def test_a_parquet_file_with_a_duplicate_column_is_one_line(experiment, tmp_path, capfd):
    table = pyarrow.Table.from_arrays([pyarrow.array(["q"]), pyarrow.array(["1"]), pyarrow.array(["2"])],
                                      names=["question", "answer", "answer"])
    pyarrow.parquet.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(experiment.InputError, match=r"t.parquet: more than one column is named 'answer' \(columns 2 and 3\)") as error:
        experiment.load_tasks(tmp_path / "t.parquet")
    assert "\n" not in str(error.value)
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("value", [1e300, 1e-200])
def test_a_number_too_long_to_write_out_is_refused(experiment, tmp_path, value):
    """1e300 was taken as '1e+300' and scored as 300; written out it has 301 digits, more than the 100 that answers
    are read to, so no completion could match it."""
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "q", "answer": 2}, {"question": "q", "answer": value}])
    with pytest.raises(experiment.InputError, match=r"t.jsonl:2: field 'answer' is 1e[-+]\d+, \d+ characters written out"):
        experiment.load_tasks(path)


def test_a_math_verify_reward_fn_trains_with_task_math_latex(tiny_model_dir, tmp_path, monkeypatch):
    """--task math_latex with a --reward-fn that calls math-verify, as the task's own reward does: every call
    failed (a worker thread has no signal.alarm), so the run stopped at its first step. Now the steps run."""
    from conftest import load_experiment, tensorboard_scalars

    name = f"mv_run_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(MATH_VERIFY_REWARD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"Say {i}", "answer": r"\frac{1}{2}"} for i in range(4)])
    base = load_experiment("experiment_base")
    base.main([str(a) for a in ["--model-name", tiny_model_dir, "--device", "cpu", "--quantization", "none", "--dtype",
                                "float32", "--task", "math_latex", "--data-path", data, "--max-steps", "2",
                                "--group-size", "2", "--rollouts-per-step", "2", "--max-length", "4", "--eval-interval",
                                "0", "--log-dir", tmp_path / "runs", "--checkpoint-path", tmp_path / "out", "--run-name",
                                "r", "--reward-fn", f"{name}:reward", "--reward-fn-timeout", "30"]])
    assert len(tensorboard_scalars(tmp_path / "runs")["rollout/reward_custom"]) == 2


def test_a_folder_with_an_empty_or_doubled_parquet_shard_names_it(experiment, tmp_path):
    """datasets said 'BatchSize must be greater than 0' for an empty shard, 'Multiple matches for FieldRef' (and a
    page of log) for a column named twice, naming neither the file nor the column."""
    write_parquet(tmp_path / "data" / "train-00000-of-00002.parquet", ROWS)
    shard = tmp_path / "data" / "train-00001-of-00002.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"question": pyarrow.array([], pyarrow.string())}), shard)
    with pytest.raises(experiment.InputError, match=r"train-00001-of-00002.parquet: a parquet file with no rows"):
        experiment.load_tasks(tmp_path / "data")
    pyarrow.parquet.write_table(pyarrow.Table.from_arrays([pyarrow.array(["q"])] * 2, names=["question"] * 2), shard)
    with pytest.raises(experiment.InputError, match=r"train-00001-of-00002.parquet: more than one column is named 'question'"):
        experiment.load_tasks(tmp_path / "data")
