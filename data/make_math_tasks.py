"""Write synthetic arithmetic tasks: data/math_tasks.jsonl (training) and data/math_tasks_eval.jsonl (held out).

Each line is {"question", "answer", "num_terms", "num_digits", "ops"}: e.g.
  {"question": "What is 12 + 7 * 3?", "answer": "33", "num_terms": 3, "num_digits": 2, "ops": "*+"}
Numbers have up to `num_digits` digits; `ops` lists the operators used, so a run can filter with
`--filter num_terms=2 --filter ops=+,-,+-`. The same seed writes the same bytes, and no held-out
question appears in the training file.

    python data/make_math_tasks.py                     # 50,000 training + 2,000 held-out rows
    python data/make_math_tasks.py --train-rows 1000 --out-dir /tmp/tasks
"""

import argparse
import json
import random
from pathlib import Path

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


def make_tasks(train_rows, eval_rows, seed):
    """Unique questions, shuffled, split into (train, eval) with no question in both."""
    rng = random.Random(seed)
    tasks, seen = [], set()
    while len(tasks) < train_rows + eval_rows:
        task = make_task(rng)
        if task["question"] not in seen:  # small combinations (2 one-digit terms) run out of fresh questions
            seen.add(task["question"])
            tasks.append(task)
    rng.shuffle(tasks)
    return tasks[eval_rows:], tasks[:eval_rows]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-rows", type=int, default=50_000, help="training rows (default: %(default)s)")
    parser.add_argument("--eval-rows", type=int, default=2_000, help="held-out rows (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent, help="output folder (default: data/)")
    args = parser.parse_args(argv)
    if args.train_rows < 1 or args.eval_rows < 0:
        parser.error("--train-rows must be at least 1 and --eval-rows at least 0")
    train, held_out = make_tasks(args.train_rows, args.eval_rows, args.seed)
    write_jsonl(args.out_dir / "math_tasks.jsonl", train)
    write_jsonl(args.out_dir / "math_tasks_eval.jsonl", held_out)
    print(f"wrote {len(train)} training and {len(held_out)} held-out tasks to {args.out_dir}")


if __name__ == "__main__":
    main()
