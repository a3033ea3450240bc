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

import argparse
import json
import random
from pathlib import Path

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


def make_tasks(train_rows, eval_rows, seed):
    """Unique questions, shuffled, split into (train, eval) with no question in both."""
    rng = random.Random(seed)
    tasks, seen = [], set()
    while len(tasks) < train_rows + eval_rows:
        task = make_task(rng)
        if task["question"] not in seen:
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
    parser.add_argument("--train-rows", type=int, default=5_000, help="training rows (default: %(default)s)")
    parser.add_argument("--eval-rows", type=int, default=500, help="held-out rows (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent, help="output folder (default: data/)")
    args = parser.parse_args(argv)
    if args.train_rows < 1 or args.eval_rows < 0:
        parser.error("--train-rows must be at least 1 and --eval-rows at least 0")
    train, held_out = make_tasks(args.train_rows, args.eval_rows, args.seed)
    write_jsonl(args.out_dir / "tool_tasks.jsonl", train)
    write_jsonl(args.out_dir / "tool_tasks_eval.jsonl", held_out)
    print(f"wrote {len(train)} training and {len(held_out)} held-out tasks to {args.out_dir}")


if __name__ == "__main__":
    main()
