"""Write one-step tasks with a number for an answer, of several kinds, for choosing a task the packaged
Gemma-3-270M sometimes solves: data/simple_tasks.jsonl (training) and data/simple_tasks_eval.jsonl (held out).

Each line is {"question", "answer", "kind"}; `--filter kind=compare` keeps one kind:
  word_problem     "Mia has 7 pencils. She buys 5 more. How many pencils does Mia have now?"  12
  compare          "Which number is larger, 47 or 29?"  47
  count_letters    "How many times does the letter "e" appear in the word "elephant"?"  2
  count_words      "How many words are in this sentence: "the dog ran home"?"  4
  next_number      "What number comes next: 4, 7, 10, 13, ...?"  16
  unit_conversion  "How many minutes are in 3 hours?"  180
  sequence         "What number comes next: 17, 21, 25, 29, ...?"  33   (--kind sequence only; its rows also
                   hold "step": 5, which data/sequence_reward.py reads)
The same seed writes the same bytes, and no held-out question appears in the training file.

--kind K writes one kind alone, to data/K.jsonl and data/K_eval.jsonl. Two are tasks of the experiments:
`--task sequence` (the CPU default) and `--task count_words`, chosen because the packaged model sometimes answers
them right but rarely at its first guess (README, "Candidates for a task the packaged model can learn").
--kind sequence counts by 2, 3, 4, 5, 6, 8 or 9 from a first term of 1 to 60 (840 questions); its held-out rows
are drawn first, built so that no guess passes (`held_out_sequences`: each step on 1 row in 7, first terms that are
no multiple of the step, no round answer): held-out accuracy is the skill, not a shortcut. The training rows are
drawn from the questions left.

    python data/make_simple_tasks.py                   # 1,500 training + 900 held-out rows, every kind
    python data/make_simple_tasks.py --kind sequence --train-rows 400 --eval-rows 100
    python data/make_simple_tasks.py --kind count_words --train-rows 2000 --eval-rows 500
    python data/make_simple_tasks.py --train-rows 600 --out-dir /tmp/tasks
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tasklib.py, next to this script
from tasklib import check_sizes, split_parser, unique_split, write_split  # noqa: E402
import random  # noqa: E402
from collections import Counter  # noqa: E402

NAMES = ["Mia", "Leo", "Ava", "Sam", "Zoe", "Max", "Ivy", "Ben", "Eva", "Tom"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "shells", "cards"]
WORDS = ["apple", "banana", "cherry", "elephant", "giraffe", "balloon", "pepper", "coffee", "letter", "mirror",
         "window", "garden", "rabbit", "butter", "summer", "kitten", "puppy", "bottle", "pizza", "little", "yellow",
         "common", "success", "address", "between", "committee", "parallel", "tomorrow", "strawberry", "mississippi",
         "happy", "dinner", "rocket", "pillow", "cookie", "school", "kettle", "bubble", "follow", "hello", "umbrella",
         "grass", "tennis", "puzzle", "carrot", "button", "mammal", "teeth", "sheep", "street", "banner", "cotton",
         "jelly", "marble", "noodle", "planet", "silver", "tunnel", "valley", "wallet", "zebra", "orange", "lemon",
         "potato", "tomato", "guitar", "castle", "island", "forest", "river", "bridge", "candle", "pencil", "rubber"]
VOCABULARY = ["the", "dog", "cat", "ran", "home", "a", "big", "red", "ball", "sat", "on", "mat", "we", "saw",
              "bird", "sing", "in", "tree", "she", "likes", "green", "tea", "my", "friend", "reads", "books"]
UNITS = [("minutes", "hours", 60), ("hours", "days", 24), ("days", "weeks", 7), ("months", "years", 12),
         ("centimeters", "meters", 100), ("grams", "kilograms", 1000), ("seconds", "minutes", 60), ("eggs", "dozens", 12)]
KINDS = ("word_problem", "compare", "count_letters", "count_words", "next_number", "unit_conversion")  # the default mix


def word_problem(rng):
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    pronoun = "She" if name in ("Mia", "Ava", "Zoe", "Ivy", "Eva") else "He"
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    form = rng.choice(["more", "left", "each"])
    if form == "more":
        return f"{name} has {a} {item}. {pronoun} gets {b} more. How many {item} does {name} have now?", a + b
    if form == "left":
        a, b = max(a, b) + 1, min(a, b)
        return f"{name} has {a} {item}. {pronoun} gives away {b}. How many {item} does {name} have left?", a - b
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have?", a * b


def compare(rng):
    a, b = rng.sample(range(10, 100), 2)
    return f"Which number is larger, {a} or {b}?", max(a, b)


def count_letters(rng):
    word = rng.choice(WORDS)
    letter = rng.choice(word)
    return f'How many times does the letter "{letter}" appear in the word "{word}"?', word.count(letter)


def count_words(rng):
    sentence = " ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(3, 8)))
    return f'How many words are in this sentence: "{sentence}"?', len(sentence.split())


def next_number(rng):
    start, step = rng.randint(1, 99), rng.randint(2, 19)
    terms = [start + i * step for i in range(4)]
    return f"What number comes next: {', '.join(map(str, terms))}, ...?", start + 4 * step


def sequence_row(terms, step):
    return f"What number comes next: {', '.join(map(str, terms))}, ...?", terms[-1] + step, {"step": step}


# The sequences count by 2, 3, 4, 5, 6, 8 or 9 from a first term of 1 to 60, with 4 or 5 terms: a skill the untrained
# model shows on about 1 question in 5 with its worked example (experiment_base's TASKS: the step said, then the
# terms written on to the answer), and one each question of a step shares, so that training on some questions
# carries over to others. Not 7, the worked example's step (its terms, copied, are right on no question), nor 10
# (round answers). The held-out questions are drawn first, so that no guess that needs no skill passes
# (tiny_grpo/skill.py; tests/test_skill.py): the steps taken in turn (adding any one step is right on 1 question in 7,
# below the untrained model's share), first terms that are no multiple of the step (never the step itself, which
# "each number is 8 more" for 8, 16, 24 adds), no answer a multiple of 10 (the next multiple of 10 above the last term
# is never right), and no answer on more than 3 of 100. The training rows are drawn from the questions left.
STEPS = [2, 3, 4, 5, 6, 8, 9]
STARTS = range(1, 61)
MOST_PER_ANSWER = 3  # held-out rows with the same answer, in 100
QUESTIONS = [(start, length) for start in STARTS for length in (4, 5)]  # (first term, terms) of each step's questions


def held_out_candidates(step):
    """The (start, length) of every held-out question with this step: no start a multiple of the step, no round
    answer."""
    return [(start, length) for start, length in QUESTIONS
            if start % step and (start + length * step) % 10]


HELD_OUT_SEQUENCES = len(STEPS) * min(len(held_out_candidates(step)) for step in STEPS)


def sequence_task(step, start, length):
    question, answer, fields = sequence_row([start + k * step for k in range(length)], step)
    return {"question": question, "answer": str(answer), "kind": "sequence", **fields}


def held_out_sequences(rng, rows):
    """`rows` held-out sequence rows in a shuffled order: the steps taken in turn, each step's questions drawn from
    held_out_candidates without repeats; no step on more than 1 row in len(STEPS), rounded up, and no answer on more
    than MOST_PER_ANSWER in 100, rounded up."""
    steps = list(STEPS)
    rng.shuffle(steps)  # which steps get a row more when the rows do not divide evenly
    most = max(1, -(-rows * MOST_PER_ANSWER // 100))
    answers, tasks = Counter(), []
    for i, step in enumerate(steps):
        wanted = rows // len(steps) + (i < rows % len(steps))
        candidates = held_out_candidates(step)
        for start, length in rng.sample(candidates, len(candidates)):  # in a random order
            answer = start + length * step
            if wanted and answers[answer] < most:
                tasks.append(sequence_task(step, start, length))
                answers[answer] += 1
                wanted -= 1
        if wanted:
            raise ValueError(f"{rows} held-out sequences: step {step} has too few questions")
    rng.shuffle(tasks)
    return tasks


def training_sequences(rng, rows, held_out):
    """`rows` training rows, drawn from the questions no held-out row asks, in a shuffled order."""
    asked = {task["question"] for task in held_out}
    tasks = [task for step in STEPS for start, length in QUESTIONS
             if (task := sequence_task(step, start, length))["question"] not in asked]
    return rng.sample(tasks, rows)


def unit_conversion(rng):
    small, big, factor = rng.choice(UNITS)
    n = rng.randint(2, 99)
    return f"How many {small} are in {n} {big}?", n * factor


def make_task(rng, kinds=KINDS):
    kind = rng.choice(kinds)
    question, answer, *fields = globals()[kind](rng)  # sequence also gives its step, for a reward's metadata
    return {"question": question, "answer": str(answer), "kind": kind, **(fields[0] if fields else {})}


def write_sequences(parser, args):
    """--kind sequence: the held-out rows (held_out_sequences), then --train-rows of the questions left."""
    left = len(STEPS) * len(QUESTIONS) - args.eval_rows
    for option, rows, most, what in (("--eval-rows", args.eval_rows, HELD_OUT_SEQUENCES, "held-out questions"),
                                     ("--train-rows", args.train_rows, left,
                                      f"training questions beside the {args.eval_rows:,} held out")):
        if rows > most:
            parser.error(f"{option} {rows}: --kind sequence has {most:,} distinct {what}; give at most that")
    rng = random.Random(args.seed)
    try:
        held_out = held_out_sequences(rng, args.eval_rows)
    except ValueError as error:  # not seen with any seed tried
        parser.error(str(error))
    write_split(args, "sequence", training_sequences(rng, args.train_rows, held_out), held_out)


def main(argv=None):
    parser = split_parser(__doc__, train_rows=1_500, eval_rows=900)
    parser.add_argument("--kind", choices=[*KINDS, "sequence"], help="write this kind alone, to KIND.jsonl and KIND_eval.jsonl "
                        "(default: every kind, to simple_tasks.jsonl and simple_tasks_eval.jsonl)")
    args = parser.parse_args(argv)
    check_sizes(parser, args)
    if args.kind == "sequence":
        return write_sequences(parser, args)
    kinds = (args.kind,) if args.kind else KINDS
    train, held_out = unique_split(lambda rng: make_task(rng, kinds), random.Random(args.seed), args.train_rows, args.eval_rows)
    write_split(args, args.kind or "simple_tasks", train, held_out)


if __name__ == "__main__":
    main()
