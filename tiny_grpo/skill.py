"""Skill or guess? The answers that need no skill, scored on held-out rows (`baseline_scores`: the evaluation's
eval/baseline_*), and whether a completion's reasoning computes its answer (`faithful`): DESIGN.md, "What counts as
learning". A gain is the skill only where it beats every guess and the right answers' reasoning computes them.

The guesses of each task (none looks at the answer; each reads the question and the training rows at most):
  every task but knights_knaves  most_common            the most common training answer, whatever the question
  sequence                       last_term              the last term repeated
                                 last_plus_one          the last term + 1
                                 next_ten               the next multiple of 10 above the last term
                                 last_plus_ten          the last term + 10
                                 last_plus_first        the last term + the first (the first term taken for the step:
                                                        "each number is 22 more" for 22, 24, 26, 28, 30)
                                 last_plus_common_step  the last term + the training questions' most common step
  knights_knaves                 all_knights, all_knaves  every speaker given the same role
The runs' guesses on --task sequence were the last term, the last + 1, the last + 10 and round numbers
(benchmarks/results/learning_*.json). The last + any other fixed step is no function here: data/make_simple_tasks.py
gives no held-out problem the worked example's step (7), and each of its seven steps 14 or 15 problems in 100:
adding any one step scores at most 15%, below the untrained model's 18%.
"""

import re
from collections import Counter

from tiny_grpo.answers import parse_number

def guesses(task, train_rows):
    """{name: guess(question) -> answer text, or None where the question is not of the task's form}, for --task
    `task` and its training rows [{"question", "answer", ...}] (the module's docstring lists them)."""
    found = {}
    if task != "knights_knaves" and train_rows:  # its answers name each puzzle's own people: no answer repeats
        answer = most_common([row["answer"] for row in train_rows])
        found["most_common"] = lambda question: answer
    if task == "sequence":
        found.update(sequence_guesses(train_rows))
    if task == "knights_knaves":
        found["all_knights"] = lambda question: same_role(question, "knight")
        found["all_knaves"] = lambda question: same_role(question, "knave")
    return found

def baseline_scores(task, train_rows, eval_rows, correctness):
    """{"eval/baseline_NAME": the share of eval_rows that the guess NAME answers right}. correctness(completion,
    answer, task) is the experiment's own comparison (train.py's `correctness`, 1 when right): each guess is given
    to it as the completion "<answer> GUESS </answer>". No held-out rows: no scores."""
    if not eval_rows:
        return {}
    scores = {}
    for name, guess in guesses(task, train_rows).items():
        said = [guess(row["question"]) for row in eval_rows]
        right = sum(text is not None and correctness(f"<answer> {text} </answer>", row["answer"], task) == 1
                    for text, row in zip(said, eval_rows))
        scores[f"eval/baseline_{name}"] = right / len(eval_rows)
    return scores

def most_common(values):
    """The most common value; among equals, the first seen."""
    return Counter(values).most_common(1)[0][0]

# ---- --task sequence: "What number comes next: 17, 21, 25, 29, ...?" ----

def sequence_terms(question):
    """The terms a sequence question shows, after its last colon: [17, 21, 25, 29]; [] if one has over DIGITS digits."""
    numbers = re.findall(r"-?\d+", question.rpartition(":")[2])
    return [int(n) for n in numbers] if all(len(n) <= DIGITS + 1 for n in numbers) else []

def sequence_guesses(train_rows):
    steps = [terms[1] - terms[0] for terms in map(sequence_terms, (row["question"] for row in train_rows)) if len(terms) > 1]
    rules = {"last_term": lambda t: t[-1], "last_plus_one": lambda t: t[-1] + 1,
             "next_ten": lambda t: t[-1] // 10 * 10 + 10, "last_plus_ten": lambda t: t[-1] + 10,
             "last_plus_first": lambda t: t[-1] + t[0]}
    if steps:
        step = most_common(steps)
        rules["last_plus_common_step"] = lambda t: t[-1] + step
    return {name: on_terms(rule) for name, rule in rules.items()}

def on_terms(rule):
    """A guess of a question from its terms by rule(terms); None for a question with fewer than two terms."""
    def guess(question):
        terms = sequence_terms(question)
        return str(rule(terms)) if len(terms) > 1 else None
    return guess

# ---- --task knights_knaves ----

def same_role(question, role):
    """'(1) Zoey is a knight (2) Ethan is a knight': each speaker, in the order they first speak, given role."""
    names = list(dict.fromkeys(re.findall(r"\b([A-Z][a-z]+) says\b", question)))
    return " ".join(f"({i}) {name} is a {role}" for i, name in enumerate(names, 1)) or None

# ---- Does the reasoning compute the answer? ----

def faithful_share(task, rows, completions, right):
    """{"eval/faithful": the share of the right answers (right: a bool per completion) whose reasoning computes them},
    where the task's reasoning can be checked and an answer was right; else {}."""
    checked = [faithful(task, row.get("question", ""), text) for row, text, ok in zip(rows, completions, right) if ok]
    checked = [c for c in checked if c is not None]
    return {"eval/faithful": sum(checked) / len(checked)} if checked else {}

def faithful(task, question, completion):
    """True when the completion's reasoning (its text before the first <answer>) computes the answer in its last
    <answer> tags, False when it does not, None where the task's reasoning cannot be checked soundly (every task
    but sequence, and a sequence question whose terms are no arithmetic sequence). See faithful_sequence."""
    if task != "sequence":
        return None
    terms = sequence_terms(question)
    if len(terms) < 3 or len({b - a for a, b in zip(terms, terms[1:])}) != 1:
        return None
    found = re.findall(r"<answer>(.*?)</answer>", completion, re.DOTALL)
    answer = parse_number(found[-1]) if found else None
    if answer is None or answer.denominator != 1:
        return False
    return faithful_sequence(terms, completion.split("<answer>")[0], int(answer))

# a number (decimals whole, so that 2.5 is never read as 2 and 5); a word; any other sign (+ - = , ...). isdecimal(),
# not isdigit(), says which is a number: "²" is a digit that int() refuses
TOKEN = re.compile(r"\d+(?:\.\d+)?|[A-Za-z]+|\S")
DIGITS = 100  # a longer number is no term of a question here (and int() refuses one of 4,300 digits)

EQUALS = ("=", "is", "equals")

def tokens_of(text):
    """TOKEN's pieces of the text, a number of more than DIGITS digits made "#" (no number)."""
    return ["#" if token[0].isdecimal() and len(token) > DIGITS else token for token in TOKEN.findall(text)]

def faithful_sequence(terms, reasoning, answer):
    """Whether the reasoning computes `answer`, the term after `terms`, whatever its wording. Every sum or difference
    it writes must be true ("a + b = c", "a - b = c", chains "a + b = c = d", "is" or "equals" for "="), and either
      (a) the rule: it states the step d (the question's), and no other step, and adds it to the last term:
          "each number is 4 more ...; 32 + 4 = 36". A step is stated as "4 more", "by 4" ("counting by 4", "goes up
          by 4", not "divisible by 4"), "plus 4", "add 4", "the difference/step/gap is 4", "4 fewer" (a step of -4),
          or shown by two of the question's neighbouring terms: "24 - 20 = 4", "20 + 4 = 24"; or
      (b) the terms written on: a list (numbers apart by commas, semicolons or spaces alone) of at least three
          numbers, each d more than the one before, in which the last term is followed by the answer:
          "36, 40, 44, 48, 52". A list that runs on past the answer counts, each of its terms right ("42,45,48,51,54,57"
          then 54 for 42, 45, 48, 51); one wrong term anywhere in it does not. A list is its own rule: a step said
          in words beside it is not read (the runs write the worked example's "7 more" before a right list).
    True means the answer is right: a wrong answer is computed by no true reasoning of either kind."""
    step, last = terms[1] - terms[0], terms[-1]
    if answer != last + step:
        return False
    tokens = tokens_of(reasoning)
    equations = list(sums(tokens))
    if any(total != value for _, _, total, value in equations):
        return False
    applied = any(signs == ["+"] and sorted(operands) == sorted([last, step]) and value == answer
                  for operands, signs, _, value in equations)
    shown = {shown_step(operands, signs, terms) for operands, signs, _, _ in equations} - {None}
    return (applied and (stated_steps(reasoning) | shown) == {step}) or written_on(tokens, step, last)

def sums(tokens):
    """(operands, signs, their true total, a value it is said to equal) for each "a + b - c = d (= e ...)"."""
    i = 0
    while i < len(tokens):
        j, operands, signs, values = i + 1, [tokens[i]], [], []
        while j + 1 < len(tokens) and tokens[j] in ("+", "-") and tokens[j + 1].isdecimal():
            signs.append(tokens[j])
            operands.append(tokens[j + 1])
            j += 2
        while signs and j + 1 < len(tokens) and tokens[j].lower() in EQUALS and tokens[j + 1].isdecimal():
            values.append(int(tokens[j + 1]))
            j += 2
        if tokens[i].isdecimal() and values:
            numbers = [int(n) for n in operands]
            total = numbers[0] + sum(n if sign == "+" else -n for sign, n in zip(signs, numbers[1:]))
            yield from ((numbers, signs, total, value) for value in values)
            i = j - 1  # its last value may begin the next sum: "20 + 4 = 24 + 4 = 28" is two
        else:
            i = max(i + 1, j - 1) if signs and not values else i + 1  # a sum with no "=" holds none: skip it whole

def shown_step(operands, signs, terms):
    """The step a sum shows between two neighbouring terms of the question ("24 - 20" or "20 + 4" = 24: 4), or None."""
    pairs = set(zip(terms, terms[1:]))
    if len(operands) != 2:
        return None
    a, b = operands
    if signs == ["-"]:
        return a - b if (b, a) in pairs else None
    return b if (a, a + b) in pairs else a if (b, a + b) in pairs else None

N = rf"(\d{{1,{DIGITS}}})"  # a number, captured: no longer one (the patterns' guards stop it matching a tail of one)
STEP_SAID = [(re.compile(pattern, re.IGNORECASE), sign) for pattern, sign in [
    (rf"(?<![\d.]){N}\s+more\b", 1),  # "each number is 4 more"
    (rf"(?<!divisible )(?<!divided )(?<!multiplied )(?<!times )\bby\s+{N}(?![\d.])", 1),  # "counting by 4"
    (rf"\b(?:plus|add|adds|adding|added)\s+{N}(?![\d.])", 1),
    (rf"\b(?:difference|step|gap|increment)s?\s*(?:is|of|was|=|:)?\s*{N}(?![\d.])", 1),
    (rf"(?<![\d.]){N}\s+(?:fewer|less)\b", -1),  # a step down: never an increasing sequence's
]]

def stated_steps(reasoning):
    """The steps the reasoning says in words: "each number is 4 more" -> {4}."""
    return {sign * int(n) for pattern, sign in STEP_SAID for n in pattern.findall(reasoning)}

def written_on(tokens, step, last):
    """Whether the tokens hold a list of at least three numbers, apart by commas, semicolons or nothing, each `step`
    more than the one before, in which `last` is followed by another (last + step)."""
    lists, current = [], []
    for token in tokens + ["."]:  # "." ends the last list
        if token.isdecimal():
            current.append(int(token))
        elif token not in (",", ";") or not current:
            lists.append(current)
            current = []
    return any(len(numbers) >= 3 and last in numbers[:-1] and all(b - a == step for a, b in zip(numbers, numbers[1:]))
               for numbers in lists)
