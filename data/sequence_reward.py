"""A reasoning reward for --task sequence, for train.py's --reward-fn: does the reasoning say why the answer is right?

    python experiment_base/train.py --task sequence --reward-fn data.sequence_reward:stated_step \
        --reward-weights correctness=1,format=0,reasoning=0,custom=0.5

(run from the repository's root, where `data` is found). Each row of data/sequence.jsonl holds its step
("step": 5 for 15, 20, 25, 30), which train.py passes here in `metadata`. The term is

    0.5  the reasoning names the step, "each number is 5 more" (the worked example's words), and names no other
  + 0.5  its last addition is the last term plus the step, summed right: "30 + 5 = 35" (either order)

so a right answer reached by a wrong step and a false sum ("each number is 8 more ... 28 + 8 = 35") earns
correctness alone. `stated_step_when_right` pays the same only where the answer is right (a bonus among right
answers: a wrong answer earns 0 however it reasons), so the groups still differ first by correctness.
tiny_grpo/skill.py's `faithful` measures the same property (and also accepts the sequence written on, term by
term, to the answer), reading the question rather than this field. Both were trained on seed 42, with the default worked example (EPYC, float32) and
with one that writes the sequence out (Sapphire Rapids, bfloat16); no run kept the step: README, "Does it learn?".
"""

import re


def stated_step(completion, answer, metadata):
    """0, 0.5 or 1: the true step said, and the true last addition (see the module's docstring)."""
    step = int(metadata["step"])
    last = int(answer) - step  # the sequence's last term: answer = last + step
    reasoning = completion.split("<answer>")[0]
    steps_said = {int(n) for n in re.findall(r"(-?\d+)\s+more\b", reasoning)}
    additions = re.findall(r"(-?\d+)\s*\+\s*(-?\d+)\s*=\s*(-?\d+)", reasoning)
    step_term = 0.5 if steps_said == {step} else 0.0
    if not additions:
        return step_term
    a, b, total = map(int, additions[-1])
    return step_term + (0.5 if {a, b} == {last, step} and a + b == total else 0.0)


def stated_step_when_right(completion, answer, metadata):
    """stated_step where the answer (the last number in <answer>...</answer>) is the right one, else 0."""
    said = re.findall(r"-?\d+", completion.split("<answer>")[-1].split("</answer>")[0]) if "<answer>" in completion else []
    return stated_step(completion, answer, metadata) if said and int(said[-1]) == int(answer) else 0.0
