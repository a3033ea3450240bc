"""Task data: rows from whatever datasets opens (JSONL, JSON, parquet, CSV, a dataset folder, a hub id), each bad
row named by file and line; the tasks beside each experiment's defaults; the seeded order of prompts."""

import csv, decimal, functools, glob, json, logging, math, os, re, tempfile  # noqa: E401
from collections import namedtuple
from pathlib import Path

import torch

from tiny_grpo.answers import NUMBER, parse_latex, parse_number
from tiny_grpo.errors import InputError
from tiny_grpo.rewards import json_problem

REPOSITORY = Path(__file__).resolve().parent.parent  # the folder that holds data/ and the experiments

def located(path):
    """A relative path that is not found from the working directory but is in the repository (data/'s files, the
    defaults): the repository's, so that `python experiment_x/train.py` runs from any folder; else the path as given."""
    if path and not Path(path).expanduser().exists() and (REPOSITORY / path).exists():
        return str(REPOSITORY / path)
    return path

# --task: its data (training, held out: a file in data/, or a hub id and its configuration) and a worked example
# (question, reasoning, answer) that shows the format
Task = namedtuple("Task", "train eval question reasoning answer config", defaults=(None,))

# the tasks that are no device's default (each experiment's TASKS holds those, then these)
OTHER_TASKS = {
    "gsm8k": Task("openai/gsm8k", "openai/gsm8k", "A shop has 3 boxes with 4 apples in each box. How many apples does "
                  "the shop have?", "3 boxes of 4 apples hold 3 * 4 = 12 apples", "12", config="main"),
    "math_latex": Task("data/math_latex.jsonl", "data/math_latex_eval.jsonl", "Solve for x: 2x + 1 = 4.",
                       "2x = 4 - 1 = 3, so x = 3/2", r"\frac{3}{2}"),  # LaTeX answers, compared by math-verify
    "knights_knaves": Task("data/knights_knaves.jsonl", "data/knights_knaves_eval.jsonl", 'Zoey says, "At least one '
                           'of us is a knave." Ethan says, "Zoey is a knave." So who is a knight and who is a knave?', "If Zoey "
                           "were a knave, her statement would be true, so she is a knight; then Ethan lies", "(1) Zoey is a knight (2) Ethan is a knave"),
    "count_words": Task("data/count_words.jsonl", "data/count_words_eval.jsonl", 'How many words are in this sentence: '
                        '"birds sing"?', "the words are 1 birds 2 sing", "2"),  # 2: no task's answer (3 to 8 words)
}

def load_tasks(path, prompt_key="question", answer_key="answer", filters=(), max_rows=None, config=None, split="train",
               task=None, json_metadata=False):
    """Tasks as [{"question", "answer", "metadata"}], metadata holding the row's other fields, from anything
    datasets.load_dataset opens (read_rows). Every row is checked here, so errors name the file and the line (JSONL)
    or row. --task gsm8k takes GSM8K's final answer, after '####'. json_metadata (with --reward-url, which sends the
    metadata as JSON): a field JSON cannot encode (a parquet timestamp or bytes column) is refused; a --reward-fn
    gets it as datasets reads it (a datetime, bytes)."""
    wanted = {}
    for item in filters:
        field, _, values = item.partition("=")
        wanted[field] = set(values.split(","))
    tasks, seen = [], {field: {} for field in wanted}  # seen: a few of each filtered column's values, to show
    for where, row in read_rows(path, config, split):
        if not isinstance(row, dict):
            raise InputError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for key, option in ((prompt_key, "--prompt-key"), (answer_key, "--answer-key")):
            if key not in row:
                raise InputError(f"{where}: no field {key!r} ({option}); the row has {sorted(row)}")
            if row[key] is None:  # null in JSON, an empty cell or a missing value in a table
                raise InputError(f"{where}: field {key!r} is empty (null)")
            if not isinstance(row[key], (str, int, float)) or isinstance(row[key], bool):
                raise InputError(f"{where}: field {key!r} must be a string, got {type(row[key]).__name__}")
            try:
                str(row[key]).encode("utf-8")  # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer takes
            except UnicodeEncodeError:
                raise InputError(f"{where}: field {key!r} holds a lone surrogate (an escape in \\ud800-\\udfff)")
            if not str(row[key]).strip():
                raise InputError(f"{where}: field {key!r} is empty")
            if isinstance(row[key], float) and not math.isfinite(row[key]):  # NaN, Infinity, 1e400: no answer matches
                raise InputError(f"{where}: field {key!r} is {row[key]}, which no completion can match")
            if isinstance(row[key], float) and len(as_text(row[key])) > 100:  # parse_number reads 100 characters
                raise InputError(f"{where}: field {key!r} is {row[key]}, {len(as_text(row[key]))} characters written out, "
                                 "which no completion can match (numbers are compared up to 100 digits)")
        for field in wanted:
            if field not in row:
                raise InputError(f"{where}: --filter {field}=...: the row has no field {field!r}")
            if len(seen[field]) <= FILTER_VALUES_SHOWN:
                seen[field].setdefault(filter_text(row[field]))
        if all(filter_matches(row[field], values) for field, values in wanted.items()):
            metadata = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
            if json_metadata and json_problem(metadata):
                raise InputError(f"{where}: --reward-url cannot send {json_problem(metadata)} as JSON: drop that "
                                 "column, or cast it to text (a --reward-fn takes it as it is)")
            answer = as_text(row[answer_key])
            if task == "gsm8k" and "####" in answer:
                answer, metadata["solution"] = gsm8k_final_answer(answer, where)
            if task == "math_latex":
                check_latex_answer(answer, where)
            tasks.append({"question": as_text(row[prompt_key]), "answer": answer, "metadata": metadata})
        if max_rows is not None and len(tasks) >= max_rows:
            break
    if not tasks:
        why = f" after --filter {' '.join(filters)}" if filters else ""
        for field, values in seen.items():  # what the column holds, as --filter takes it
            shown = list(values)[:FILTER_VALUES_SHOWN] + ["..."] * (len(values) > FILTER_VALUES_SHOWN)
            why += f"; {field} holds {', '.join(shown)}" if shown else ""
        raise InputError(f"{path}: no tasks{why}")
    return tasks

FILTER_VALUES_SHOWN = 10  # when --filter leaves no tasks, this many of each filtered column's values are shown

def as_text(value):
    """A field as a task's text. A number is written out exactly, in full: str() writes 1e16 as '1e+16', which
    parse_number reads as 16."""
    if isinstance(value, float) and math.isfinite(value):
        return format(decimal.Decimal(repr(value)), "f")  # repr: the shortest decimal that is this float
    return str(value)

def filter_text(value):
    """A value as --filter would name it: true, 0.5, 007."""
    return str(value).lower() if isinstance(value, bool) else as_text(value)[:50]

def filter_matches(value, wanted):
    """Whether a field is one of --filter's values, compared as the user wrote them: 'true' matches the boolean
    True, '0.5' and '.5' the number 0.5, '2' the number 2.0; a text must be equal."""
    if isinstance(value, bool):
        return str(value).lower() in {w.strip().lower() for w in wanted}
    if isinstance(value, (int, float)):
        return as_text(value) in wanted or any(float_or_none(w) == value for w in wanted)
    return str(value) in wanted

def float_or_none(text):
    try:
        return float(text)
    except ValueError:
        return None

def gsm8k_final_answer(text, where):
    """GSM8K's answer field, 'worked solution #### 1,200' -> ('1200', 'worked solution'). The final answer must be
    one number as parse_number, which scores it, reads it: '1e3' or '.5' would be scored as 3 or 5."""
    solution, _, final = text.rpartition("####")
    final = final.strip()
    number = re.sub(r"(?<=\d),(?=\d{3}\b)", "", final[:200])  # thousands separators, as parse_number drops them
    if len(final) > 200 or not NUMBER.fullmatch(number) or parse_number(number) is None:  # no 100-digit answer
        raise InputError(f"{where}: the final answer after '####' is not a number: {final[:50]!r}{'...' * (len(final) > 50)} "
                         "(the reward reads digits, a sign, a decimal point, a/b and commas between thousands)")
    return number, solution.strip()

def check_latex_answer(answer, where):
    """Refuse a --task math_latex answer that math-verify reads as no expression ('\\frac{1}{2', '\\$3'), or as a
    product of letters (words, with no digit nor LaTeX command: 'hello' is e*h*l*l*o): every completion would score 0."""
    if not re.search(r"[0-9\\]", answer) or all(isinstance(found, str) for found in parse_latex(answer)):
        raise InputError(f"{where}: field 'answer' {answer[:100]!r} is no answer math-verify can read (LaTeX such as "
                         "\\frac{3}{2}, [2, 5), 3\\sqrt{2}, with a digit or a command): no completion could match it")

DATA_FILES = (".jsonl", ".json", ".parquet", ".csv")

def read_rows(path, config=None, split="train"):
    """(where, row) for each row of what --data-path names: a .jsonl, .json, .parquet or .csv file, a glob of them
    ('data/*.parquet'), a dataset folder (a saved dataset, or data files as on the hub), or a hub id. 'where' is
    'file:line' for JSONL (read here, line by line) and 'file: row N' for what datasets reads."""
    path = str(path)
    if not path.strip():  # Path("") is the current folder
        raise InputError("the data path is empty: expected a file, a glob, a dataset folder or a hub id")
    if Path(path).expanduser().is_dir():
        yield from dataset_rows(str(Path(path).expanduser()), config, split)
        return
    if hub_id(path):
        yield from dataset_rows(path, config, split, hub=True)
        return
    globbed = not Path(path).expanduser().exists() and any(c in path for c in "*?[")  # 'tasks[1].jsonl' is a file
    files = sorted(glob.glob(os.path.expanduser(path))) if globbed else [path]
    if not files:
        raise InputError(f"{path}: no file matches")
    for file in files:
        file = os.path.expanduser(file)
        if not Path(file).exists():
            raise InputError(f"{file}: no such file (run from the repository root; the scripts in data/ make the task files)")
        if not Path(file).is_file():  # a FIFO would hang the read, /dev/zero fill memory
            raise InputError(f"{file}: not a regular file")
        if not file.endswith(DATA_FILES):
            raise InputError(f"{file}: expected a {', '.join(DATA_FILES)} file, a dataset folder or a hub id")
        kind = Path(file).suffix[1:]
        yield from {"jsonl": jsonl_rows, "json": json_rows}.get(kind, functools.partial(dataset_rows, kind=kind))(file)

def hub_id(path):
    """Whether path is no file, folder, glob or path here, so a name on the hub: 'openai/gsm8k'."""
    return not (Path(path).expanduser().exists() or any(c in path for c in "*?[") or path.endswith(DATA_FILES)
                or path.startswith(("/", "./", "../", "~")))

def jsonl_rows(path):
    try:  # utf-8-sig: a byte-order mark is no part of the first line; lines end at \n only (U+2028 is legal in JSON)
        lines = Path(path).read_text(encoding="utf-8-sig").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read: {e}")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{number}", json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})")
        except RecursionError:
            raise InputError(f"{path}:{number}: nested too deeply to be a task")
        except ValueError as e:  # an integer of more than 4,300 digits
            raise InputError(f"{path}:{number}: {str(e).split(';')[0]}")

def json_rows(path):
    """A .json file's rows, read by the json module when it holds an array of objects: datasets would turn a field
    that is a number in one row and a text in another into JSON text ('"7"'). JSON Lines in a .json file are read
    line by line, anything else (an object of columns, broken JSON) by datasets."""
    try:
        rows = json.loads(Path(path).read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        rows = "JSON Lines" if e.msg == "Extra data" else None
    except (OSError, UnicodeDecodeError, RecursionError, ValueError):
        rows = None  # datasets says why, in its words
    if rows == "JSON Lines":
        yield from jsonl_rows(path)
    elif isinstance(rows, list):
        for number, row in enumerate(rows, start=1):
            yield f"{path}: row {number}", row
    else:
        yield from dataset_rows(path, kind="json")

def csv_columns(path):
    """A CSV's header, the file checked with the csv module first: under datasets, pandas takes a row's extra fields
    as an index (so reads the row from the wrong columns) and drops a repeated column."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = csv.reader(f)
            header = next(rows, [])
            for column, name in enumerate(header, start=1):
                if not name.strip():
                    raise InputError(f"{path}: the header's column {column} has no name")
                if header.count(name) > 1:
                    columns = " and ".join(str(i) for i, other in enumerate(header, start=1) if other == name)
                    raise InputError(f"{path}: the header names {name!r} more than once (columns {columns})")
            number = 0  # data rows, counted from 1 after the header, as datasets counts them: blank lines skipped
            for row in rows:
                number += bool(row)
                if len(row) > len(header):
                    raise InputError(f"{path}: row {number} (line {rows.line_num}): {len(row)} fields, the header "
                                     f"has {len(header)}")
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise InputError(f"{path}: cannot read: {e}")
    return header

def parquet_rows(path):
    """The number of rows of a parquet file, from its metadata, or None where pyarrow cannot read that (datasets
    then says why). A column name given twice is refused."""
    import pyarrow.parquet

    try:
        metadata = pyarrow.parquet.read_metadata(path)
    except Exception:
        return None
    names = metadata.schema.names
    for name in names:
        if names.count(name) > 1:
            columns = " and ".join(str(i) for i, other in enumerate(names, start=1) if other == name)
            raise InputError(f"{path}: more than one column is named {name!r} (columns {columns})")
    return metadata.num_rows if names else 0

FOLDER_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".ndjson": "json", ".csv": "csv",
                  ".tsv": "csv", ".arrow": "arrow"}  # the data files of a folder as on the hub, by datasets' reader

def check_folder_files(folder):
    """Refuse a folder of data files of more than one format (datasets reads one format and skips the others), and
    parquet files it cannot read in one line: a column name given twice, no rows or no columns."""
    found = {}
    for file in sorted(Path(folder).rglob("*")):
        hidden = any(part.startswith((".", "__")) for part in file.relative_to(folder).parts)  # as datasets skips
        if file.suffix in FOLDER_FORMATS and not hidden:
            found.setdefault(FOLDER_FORMATS[file.suffix], file.relative_to(folder))
            if file.suffix == ".parquet" and parquet_rows(file) == 0:
                raise InputError(f"{file}: a parquet file with no rows or no columns, which datasets cannot read in a "
                                 "folder: remove it")
    if len(found) > 1:
        examples = ", ".join(f"{shown}" for shown in found.values())
        raise InputError(f"{folder}: it holds {' and '.join(sorted(found))} files ({examples}), and datasets would "
                         "read one format only: put each format in a folder of its own, or convert them to one")

def dataset_rows(path, config=None, split="train", kind=None, hub=False):
    """Rows as the datasets library reads them. Files and folders are streamed (read once, in place: no Arrow copy,
    nothing written in your home), a saved dataset is memory-mapped where it lies, a hub id goes through the Hugging
    Face cache (downloaded once; HF_DATASETS_OFFLINE=1 then reads it offline). A CSV's columns are read as text."""
    import datasets  # here, not at the top: nothing is imported or downloaded before data is read

    where = f"{path} (config {config}, split {split})" if hub else path
    log = logging.getLogger("datasets")  # its failures become one line below: not a page of log before it
    level, sliced = log.level, "[" in split  # train[:100]: a slice, which a stream cannot take
    with tempfile.TemporaryDirectory(prefix="tiny-grpo-data-") as cache:
        try:
            log.setLevel(logging.CRITICAL)
            if kind:
                features = None
                if kind == "csv":  # text, as written: '007' and '1/2' stay answers, not the numbers 7 and 0.5
                    columns = csv_columns(path)
                    if not columns:
                        return
                    features = datasets.Features({name: datasets.Value("string") for name in columns})
                if kind == "parquet" and parquet_rows(path) == 0:  # pyarrow reads no batch of 0 rows or columns
                    return
                data = datasets.load_dataset(kind, data_files=path, split="train", streaming=True, cache_dir=cache,
                                             features=features)
            elif hub:
                logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # a failure in one line, not five retries
                data = datasets.load_dataset(path, config, split=split)
            elif any((Path(path) / name).is_file() for name in ("state.json", "dataset_dict.json")):  # save_to_disk
                data = datasets.load_from_disk(path)
                if isinstance(data, datasets.DatasetDict):
                    name = split.split("[")[0]
                    if name not in data:
                        raise InputError(f"{path}: no split {name!r} (it has {', '.join(data)}): choose one with "
                                         "--data-split / --eval-split")
                    data = data[name]
                    if sliced:  # the rows that load_dataset's slice would give: train[1:3], train[:10%]
                        part = datasets.ReadInstruction.from_spec(split).to_absolute({name: len(data)})[0]
                        data = data.select(range(part.from_, part.to))
            else:
                check_folder_files(path)  # a slice is read into the temporary cache, deleted after
                data = datasets.load_dataset(path, config, split=split, streaming=not sliced, cache_dir=cache)
            narrow = {name: feature.dtype for name, feature in (data.features or {}).items()
                      if getattr(feature, "dtype", None) in ("float16", "float32")}
            for number, row in enumerate(data, start=1):
                for name, dtype in narrow.items():  # float32 0.1 arrives as 0.10000000149011612: the decimal written
                    row[name] = narrow_float(row[name], dtype)
                yield f"{where}: row {number}", row
        except ConnectionError:
            raise InputError(f"{where}: cannot reach the Hugging Face hub (no network, or HF_HUB_OFFLINE=1) and it is no "
                             "local file or folder: where there is network, save it with datasets.load_dataset("
                             f"{path!r}, {config!r}, split={split!r}).to_parquet(FILE), then give that FILE here")
        except InputError:
            raise
        except Exception as e:  # datasets' own errors (a broken parquet, a missing config or split): one line
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InputError(f"{where}: datasets cannot read it: {reason}")
        finally:
            log.setLevel(level)

def narrow_float(value, dtype):
    """A float16 or float32 value (datasets hands it over as the float64 it equals) as the shortest decimal that
    is that float16 or float32: 0.10000000149011612 -> 0.1."""
    import numpy

    if not isinstance(value, float) or not math.isfinite(value):
        return value
    return float(str(getattr(numpy, dtype)(value)))

def check_context(model, tokenizer, args, train_tasks, eval_tasks):
    """Refuse questions whose prompt, with the completion budget, does not fit the model's context: they would fail
    (or be cut) mid-run. The longest are tokenized, not every one."""
    context = getattr(model.config, "max_position_embeddings", None)
    for tasks, path in ((train_tasks, args.data_path), (eval_tasks, args.eval_data_path)):
        for task in sorted(tasks, key=lambda t: len(t["prompt"]))[-8:] if context else []:
            tokens = len(tokenizer(task["prompt"]).input_ids)
            if tokens + args.max_length > context:
                raise InputError(f"{path}: the question {task['question'][:80]!r}... makes a prompt of {tokens} tokens, "
                                 f"which with --max-length {args.max_length} passes the model's context of {context}")

def next_prompts(tasks, count, position, seed):
    """The next `count` tasks of a seeded shuffle; a new shuffle each pass. position = (pass, index)."""
    data_pass, index = position
    batch = []
    while len(batch) < count:
        order = torch.randperm(len(tasks), generator=torch.Generator().manual_seed(seed + data_pass)).tolist()
        take = order[index : index + count - len(batch)]
        batch += [tasks[i] for i in take]
        index += len(take)
        if index >= len(tasks):
            data_pass, index = data_pass + 1, 0
    return batch, (data_pass, index)
