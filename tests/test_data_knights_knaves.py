"""data/make_knights_knaves.py: the brute-force solver, the puzzles it keeps, and the files it writes."""

import json
import re

import pytest

from common import load_module
from conftest import ROOT, run_script

SCRIPT = ROOT / "data" / "make_knights_knaves.py"
kk = load_module(SCRIPT)

ANSWER_LINE = re.compile(r"\((\d+)\) ([A-Z][a-z]+) is a (knight|knave)")


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def parse_clause(text, index):
    """'Zoey is a knave or Ethan is a knight' -> ('or', ('knave', 1), ('knight', 2)): the test's own reading of
    the English, so a puzzle is checked as a reader sees it, not as the generator built it."""
    if text.startswith("It is not the case that "):
        return ("not", parse_clause(text.removeprefix("It is not the case that "), index))
    for word, kind in ((" if and only if ", "iff"), (" and ", "and"), (" or ", "or")):
        if word in text:
            first, second = text.split(word)
            return (kind, parse_clause(first, index), parse_clause(second, index))
    name, role = re.fullmatch(r"([A-Z][a-z]+) is a (knight|knave)", text).groups()
    return (role, index[name])


def parse_question(question):
    """(names, puzzle) read back from a question's text."""
    listed = re.search(r"You meet (\d+) inhabitants: (.*?)\. ", question)
    names = re.split(r", | and ", listed.group(2))
    assert len(names) == int(listed.group(1))
    said = re.findall(r'([A-Z][a-z]+) says, "([^"]*)\."', question)
    assert [speaker for speaker, _ in said] == names  # one statement each, in the order they were introduced
    index = {name: i for i, name in enumerate(names)}
    return names, [parse_clause(text, index) for _, text in said]


def answer_for(names, roles):
    return "\n".join(f"({i}) {name} is a {'knight' if knight else 'knave'}"
                     for i, (name, knight) in enumerate(zip(names, roles), start=1))


@pytest.mark.parametrize("puzzle, solutions", [
    # A: "B is a knave."  B: "A is a knave and B is a knave."  B cannot be a knight (he would call himself a
    # knave), so B lies, so A is a knight; A then tells the truth about B.
    ([("knave", 1), ("and", ("knave", 0), ("knave", 1))], [(True, False)]),
    # The docstring's example: Michael a knight, Zoey a knave, Ethan a knight.
    ([("or", ("knave", 1), ("knight", 2)), ("not", ("knight", 0)), ("iff", ("knave", 0), ("knight", 1))],
     [(True, False, True)]),
    # The same with Ethan: "Zoey is a knave iff Ethan is a knight": true whatever Ethan is, once Zoey is a knave.
    ([("or", ("knave", 1), ("knight", 2)), ("not", ("knight", 0)), ("iff", ("knave", 1), ("knight", 2))],
     [(True, False, True), (True, False, False)]),
    # A: "A is a knight."  B: "A is a knight."  Both knights or both knaves: two solutions.
    ([("knight", 0), ("knight", 0)], [(True, True), (False, False)]),
    # A: "A is a knave." No knight says it (false) and no knave says it (true): no solution.
    ([("knave", 0), ("knight", 1)], []),
    # A: "A is a knave or B is a knave."  B: "It is not the case that A is a knight."  A knave would speak the
    # truth ("A is a knave"), so A is a knight and B a knave, and B's statement is false, as a knave's must be.
    ([("or", ("knave", 0), ("knave", 1)), ("not", ("knight", 0))], [(True, False)]),
])
def test_solver_on_hand_written_puzzles(puzzle, solutions):
    assert sorted(kk.solve(puzzle)) == sorted(solutions)


def test_generated_puzzles_have_one_solution_that_is_the_answer(tmp_path):
    result = run_script(SCRIPT, "--out-dir", tmp_path, "--train-rows", 200, "--eval-rows", 30, "--seed", 3)
    assert result.returncode == 0, result.stderr
    rows = read_jsonl(tmp_path / "knights_knaves.jsonl") + read_jsonl(tmp_path / "knights_knaves_eval.jsonl")
    assert len(rows) == 230
    for row in rows:
        names, puzzle = parse_question(row["question"])
        assert names == row["names"] and len(names) == row["num_people"] == len(set(names))
        assert set(names) <= set(kk.NAMES)
        assert row["question"].endswith(" So who is a knight and who is a knave?")
        solutions = kk.solve(puzzle)
        assert len(solutions) == 1, row["question"]
        assert row["answer"] == answer_for(names, solutions[0]), row["question"]
        lines = row["answer"].split("\n")  # the format an answer parser relies on
        assert [ANSWER_LINE.fullmatch(line).group(1, 2) for line in lines] == \
               [(str(i), name) for i, name in enumerate(names, start=1)]
    assert {row["num_people"] for row in rows} == set(range(2, 9))


def test_people_range_is_respected(tmp_path):
    run_script(SCRIPT, "--out-dir", tmp_path, "--train-rows", 40, "--eval-rows", 10, "--min-people", 4,
               "--max-people", 5)
    rows = read_jsonl(tmp_path / "knights_knaves.jsonl")
    assert sorted(row["num_people"] for row in rows) == [4] * 20 + [5] * 20  # spread evenly


def test_same_seed_same_bytes_and_committed_files_are_the_defaults(tmp_path):
    small = ["--train-rows", 50, "--eval-rows", 10, "--seed", 7]
    for folder in ("a", "b", "c"):
        seed = ["--seed", 8] if folder == "c" else []
        assert run_script(SCRIPT, "--out-dir", tmp_path / folder, *small, *seed).returncode == 0
    for name in ("knights_knaves.jsonl", "knights_knaves_eval.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes(), name
    result = run_script(SCRIPT, "--out-dir", tmp_path / "defaults")
    assert result.returncode == 0, result.stderr
    for name in ("knights_knaves.jsonl", "knights_knaves_eval.jsonl"):  # the committed files are what the script writes
        assert (tmp_path / "defaults" / name).read_bytes() == (ROOT / "data" / name).read_bytes(), name


def test_committed_files_are_held_out_and_cover_every_people_count():
    train = read_jsonl(ROOT / "data" / "knights_knaves.jsonl")
    held_out = read_jsonl(ROOT / "data" / "knights_knaves_eval.jsonl")
    assert len(train) == 10_000 and len(held_out) == 500
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    assert len({r["question"] for r in train}) == len(train)
    for rows in (train, held_out):
        counts = [sum(r["num_people"] == n for r in rows) for n in range(2, 9)]
        assert min(counts) >= 1 and max(counts) - min(counts) <= 1, counts  # every count, evenly spread
        assert all(isinstance(r["question"], str) and isinstance(r["answer"], str) for r in rows)
    roles = "".join(r["answer"] for r in train)
    assert 0.4 < roles.count("knight") / (roles.count("knight") + roles.count("knave")) < 0.6  # not all knights


@pytest.mark.parametrize("argv, option", [
    (["--min-people", "1"], "--min-people"),
    (["--max-people", "9"], "--max-people"),
    (["--min-people", "6", "--max-people", "3"], "--min-people"),
    (["--train-rows", "-5"], "--train-rows"),
    (["--eval-rows", "-1"], "--eval-rows"),
])
def test_bad_arguments_name_the_option(argv, option, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        kk.main([*argv, "--out-dir", str(tmp_path)])
    assert stop.value.code not in (0, None)
    assert option in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_bad_arguments_from_the_command_line(tmp_path):
    result = run_script(SCRIPT, "--max-people", 12, "--out-dir", tmp_path)
    assert result.returncode != 0 and "--max-people must be between 2 and 8, got 12" in result.stderr
