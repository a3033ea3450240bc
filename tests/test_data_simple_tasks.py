"""data/make_simple_tasks.py: one-step tasks of seven kinds, each answer checked by an oracle of the test's own."""

import json
import re
from collections import Counter

import pytest
from conftest import ROOT, load_experiment, run_script

SCRIPT = ROOT / "data" / "make_simple_tasks.py"
FACTORS = {("minutes", "hours"): 60, ("hours", "days"): 24, ("days", "weeks"): 7, ("months", "years"): 12,
           ("centimeters", "meters"): 100, ("grams", "kilograms"): 1000, ("seconds", "minutes"): 60,
           ("eggs", "dozens"): 12}


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def oracle(kind, question):
    """The answer, worked out from the question's words alone."""
    numbers = [int(n) for n in re.findall(r"\d+", question)]
    if kind == "word_problem":
        if "more" in question:
            return numbers[0] + numbers[1]
        if "gives away" in question:
            return numbers[0] - numbers[1]
        return numbers[0] * numbers[1]  # A bags with B in each
    if kind == "compare":
        return max(numbers)
    if kind == "count_letters":
        letter, word = re.findall(r'"(\w+)"', question)
        return word.count(letter)
    if kind == "count_words":
        return len(re.search(r'"(.*)"', question)[1].split())
    if kind in ("next_number", "sequence"):
        assert len({b - a for a, b in zip(numbers, numbers[1:])}) == 1  # an arithmetic sequence
        return numbers[-1] + numbers[1] - numbers[0]
    small, big = re.fullmatch(r"How many (\w+) are in \d+ (\w+)\?", question).groups()
    return numbers[0] * FACTORS[small, big]


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    """The six-kind mix as the script writes it by default (not committed: no task reads it)."""
    folder = tmp_path_factory.mktemp("simple")
    result = run_script(SCRIPT, "--out-dir", folder)
    assert result.returncode == 0, result.stderr
    return folder


def test_simple_tasks_are_reproducible_and_held_out(mix, tmp_path):
    result = run_script(SCRIPT, "--out-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ("simple_tasks.jsonl", "simple_tasks_eval.jsonl"):  # the same seed, the same bytes
        assert (tmp_path / name).read_bytes() == (mix / name).read_bytes(), name
    train, held_out = read_jsonl(tmp_path / "simple_tasks.jsonl"), read_jsonl(tmp_path / "simple_tasks_eval.jsonl")
    assert (len(train), len(held_out)) == (1_500, 900)
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    assert len({r["question"] for r in train}) == len(train)


def test_every_answer_is_right_and_every_kind_is_there(mix):
    rows = read_jsonl(mix / "simple_tasks.jsonl") + read_jsonl(mix / "simple_tasks_eval.jsonl")
    kinds = {}
    for row in rows:
        assert int(row["answer"]) == oracle(row["kind"], row["question"]), row
        kinds[row["kind"]] = kinds.get(row["kind"], 0) + 1
    assert set(kinds) == {"word_problem", "compare", "count_letters", "count_words", "next_number", "unit_conversion"}
    assert min(kinds.values()) >= 150  # enough of each kind for a held-out measurement of 100 problems


def test_a_seed_changes_the_tasks(mix, tmp_path):
    run_script(SCRIPT, "--out-dir", tmp_path, "--seed", "1", "--train-rows", "50", "--eval-rows", "10")
    assert read_jsonl(tmp_path / "simple_tasks.jsonl")[:5] != read_jsonl(mix / "simple_tasks.jsonl")[:5]
    assert len(read_jsonl(tmp_path / "simple_tasks.jsonl")) == 50


def one_kind(tmp_path, kind, train_rows, eval_rows):
    """Run --kind KIND; check it writes the committed data/KIND*.jsonl, held out, every answer right by the
    oracle. Returns (training rows, held-out rows)."""
    result = run_script(SCRIPT, "--kind", kind, "--train-rows", train_rows, "--eval-rows", eval_rows, "--out-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    for name in (f"{kind}.jsonl", f"{kind}_eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (ROOT / "data" / name).read_bytes(), name
    train, held_out = read_jsonl(tmp_path / f"{kind}.jsonl"), read_jsonl(tmp_path / f"{kind}_eval.jsonl")
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    for row in train + held_out:
        assert row["kind"] == kind and int(row["answer"]) == oracle(kind, row["question"]), row
    return train, held_out


def test_count_words_task_is_one_kind_reproducible_and_held_out(tmp_path):
    """--kind count_words writes the files of experiment_base's --task count_words."""
    _, held_out = one_kind(tmp_path, "count_words", "2000", "500")
    assert {r["answer"] for r in held_out} == {str(n) for n in range(3, 9)}  # every length, 3 to 8 words


def terms(question):
    return [int(n) for n in re.findall(r"\d+", question)]


def test_sequence_task_counts_by_seven_steps_and_holds_out_what_no_guess_passes(tmp_path):
    """--kind sequence writes the files of --task sequence, experiment_base's CPU default: counting by 2, 3, 4, 5, 6, 8
    or 9 (never 7, the worked example's, nor 10), from a first term of 1 to 60, 4 or 5 terms. Held out (issue 77):
    each step on 14 or 15 of 100 problems, a first term that is no multiple of the step (so never the step itself), no
    answer a multiple of 10, none more than 3 times; no held-out question among the training rows. Each row holds its
    step; the held-out rows do not depend on how many training rows are drawn."""
    train, held_out = one_kind(tmp_path, "sequence", "400", "100")
    example = terms(load_experiment().TASKS["sequence"].question)
    assert example[1] - example[0] == 7
    for row in train + held_out:
        numbers = terms(row["question"])
        step = numbers[1] - numbers[0]
        assert step in (2, 3, 4, 5, 6, 8, 9) and 1 <= numbers[0] <= 60 and len(numbers) in (4, 5), row
        assert row["step"] == step, row  # data/sequence_reward.py's metadata
    steps = Counter()
    for row in held_out:
        numbers = terms(row["question"])
        step = numbers[1] - numbers[0]
        assert numbers[0] % step and int(row["answer"]) % 10, row
        steps[step] += 1
    assert len(steps) == 7 and set(steps.values()) == {14, 15}
    assert max(Counter(row["answer"] for row in held_out).values()) <= 3
    assert len({row["question"] for row in train}) == 400
    other = run_script(SCRIPT, "--kind", "sequence", "--train-rows", "30", "--eval-rows", "100", "--out-dir", tmp_path / "b")
    assert other.returncode == 0, other.stderr  # the held-out rows do not depend on the training rows' number
    assert (tmp_path / "b" / "sequence_eval.jsonl").read_bytes() == (ROOT / "data" / "sequence_eval.jsonl").read_bytes()


@pytest.mark.parametrize("option, rows, said", [
    ("--train-rows", "741", "--train-rows 741: --kind sequence has 740 distinct training questions beside the 100 held "
                            "out; give at most that"),
    ("--eval-rows", "421", "--eval-rows 421: --kind sequence has 420 distinct held-out questions; give at most that"),
])
def test_more_sequence_rows_than_questions_are_refused(tmp_path, option, rows, said):
    sizes = {"--train-rows": "100", "--eval-rows": "100", option: rows}
    result = run_script(SCRIPT, "--kind", "sequence", *[x for pair in sizes.items() for x in pair], "--out-dir", tmp_path)
    assert result.returncode == 2 and said in result.stderr and not list(tmp_path.iterdir())


def test_a_bad_kind_is_refused(tmp_path):
    result = run_script(SCRIPT, "--kind", "riddles", "--out-dir", tmp_path)
    assert result.returncode == 2 and "--kind: invalid choice: 'riddles'" in result.stderr
