"""Write synthetic arithmetic tasks: data/math_tasks.jsonl (training) and data/math_tasks_eval.jsonl (held out).

Each line is {"question", "answer", "num_terms", "num_digits", "ops"}: e.g.
  {"question": "What is 12 + 7 * 3?", "answer": "33", "num_terms": 3, "num_digits": 2, "ops": "*+"}
Numbers have up to `num_digits` digits; `ops` lists the operators used, so a run can filter with
`--filter num_terms=2 --filter ops=+,-,+-`. The same seed writes the same bytes, and no held-out
question appears in the training file.

    python data/make_math_tasks.py                     # 50,000 training + 2,000 held-out rows
    python data/make_math_tasks.py --train-rows 1000 --out-dir /tmp/tasks
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tasklib.py, next to this script
from tasklib import generate  # noqa: E402

OPERATORS = "+-*"
NUM_TERMS = (2, 3, 4)
NUM_DIGITS = (1, 2, 3)


def evaluate(numbers, ops):
    """Evaluate numbers joined by ops with the usual precedence (* before + and -)."""
    total, product = 0, numbers[0]
    sign = 1
    for op, number in zip(ops, numbers[1:]):
        if op == "*":
            product *= number
        else:
            total += sign * product
            sign, product = (1 if op == "+" else -1), number
    return total + sign * product


def make_task(rng):
    num_terms, num_digits = rng.choice(NUM_TERMS), rng.choice(NUM_DIGITS)
    numbers = [rng.randrange(10**num_digits) for _ in range(num_terms)]
    ops = [rng.choice(OPERATORS) for _ in range(num_terms - 1)]
    expression = str(numbers[0]) + "".join(f" {op} {n}" for op, n in zip(ops, numbers[1:]))
    return {
        "question": f"What is {expression}?",
        "answer": str(evaluate(numbers, ops)),
        "num_terms": num_terms,
        "num_digits": num_digits,
        "ops": "".join(sorted(set(ops))),
    }


def main(argv=None):
    generate(__doc__, "math_tasks", make_task, train_rows=50_000, eval_rows=2_000, argv=argv)


if __name__ == "__main__":
    main()
