"""Write Knights-and-Knaves logic puzzles: data/knights_knaves.jsonl (training) and data/knights_knaves_eval.jsonl (held out).

On the island knights always tell the truth and knaves always lie. Each of N inhabitants (2 to 8) makes
one statement, built from "X is a knight", "X is a knave" and at most one connective: "It is not the case
that ...", "... and ...", "... or ...", "... if and only if ...". A speaker may talk about themselves.
Only puzzles with exactly one solution are kept (brute force over all 2^N roles), so the answer is
never ambiguous. Each line is {"question", "answer", "num_people", "names"}: e.g.
  {"question": "On an island, knights always tell the truth and knaves always lie. You meet 3 inhabitants:
    Michael, Zoey and Ethan. Michael says, \"Zoey is a knave or Ethan is a knight.\" Zoey says, \"It is
    not the case that Michael is a knight.\" Ethan says, \"Michael is a knave if and only if Zoey is a
    knight.\" So who is a knight and who is a knave?",
   "answer": "(1) Michael is a knight\\n(2) Zoey is a knave\\n(3) Ethan is a knight",
   "num_people": 3, "names": ["Michael", "Zoey", "Ethan"]}
(the question is one line in the file). The answer lists every inhabitant in the order they were
introduced, one per line. `num_people` is the difficulty, so a run can filter with
`--filter num_people=2,3`. Rows are spread evenly over the people counts in each file. The same seed
writes the same bytes, and no held-out question appears in the training file.

    python data/make_knights_knaves.py                     # 10,000 training + 500 held-out rows, 2..8 people
    python data/make_knights_knaves.py --min-people 3 --max-people 5 --train-rows 1000 --out-dir /tmp/kk
"""

import itertools
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tasklib.py, next to this script
from tasklib import check_sizes, split_parser, write_split  # noqa: E402

MIN_PEOPLE, MAX_PEOPLE = 2, 8
NAMES = (
    "Michael", "Zoey", "Ethan", "Olivia", "Liam", "Emma", "Noah", "Ava", "James", "Sophia",
    "Lucas", "Mia", "Henry", "Amelia", "Jack", "Harper", "Owen", "Evelyn", "Leo", "Abigail",
    "Daniel", "Emily", "Samuel", "Ella", "David", "Grace", "Joseph", "Chloe", "Isaac", "Lily",
    "Aria", "Gabriel", "Nora", "Mason", "Hazel", "Logan", "Aurora", "Elijah", "Violet", "Oliver",
    "Scarlett", "Jacob", "Penelope", "Aiden", "Stella", "Carter", "Lucy", "Wyatt", "Ruby", "Sebastian",
)  # fmt: skip
CONNECTIVES = ("not", "and", "or", "iff")
INTRO = "On an island, knights always tell the truth and knaves always lie."  # short: it is on all 10,000 lines
REQUEST = "So who is a knight and who is a knave?"

# A statement is a nested tuple over inhabitant indices:
#   ("knight", i) | ("knave", i) | ("not", atom) | ("and" | "or" | "iff", atom, atom)
# A puzzle is a list of statements, the i-th said by inhabitant i; an assignment is a tuple of bools,
# True for a knight.


def holds(statement, roles):
    """Truth of a statement when roles[i] is True for a knight."""
    kind = statement[0]
    if kind == "knight":
        return roles[statement[1]]
    if kind == "knave":
        return not roles[statement[1]]
    if kind == "not":
        return not holds(statement[1], roles)
    a, b = holds(statement[1], roles), holds(statement[2], roles)
    if kind == "and":
        return a and b
    if kind == "or":
        return a or b
    return a == b  # "iff"


def solve(puzzle):
    """Every assignment (tuple of bools, True = knight) in which each speaker is a knight iff their statement holds."""
    return [roles for roles in itertools.product((True, False), repeat=len(puzzle))
            if all(roles[speaker] == holds(statement, roles) for speaker, statement in enumerate(puzzle))]


def render(statement, names):
    """English for a statement; names are used even for the speaker, so every clause reads '<Name> is a ...'."""
    kind = statement[0]
    if kind in ("knight", "knave"):
        return f"{names[statement[1]]} is a {kind}"
    if kind == "not":
        return "It is not the case that " + render(statement[1], names)
    joiner = {"and": " and ", "or": " or ", "iff": " if and only if "}[kind]
    return render(statement[1], names) + joiner + render(statement[2], names)


def random_atom(rng, person):
    return (rng.choice(("knight", "knave")), person)


def random_statement(rng, num_people):
    kind = rng.choice(("atom",) + CONNECTIVES)
    if kind == "atom":
        return random_atom(rng, rng.randrange(num_people))
    if kind == "not":
        return ("not", random_atom(rng, rng.randrange(num_people)))
    first, second = rng.sample(range(num_people), 2)  # two different people: "X is a knight or X is a knave" is idle
    return (kind, random_atom(rng, first), random_atom(rng, second))


def make_puzzle(rng, num_people):
    """Draw a hidden solution, give each speaker a statement consistent with it, keep the puzzle if the
    solution is unique. Starting from a consistent puzzle (instead of random statements) means no
    retries for contradictory puzzles; about a third of 8-person draws are unique, so few retries."""
    while True:
        truth = tuple(rng.random() < 0.5 for _ in range(num_people))
        puzzle = []
        for speaker in range(num_people):
            statement = random_statement(rng, num_people)
            while holds(statement, truth) != truth[speaker]:  # a knight's statement is true, a knave's false
                statement = random_statement(rng, num_people)
            puzzle.append(statement)
        if solve(puzzle) == [truth]:
            return puzzle, truth


def make_row(rng, num_people):
    puzzle, truth = make_puzzle(rng, num_people)
    names = rng.sample(NAMES, num_people)
    said = " ".join(f'{name} says, "{render(statement, names)}."' for name, statement in zip(names, puzzle))
    listed = ", ".join(names[:-1]) + " and " + names[-1]
    return {
        "question": f"{INTRO} You meet {num_people} inhabitants: {listed}. {said} {REQUEST}",
        "answer": "\n".join(f"({i}) {name} is a {'knight' if knight else 'knave'}"
                            for i, (name, knight) in enumerate(zip(names, truth), start=1)),
        "num_people": num_people,
        "names": names,
    }


def make_split(rng, rows, people_counts, seen):
    """rows puzzles, people counts taken in turn (an even spread), none whose question is already in seen."""
    split = []
    while len(split) < rows:
        row = make_row(rng, people_counts[len(split) % len(people_counts)])
        if row["question"] not in seen:  # the same name draw and statements can come up twice for 2 people
            seen.add(row["question"])
            split.append(row)
    rng.shuffle(split)
    return split


def make_tasks(train_rows, eval_rows, min_people, max_people, seed):
    """(train, eval) with no question in both; each split spread evenly over min_people..max_people."""
    rng = random.Random(seed)
    people_counts = list(range(min_people, max_people + 1))
    seen = set()
    held_out = make_split(rng, eval_rows, people_counts, seen)
    train = make_split(rng, train_rows, people_counts, seen)
    return train, held_out


def main(argv=None):
    parser = split_parser(__doc__, train_rows=10_000, eval_rows=500)
    parser.add_argument("--min-people", type=int, default=MIN_PEOPLE,
                        help=f"fewest inhabitants in a puzzle, {MIN_PEOPLE}..{MAX_PEOPLE} (default: %(default)s)")
    parser.add_argument("--max-people", type=int, default=MAX_PEOPLE,
                        help=f"most inhabitants in a puzzle, {MIN_PEOPLE}..{MAX_PEOPLE} (default: %(default)s)")
    args = parser.parse_args(argv)
    check_sizes(parser, args)
    for option, value in (("--min-people", args.min_people), ("--max-people", args.max_people)):
        if not MIN_PEOPLE <= value <= MAX_PEOPLE:
            parser.error(f"{option} must be between {MIN_PEOPLE} and {MAX_PEOPLE}, got {value}")
    if args.min_people > args.max_people:
        parser.error(f"--min-people ({args.min_people}) must not exceed --max-people ({args.max_people})")
    train, held_out = make_tasks(args.train_rows, args.eval_rows, args.min_people, args.max_people, args.seed)
    write_split(args, "knights_knaves", train, held_out, what="puzzles")


if __name__ == "__main__":
    main()
