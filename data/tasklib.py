"""What the task generators in data/ share: a unique-question train/held-out split, the JSONL writer,
and the command line (sizes, seed, output folder). Imported by data/make_*.py, which run as scripts."""

import argparse
import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent


def unique_split(make_task, rng, train_rows, eval_rows):
    """Draw tasks with make_task(rng) until train_rows + eval_rows distinct questions exist, shuffle them,
    and split them into (train, held out): no question is in both."""
    tasks, seen = [], set()
    while len(tasks) < train_rows + eval_rows:
        task = make_task(rng)
        if task["question"] not in seen:  # small combinations run out of fresh questions: draw again
            seen.add(task["question"])
            tasks.append(task)
    rng.shuffle(tasks)
    return tasks[eval_rows:], tasks[:eval_rows]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def split_parser(description, train_rows, eval_rows):
    """The options every generator has: --train-rows, --eval-rows, --seed, --out-dir."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-rows", type=int, default=train_rows, help="training rows (default: %(default)s)")
    parser.add_argument("--eval-rows", type=int, default=eval_rows, help="held-out rows (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=DATA, help="output folder (default: data/)")
    return parser


def check_sizes(parser, args):
    if args.train_rows < 1 or args.eval_rows < 0:
        parser.error("--train-rows must be at least 1 and --eval-rows at least 0")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        parser.error(f"--out-dir {args.out_dir}: a file, not a folder")


def write_split(args, name, train, held_out, what="tasks"):
    """NAME.jsonl and NAME_eval.jsonl in --out-dir."""
    write_jsonl(args.out_dir / f"{name}.jsonl", train)
    write_jsonl(args.out_dir / f"{name}_eval.jsonl", held_out)
    print(f"wrote {len(train)} training and {len(held_out)} held-out {what} to {args.out_dir}")


def generate(description, name, make_task, train_rows, eval_rows, argv=None):
    """The whole command of a generator whose tasks are drawn one at a time by make_task(rng): parse the
    options, draw a unique-question split with the seed, write NAME.jsonl and NAME_eval.jsonl."""
    parser = split_parser(description, train_rows=train_rows, eval_rows=eval_rows)
    args = parser.parse_args(argv)
    check_sizes(parser, args)
    write_split(args, name, *unique_split(make_task, random.Random(args.seed), args.train_rows, args.eval_rows))
