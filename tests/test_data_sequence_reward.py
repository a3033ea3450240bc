"""data/sequence_reward.py: --task sequence's reasoning reward, 0.5 for the true step said and 0.5 for the true last
addition, through train.py's --reward-fn on the committed data (whose rows hold their step)."""

import sys

import pytest
from conftest import ROOT, load_experiment

sys.path.insert(0, str(ROOT))
from data.sequence_reward import stated_step  # noqa: E402

STEP_4 = {"step": 4}  # 20, 24, 28, 32 -> 36


@pytest.mark.parametrize("reasoning, reward", [
    ("each number is 4 more than the one before; the last is 32, and 32 + 4 = 36", 1.0),
    ("each number is 4 more than the one before; the last is 32, and 4 + 32 = 36", 1.0),  # either order
    ("each number is 20 more than the one before; the last is 32, and 32 + 20 = 36", 0.0),  # the first term as step
    ("each number is 4 more than the one before; the last is 28, and 28 + 4 = 32", 0.5),  # a true sum, not the last
    ("each number is 4 more than the one before; the last is 32, and 32 + 4 = 38", 0.5),  # a false sum
    ("each number is 8 more than the one before; the last is 32, and 32 + 4 = 36", 0.5),  # the step said wrong
    ("each number is 4 more, or 8 more; 32 + 4 = 36", 0.5),  # two steps said: not the step
    ("20 + 4 = 24, 24 + 4 = 28, 28 + 4 = 32, 32 + 4 = 36", 0.5),  # the last addition counts, no step said
    ("the next is 36", 0.0),
])
def test_the_reward_pays_for_the_true_step_and_the_true_last_addition(reasoning, reward):
    assert stated_step(f"<think> {reasoning} </think> <answer> 36 </answer>", "36", STEP_4) == reward


def test_the_answer_block_is_not_reasoning():
    """A sum written in the answer is no reasoning: only the text before <answer> is read."""
    assert stated_step("<think> the next one </think> <answer> 32 + 4 = 36 </answer>", "36", STEP_4) == 0.0
    assert stated_step("<reasoning> each number is 4 more </reasoning> <answer> 36 </answer>", "36", STEP_4) == 0.5


def test_train_py_pays_it_on_every_committed_row_and_agrees_with_the_benchmarks_checker(monkeypatch):
    """Through experiment_base's Scorer (--reward-fn data.sequence_reward:stated_step, run from the repository's
    root, the step read from each row's metadata): the worked example's reasoning, written for each of the 500
    rows, earns 1; with a wrong step 0, with a wrong last term 0.5. learning.py's `faithful`, which reads the
    question instead, says the same of each completion: faithful exactly where the reward is 1."""
    from common import load_module

    faithful = load_module(ROOT / "benchmarks" / "learning.py").faithful
    base = load_experiment()
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_reward_fn appends the working directory
    score = base.Scorer("sequence", weights="correctness=1,format=0,reasoning=0,custom=0.5",
                        reward_fn="data.sequence_reward:stated_step")
    tasks = base.load_tasks("data/sequence.jsonl") + base.load_tasks("data/sequence_eval.jsonl")
    assert len(tasks) == 500
    completions, answers, metadata, questions = [], [], [], []
    for task in tasks:
        terms = [int(t) for t in task["question"].split(": ")[1].split(", ...")[0].split(", ")]
        step, last = terms[1] - terms[0], terms[-1]
        for said, summed in [(step, last), (step + 1, last), (step, last - step), (step, last + step)]:
            completions.append(f"<think> each number is {said} more than the one before; the last is {summed}, and "
                               f"{summed} + {said} = {summed + said} </think> <answer> {task['answer']} </answer>")
            answers.append(task["answer"])
            metadata.append(task["metadata"])
            questions.append(task["question"])
    rewards, terms = score(completions, answers, metadata)
    custom = terms["custom"].tolist()
    assert custom[0::4] == [1.0] * 500  # the true step and the true last addition
    assert max(custom[1::4]) == 0 and custom[2::4] == custom[3::4] == [0.5] * 500  # the step said, not the sum
    assert rewards.tolist()[0::4] == [1.5] * 500  # correctness 1 + 0.5 x 1
    assert [faithful(q, c) for q, c in zip(questions, completions)] == [c == 1.0 for c in custom]


@pytest.mark.parametrize("answer_block, reward", [("36", 1.0), ("it is 36", 1.0), ("38", 0.0), ("", 0.0)])
def test_the_bonus_pays_only_beside_a_right_answer(answer_block, reward):
    """stated_step_when_right: the same reasoning earns its 1 beside the right answer and 0 beside a wrong one, or
    none; a right answer with half the reasoning earns 0.5."""
    from data.sequence_reward import stated_step_when_right

    reasoning = "<think> each number is 4 more than the one before; the last is 32, and 32 + 4 = 36 </think>"
    assert stated_step_when_right(f"{reasoning} <answer> {answer_block} </answer>", "36", STEP_4) == reward
    assert stated_step_when_right(reasoning, "36", STEP_4) == 0.0  # no answer block at all
    assert stated_step_when_right("<think> each number is 4 more </think> <answer> 36 </answer>", "36", STEP_4) == 0.5
