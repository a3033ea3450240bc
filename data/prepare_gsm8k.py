"""Write GSM8K as data/gsm8k_train.jsonl (7,473 rows) and data/gsm8k_test.jsonl (1,319 rows).

Each line is {"question", "answer", "solution"}: `answer` is GSM8K's final number (the text after
"####", stripped, thousands commas removed) and `solution` the worked solution before "####", kept
as it is (with GSM8K's <<48/2=24>> calculator notes) for reference, e.g.
  {"question": "Natalia sold clips to 48 of her friends in April, ...?", "answer": "72",
   "solution": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\\nNatalia sold 48+24 = <<48+24=72>>72 clips ..."}

Where the data comes from (one of):
  --source FOLDER                a local copy: FOLDER (or FOLDER/main, the hub repository's layout) holding
                                 train.jsonl / test.jsonl (github.com/openai/grade-school-math), or
                                 train.parquet / test.parquet, or shards train-00000-of-00001.parquet ...;
  --train-file F --test-file F   two files, each .parquet or .jsonl, with GSM8K's fields question and answer;
  neither                        the hub dataset openai/gsm8k, config main, through datasets.load_dataset.
Rows in errors: 'file:LINE' for JSONL, 'file: row N' (from 1) for parquet. A row without '####', or whose
final answer is empty or not a number, is an error; the script then prints one line and exits with code 1.

    python data/prepare_gsm8k.py                                   # from the hub
    python data/prepare_gsm8k.py --source ~/gsm8k                  # from a local copy, e.g. a clone of openai/gsm8k
    python data/prepare_gsm8k.py --train-file train.jsonl --test-file test.jsonl --max-rows 100 --out-dir /tmp/gsm8k
"""

import argparse
import json
import sys
from fractions import Fraction
from pathlib import Path

HUB_ID, HUB_CONFIG = "openai/gsm8k", "main"
SPLITS = ("train", "test")
SUFFIXES = (".parquet", ".jsonl")


class InputError(Exception):
    """Bad input: main prints it as one line and exits with code 1."""


def split_answer(text, where):
    """GSM8K's answer field -> (final number, worked solution): 'It is <<6*2=12>>12.\\n#### 1,200' -> ('1200', ...)."""
    if not isinstance(text, str):
        raise InputError(f"{where}: field 'answer' must be a string, got {type(text).__name__}")
    if "####" not in text:
        raise InputError(f"{where}: no '####' before the final answer in field 'answer' (ends {text[-40:]!r})")
    solution, _, final = text.rpartition("####")
    final = final.strip().replace(",", "")
    if not final:
        raise InputError(f"{where}: empty final answer after '####'")
    try:
        Fraction(final)  # the reward compares numbers, so a final answer that is not one is useless
    except (ValueError, ZeroDivisionError):
        raise InputError(f"{where}: the final answer after '####' is not a number: {final!r}")
    return final, solution.strip()


def convert_row(row, where):
    """One GSM8K row -> {"question", "answer", "solution"}; where ('file:line') names it in errors."""
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected an object with fields question and answer, got {type(row).__name__}")
    for key in ("question", "answer"):
        if key not in row:
            raise InputError(f"{where}: no field {key!r}; the row has {sorted(row)}")
    question = row["question"]
    if not isinstance(question, str) or not question.strip():
        raise InputError(f"{where}: field 'question' must be a non-empty string, got {question!r}")
    answer, solution = split_answer(row["answer"], where)
    return {"question": question.strip(), "answer": answer, "solution": solution}


def read_jsonl(path):
    """Yield (where, row) for each non-blank line; where is 'path:line'."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read: {e}")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})")
        yield f"{path}:{number}", row


def read_parquet(path):
    """Yield (where, row) for each row; where is 'path: row N', counting from 1."""
    import pyarrow.parquet  # installed with datasets

    try:
        rows = pyarrow.parquet.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises its own types (ArrowInvalid, ...) for files that are not parquet
        raise InputError(f"{path}: cannot read as parquet: {e}")
    for number, row in enumerate(rows, start=1):
        yield f"{path}: row {number}", row


def read_rows(path):
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    if path.suffix == ".parquet":
        return read_parquet(path)
    if path.suffix == ".jsonl":
        return read_jsonl(path)
    raise InputError(f"{path}: expected a .parquet or .jsonl file")


def convert(rows, max_rows=None):
    """(where, row) pairs -> output rows, stopping after max_rows."""
    out = []
    for where, row in rows:
        if max_rows is not None and len(out) >= max_rows:
            break
        out.append(convert_row(row, where))
    return out


def find_split_files(folder, split):
    """The files of one split in a local copy: split.jsonl, split.parquet or shards split-00000-of-00002.parquet."""
    for place in (folder, folder / HUB_CONFIG):  # a clone of the hub repository keeps config main in main/
        for suffix in SUFFIXES:
            files = sorted(place.glob(f"{split}-*-of-*{suffix}")) or sorted(place.glob(f"{split}{suffix}"))
            if files:
                return files
    raise InputError(f"{folder}: no {split} files (looked for {split}.jsonl, {split}.parquet and "
                     f"{split}-*-of-*.parquet there and in {HUB_CONFIG}/); name the files with --train-file/--test-file")


def load_local(files_by_split, max_rows=None):
    """{split: [file, ...]} -> {split: [output row, ...]}; shards are read in order."""
    data = {}
    for split, files in files_by_split.items():
        data[split] = convert((item for path in files for item in read_rows(path)), max_rows)
        if not data[split]:
            raise InputError(f"{', '.join(map(str, files))}: no rows")
    return data


def load_hub(max_rows=None):
    """{split: [output row, ...]} from the hub; unreachable hub -> one InputError saying how to pass a local copy."""
    import datasets

    try:
        dataset = datasets.load_dataset(HUB_ID, HUB_CONFIG)
    except Exception as e:  # offline: ConnectionError; other hub and cache failures have their own types
        why = " ".join(str(e).split())[:300]  # one line, however the library words it
        raise InputError(f"could not load {HUB_ID} from the Hugging Face hub ({type(e).__name__}: {why}); pass a local "
                         f"copy with --source FOLDER (train/test .parquet or .jsonl files) or --train-file/--test-file")
    return {split: convert(((f"{HUB_ID} {split} row {i}", row) for i, row in enumerate(dataset[split], start=1)),
                           max_rows) for split in SPLITS}


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=None,
                        help="folder with a local copy of GSM8K (default: %(default)s, i.e. the hub)")
    parser.add_argument("--train-file", type=Path, default=None,
                        help="GSM8K training file, .parquet or .jsonl; needs --test-file (default: %(default)s)")
    parser.add_argument("--test-file", type=Path, default=None,
                        help="GSM8K test file, .parquet or .jsonl; needs --train-file (default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent, help="output folder (default: data/)")
    parser.add_argument("--max-rows", type=int, default=None,
                        help="keep at most this many rows of each split (default: %(default)s, i.e. all)")
    args = parser.parse_args(argv)
    if (args.train_file is None) != (args.test_file is None):
        parser.error("--train-file and --test-file go together")
    if args.source is not None and args.train_file is not None:
        parser.error("give either --source or --train-file/--test-file, not both")
    if args.max_rows is not None and args.max_rows < 1:
        parser.error(f"--max-rows must be at least 1, got {args.max_rows}")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        parser.error(f"--out-dir {args.out_dir}: a file, not a folder")
    return args


def load(args):
    if args.source is not None:
        if not args.source.is_dir():
            raise InputError(f"{args.source}: --source expects a folder (name single files with --train-file/--test-file)")
        return load_local({split: find_split_files(args.source, split) for split in SPLITS}, args.max_rows)
    if args.train_file is not None:
        return load_local({"train": [args.train_file], "test": [args.test_file]}, args.max_rows)
    return load_hub(args.max_rows)


def main(argv=None):
    args = parse_args(argv)
    try:
        data = load(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    for split in SPLITS:
        write_jsonl(args.out_dir / f"gsm8k_{split}.jsonl", data[split])
    print(f"wrote {len(data['train'])} training and {len(data['test'])} test rows to {args.out_dir}")


if __name__ == "__main__":
    main()
