"""Write arithmetic tasks where a calculator helps: data/tool_tasks.jsonl (training) and
data/tool_tasks_eval.jsonl (held out), for experiment_multiturn_tool_calling.

Each line is {"question", "answer", "kind", "num_digits"}: e.g.
  {"question": "What is 482 * 317?", "answer": "152794", "kind": "mul", "num_digits": 3}
  {"question": "What is 95744 / 136?", "answer": "704", "kind": "div", "num_digits": 3}
  {"question": "What is 57 * 803 - 4416 / 48?", "answer": "45679", "kind": "mixed", "num_digits": 3}
kind is mul (two multi-digit factors), div (exact: the quotient is a whole number) or mixed (three or
four numbers with + - * / and parentheses; every division is exact, so every answer is an integer);
num_digits is the most digits a factor, divisor or quotient may have (a dividend, the product of two
such numbers, is longer). A run can filter: `--filter kind=mul --filter num_digits=2,3`.
The same seed writes the same bytes, and no held-out question appears in the training file.

    python data/make_tool_tasks.py                     # 5,000 training + 500 held-out rows
    python data/make_tool_tasks.py --train-rows 1000 --out-dir /tmp/tasks
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tasklib.py, next to this script
from tasklib import generate  # noqa: E402

KINDS = ("mul", "div", "mixed")
NUM_DIGITS = (2, 3, 4)


def number(rng, digits):
    """A number with exactly `digits` digits."""
    return rng.randrange(10 ** (digits - 1), 10**digits)


def multiplication(rng, digits):
    a, b = number(rng, digits), number(rng, rng.randint(2, digits))
    return f"{a} * {b}", a * b


def division(rng, digits):
    """dividend / divisor with a whole quotient: the dividend is made as quotient * divisor."""
    divisor, quotient = number(rng, rng.randint(2, digits)), number(rng, digits)
    return f"{quotient * divisor} / {divisor}", quotient


def mixed(rng, digits):
    """One of a few shapes of three or four numbers; exact integer arithmetic throughout."""
    a, b, c, d = (number(rng, rng.randint(2, digits)) for _ in range(4))
    shape = rng.randrange(5)
    if shape == 0:
        return f"{a} * {b} + {c}", a * b + c
    if shape == 1:
        return f"{a} * {b} - {c} * {d}", a * b - c * d
    if shape == 2:
        return f"({a} + {b}) * {c}", (a + b) * c
    if shape == 3:
        return f"{a} * {b} - {c * d} / {d}", a * b - c
    return f"({a} - {b}) * {c} + {d}", (a - b) * c + d


def make_task(rng):
    kind, digits = rng.choice(KINDS), rng.choice(NUM_DIGITS)
    expression, value = {"mul": multiplication, "div": division, "mixed": mixed}[kind](rng, digits)
    return {"question": f"What is {expression}?", "answer": str(value), "kind": kind, "num_digits": digits}


def main(argv=None):
    generate(__doc__, "tool_tasks", make_task, train_rows=5_000, eval_rows=500, argv=argv)


if __name__ == "__main__":
    main()
