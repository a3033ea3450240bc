"""tiny_grpo/skill.py (issue 77, "Learning that is real", items 2, 3 and 5): the guesses that need no skill and their
held-out scores (eval/baseline_*), the held-out sequences that no guess passes, and the checker of whether a
completion's reasoning computes its answer. Each test failed before: there was no such module, the held-out set let
the next multiple of 10 above the last term score 39%, and learning.py's checker refused reasoning written term by term."""

import json
from collections import Counter

import pytest
from conftest import ROOT, TASK_EXPERIMENTS, load_experiment, tensorboard_scalars, write_jsonl

from tiny_grpo.skill import baseline_scores, faithful, faithful_share, guesses, sequence_terms

# The untrained Gemma-3-270M's greedy accuracy on --task sequence's held-out set, which no guess that needs no skill may
# exceed, or a gain over the untrained model proves nothing: 18 of 100 (the evaluation at step 0 of the default
# command, bfloat16, AMD EPYC with AVX512-BF16, 2026-11-29; docs/results/learning.md). The best guess, the last term +
# the training's commonest step, is right on the 15 problems of that step; adding any other one step scores no more.
UNTRAINED_ACCURACY = 0.18

correctness = load_experiment().correctness  # experiment_base's own answer comparison, as its evaluation scores


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def rows(*pairs):
    return [{"question": question, "answer": answer} for question, answer in pairs]


def sequence(*terms):
    return f"What number comes next: {', '.join(map(str, terms))}, ...?"


# answers: 50 twice, the commonest; steps: 5 twice, the commonest
TRAIN = rows((sequence(2, 4, 6, 8), "10"), (sequence(10, 20, 30, 40), "50"), (sequence(5, 10, 15, 20), "25"),
             (sequence(30, 35, 40, 45), "50"))


def test_each_sequence_guess_on_a_hand_written_question():
    said = {name: guess(sequence(22, 24, 26, 28, 30)) for name, guess in guesses("sequence", TRAIN).items()}
    assert said == {"most_common": "50", "last_term": "30", "last_plus_one": "31", "next_ten": "40",
                    "last_plus_ten": "40", "last_plus_first": "52", "last_plus_common_step": "35"}
    assert guesses("sequence", TRAIN)["next_ten"](sequence(22, 24, 26, 28)) == "30"  # the next one above, not the nearest
    assert guesses("sequence", TRAIN)["last_term"]("What number comes next?") is None  # no terms: no guess


def test_the_baselines_score_each_guess_with_the_tasks_own_comparison():
    """Each hand-written held-out problem is right for the guesses noted; '50.0' is 50 (parse_number), as the
    experiment's evaluation reads it."""
    held_out = rows((sequence(3, 6, 9, 12), "15"),  # last_plus_first: 12 + 3
                    (sequence(11, 21, 31, 41), "51"),  # last_plus_ten
                    (sequence(46, 47, 48, 49), "50.0"),  # most_common, next_ten, last_plus_one
                    (sequence(7, 12, 17, 22), "27"))  # last_plus_common_step: 22 + 5
    scores = baseline_scores("sequence", TRAIN, held_out, correctness)
    assert scores == {"eval/baseline_most_common": 0.25, "eval/baseline_last_term": 0.0, "eval/baseline_last_plus_one": 0.25,
                      "eval/baseline_next_ten": 0.25, "eval/baseline_last_plus_ten": 0.25,
                      "eval/baseline_last_plus_first": 0.25, "eval/baseline_last_plus_common_step": 0.25}
    assert baseline_scores("sequence", TRAIN, [], correctness) == {}  # no held-out rows: nothing to report


def test_the_other_tasks_guesses_are_compared_their_own_way():
    count = 'How many words are in this sentence: "{}"?'
    train = rows((count.format("a b c d"), "four"), (count.format("a b c"), "3"), (count.format("w x y z"), "four"))
    held_out = rows((count.format("the dog ran home"), "4"), (count.format("we saw a bird"), "4"), (count.format("she sat"), "2"))
    assert baseline_scores("count_words", train, held_out, correctness) == {"eval/baseline_most_common": 2 / 3}  # "four" is 4

    latex = rows(("What is 1/4 + 1/4?", "\\frac{1}{2}"), ("What is 3/6?", "\\frac{1}{2}"), ("What is 1 + 1?", "2"))
    held_out = rows(("What is 0.25 * 2?", "0.5"), ("What is 2/3 + 1/3?", "1"))
    assert baseline_scores("math_latex", latex, held_out, correctness) == {"eval/baseline_most_common": 0.5}  # math-verify

    puzzle = 'Zoey says, "Ethan is a knight." Ethan says, "Zoey is a knight." So who is a knight and who is a knave?'
    held_out = rows((puzzle, "(1) Zoey is a knight\n(2) Ethan is a knight"))
    assert guesses("knights_knaves", held_out)["all_knaves"](puzzle) == "(1) Zoey is a knave (2) Ethan is a knave"
    assert baseline_scores("knights_knaves", held_out, held_out, correctness) == {"eval/baseline_all_knights": 1.0,
                                                                                 "eval/baseline_all_knaves": 0.0}

    math = rows(("What is 2 + 3?", "5"), ("What is 1 + 4?", "5"), ("What is 9 - 2?", "7"))
    assert baseline_scores("math", math, rows(("What is 6 - 1?", "5"), ("What is 3 * 3?", "9")), correctness) == {
        "eval/baseline_most_common": 0.5}


def test_no_guess_passes_the_sequence_held_out_set():
    """Item 2: on data/sequence_eval.jsonl each guess scores at most the untrained model's accuracy: the last term plus
    any one step (each step on 14 or 15 problems in 100), any one answer (3 at most), and every named guess. On the
    training rows, drawn from every question, the next multiple of 10 is right 11.5 times in 100."""
    train, held_out = read_jsonl(ROOT / "data" / "sequence.jsonl"), read_jsonl(ROOT / "data" / "sequence_eval.jsonl")
    scores = baseline_scores("sequence", train, held_out, correctness)
    assert len(scores) == 7 and max(scores.values()) <= UNTRAINED_ACCURACY, scores
    assert scores == {"eval/baseline_last_plus_common_step": 0.15, **{name: 0.0 for name in scores if "common_step" not in name}}
    steps = Counter(terms[1] - terms[0] for terms in (sequence_terms(row["question"]) for row in held_out))
    assert max(steps.values()) / len(held_out) <= UNTRAINED_ACCURACY, steps.most_common(3)
    answers = Counter(int(row["answer"]) for row in held_out)
    assert max(answers.values()) / len(held_out) <= 0.03, answers.most_common(3)
    assert baseline_scores("sequence", train, train, correctness) == {
        "eval/baseline_most_common": 0.025, "eval/baseline_last_term": 0.0, "eval/baseline_last_plus_one": 0.0,
        "eval/baseline_next_ten": 0.115, "eval/baseline_last_plus_ten": 0.0, "eval/baseline_last_plus_first": 0.0175,
        "eval/baseline_last_plus_common_step": 0.16}


Q = sequence(20, 24, 28, 32)


@pytest.mark.parametrize("question, reasoning, answer, computed", [
    # (a) the rule: the step stated, added to the last term, the sum true, in any wording around it
    (Q, "each number is 4 more than the one before; the last is 32, and 32 + 4 = 36", "36", True),
    (Q, "each number is 4 more than the one before; the last is 32, and 4 + 32 = 36", "36", True),
    (Q, "the difference is 4; 32 + 4 is 36", "36", True),
    (Q, "it goes up by 4: 32 + 4 = 36", "36", True),
    (Q, "24 - 20 = 4, so 32 + 4 = 36", "36", True),  # the step shown by two neighbouring terms
    (Q, "20 + 4 = 24, 24 + 4 = 28, 28 + 4 = 32, 32 + 4 = 36", "36", True),
    (Q, "the last is 32, and 32 + 4 = 36", "36", False),  # no step stated: where did the 4 come from?
    (Q, "counting by 2: 32 + 4 = 36", "36", False),  # the step stated is another
    (Q, "each number is 20 more than the one before; the last is 32, and 32 + 20 = 36", "36", False),  # a false sum
    (Q, "each number is 4 more than the one before; the last is 28, and 28 + 4 = 32", "36", False),  # never reaches 36
    (Q, "each number is 4 more than the one before; the last is 32, and 32 + 4 = 38", "38", False),
    (Q, "each number is 4 more; 32 + 4 = 36 = 38", "36", False),  # a false chain
    (Q, "the next is 36", "36", False),
    (sequence(22, 24, 26, 28, 30), "each number is 22 more than the one before; the last is 30, and 22 + 22 = 32",
     "32", False),  # the issue's: the first term as the step, a false sum, a right answer
    # (b) the terms written on, each right, through the answer
    (Q, "20, 24, 28, 32, 36", "36", True),
    (sequence(42, 45, 48, 51), "42,45,48,51,54,57", "54", True),  # the issue's: one term past the answer counts
    (Q, "each number is 7 more than the one before; the last is 32, 36, 40", "36", True),  # a list is its own rule
    (Q, "20, 24, 28, 32, 36, 41", "36", False),  # a wrong term past the answer
    (Q, "32, 36", "36", False),  # two numbers show no step
    (Q, "20, 24, 28, 32, 36", "40", False),  # the answer is not the term after the last
    (Q, "28, 30, 32, 34", "34", False),  # counting by 2 from the right last term
    (Q, "20, 24, 28, 32, 36 and 2.5 + 1 = 4", "36", True),  # a decimal is not read as two numbers
])
def test_the_checker_says_whether_the_reasoning_computes_the_answer(question, reasoning, answer, computed):
    assert faithful("sequence", question, f"<think> {reasoning} </think> <answer> {answer} </answer>") is computed


@pytest.mark.parametrize("completion", [
    " 36, 40, 44, 48, 52 </think> <answer> 52 </answer>",  # benchmarks/results' wordings, answers right
    " each number is 8 more than the one before; the last is 44, 48, 52, 56, ...<think> <answer> 52 </answer>",
    "each number is 4 more than the one before; the last is 48, and 48 + 4 = 52</think> <answer>52</answer>",
])
def test_the_runs_reasoning_that_computes(completion):
    assert faithful("sequence", sequence(36, 40, 44, 48), completion) is True


@pytest.mark.parametrize("completion", [
    " each number is 7 more than the one before; the last is 48, and 48 + 7 = 52 </think> <answer> 52 </answer>",
    " each number is 48, and 48 + 36 = 52 </think> <answer> 52 </answer>",
    " 44 </think> <answer> 52 </answer>",
    " each number is 4 more than the one before; the last is 48, and 48 + 4 = 52",  # no answer at all
    " 36, 40, 44, 48, 52 </think> <answer> 52.5 </answer>",
])
def test_the_runs_reasoning_that_does_not(completion):
    assert faithful("sequence", sequence(36, 40, 44, 48), completion) is False


def test_where_reasoning_cannot_be_checked_the_checker_says_so():
    for task in ("math", "count_words", "knights_knaves", "gsm8k", "math_latex"):
        assert faithful(task, "What is 3 + 4?", "<think> 3 + 4 = 7 </think> <answer> 7 </answer>") is None
    assert faithful("sequence", "What number comes next: 1, 2, 4, 8, ...?", "<answer> 16 </answer>") is None
    assert faithful("sequence", "What number comes next?", "<answer> 16 </answer>") is None


def test_a_number_int_cannot_read_is_no_number():
    """int() refuses 4,300 digits and more, and "²" (a digit to str.isdigit): such a number in a completion or a
    question is no term, not a crash."""
    assert faithful("sequence", Q, "² + 1 = 3. 20, 24, 28, 32, 36 </think> <answer>36</answer>") is True
    huge = "9" * 5000
    assert faithful("sequence", Q, f"{huge} more; by {huge}; {huge} + 1 = {huge}, 20, 24, 28, 32, 36 <answer>36</answer>")
    assert faithful("sequence", sequence(1, 2, huge), "<answer> 3 </answer>") is None
    assert guesses("sequence", TRAIN)["last_term"](sequence(1, huge)) is None


def test_learning_py_reads_the_samples_with_the_packages_checker():
    """benchmarks/learning.py's `faithful` refused the sequence written on (issue 77: 47 of 50 right answers of a seed)."""
    from common import load_module

    learning = load_module(ROOT / "benchmarks" / "learning.py")
    assert learning.faithful(sequence(42, 45, 48, 51), "42,45,48,51,54,57 </think> <answer>54</answer>") is True
    assert learning.faithful("What is 3 + 4?", "<answer> 7 </answer>", "math") is None


# ---- the evaluation: eval/baseline_*, eval/faithful, the closing line, the rollout log and the page ----

# The held-out answers a trained model might give to 3, 5, 7, 9 -> 11 and 4, 9, 14, 19 -> 24: one right and computed,
# one right behind a false sum, and a wrong one. The tiny test model answers nothing right, so the run's evaluation is
# given these texts and scores them with the experiment's own Scorer; everything after (Bookkeeping, TensorBoard, the
# rollout log, the closing line) is the run's own.
HELD_OUT = rows((sequence(3, 5, 7, 9), "11"), (sequence(4, 9, 14, 19), "24"), (sequence(7, 10, 13, 16), "19"))
ANSWERS = ["<think> each number is 2 more: 9 + 2 = 11 </think> <answer> 11 </answer>",
           "<think> each number is 4 more, 19 + 4 = 24 </think> <answer> 24 </answer>",
           "<think> 16 </think> <answer> 16 </answer>"]


@pytest.mark.parametrize("name", TASK_EXPERIMENTS)
def test_each_evaluation_logs_the_guesses_and_the_share_of_computed_answers(name, tiny_model_dir, tmp_path,
                                                                              monkeypatch, capsys):
    module = load_experiment(name)
    real_evaluate = module.evaluate

    def evaluate(model, tokenizer, tasks, args, score):
        metrics, result = real_evaluate(model, tokenizer, tasks, args, score)  # the model's own, then these texts
        result.completions = ANSWERS[:len(tasks)]
        _, result.terms = score(result.completions, [t["answer"] for t in tasks], [None] * len(tasks))
        return {"eval/accuracy": (result.terms["correctness"] == 1).float().mean().item()}, result

    monkeypatch.setattr(module, "evaluate", evaluate)
    train, held_out = write_jsonl(tmp_path / "train.jsonl", TRAIN), write_jsonl(tmp_path / "eval.jsonl", HELD_OUT)
    module.main([str(a) for a in [
        "--model-name", tiny_model_dir, "--device", "cpu", "--dtype", "float32", "--quantization", "none",
        "--task", "sequence", "--data-path", train, "--eval-data-path", held_out, "--eval-prompts", "3",
        "--eval-interval", "1", "--max-steps", "1", "--group-size", "2", "--rollouts-per-step", "2", "--max-length", "6",
        "--run-name", "r", "--log-dir", tmp_path / "runs", "--checkpoint-path", tmp_path / "out"]])
    expected = baseline_scores("sequence", TRAIN, HELD_OUT, correctness)
    assert expected["eval/baseline_last_plus_common_step"] == 1 / 3  # 19 + 5: the training's commonest step
    assert max(expected.values()) == 1 / 3 and sum(expected.values()) == 1 / 3
    scalars = tensorboard_scalars(tmp_path / "runs")
    for tag, value in {**expected, "eval/accuracy": 2 / 3, "eval/faithful": 1 / 2}.items():
        assert [s for s, _ in scalars[tag]] == [0, 1] and all(v == pytest.approx(value) for _, v in scalars[tag]), tag
    closing = capsys.readouterr().out.strip().splitlines()[-1]
    assert closing.endswith("the best guess without the skill (last_plus_common_step) 33%; 50% of the right answers "
                            "computed by their reasoning"), closing
    log = [json.loads(line) for line in (tmp_path / "runs" / "r" / "rollouts.jsonl").read_text().splitlines()]
    evals = [r for r in log if r["kind"] == "eval"]
    assert [[c["faithful"] for c in r["completions"]] for r in evals] == [[True, False, False]] * 2


def test_the_faithful_share_counts_right_answers_only_and_only_where_a_checker_exists():
    questions = [{"question": row["question"]} for row in HELD_OUT]
    assert faithful_share("sequence", questions, ANSWERS, [True, False, False]) == {"eval/faithful": 1.0}
    assert faithful_share("sequence", questions, ANSWERS, [True, True, False]) == {"eval/faithful": 0.5}
    assert faithful_share("sequence", questions, ANSWERS, [False] * 3) == {}
    assert faithful_share("count_words", [{"question": "How many words: 'a b'?"}], ["<answer> 2 </answer>"], [True]) == {}
