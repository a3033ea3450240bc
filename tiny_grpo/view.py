"""The page per run: `python -m tiny_grpo.view LOG_DIR/RUN_NAME [--output FILE]` writes LOG_DIR/RUN_NAME/rollouts.html
from the run's rollouts.jsonl (docs/rollout-log.md): one self-contained file, its data embedded as JSON, that opens
offline and makes no network request. It shows the learning curves, each logged step's groups sorted by advantage with
every completion's tokens coloured by a quantity the reader picks (advantage x ratio, ratio, clipped, KL, log-prob),
and the held-out evaluation's completions, right and wrong. A run draws it at each checkpoint and at its end.

The log is read line by line, keeping only what the page can embed, so the memory needed does not grow with the log.
Standard library only. Every text from the data reaches the page through textContent, never as HTML."""

import argparse, bisect, collections, contextlib, html, itertools, json, math, os, sys  # noqa: E401
from pathlib import Path

from tiny_grpo.errors import InputError
from tiny_grpo.files import write_atomically

LOG_NAME, PAGE_NAME = "rollouts.jsonl", "rollouts.html"
BUDGET = 8 * 2**20  # bytes of embedded data: the page stays under 10 MB
CURVE_POINTS = 4000  # steps (and evaluations) reduced to their curve points kept at most, evenly spaced
STARTS = 20  # a run's starts whose options the header shows at most: the first and the newest
PER_TOKEN = ("tokens", "action", "logp_old", "ratio", "clipped", "kl")
CUT = "Left out to keep this page under 10 MB:"

# The shape of each kind of record the page reads (docs/rollout-log.md); a field may be absent or null, but a step's
# number. A record of another shape is skipped and counted: one would stop the page's script.
NUMBER, TEXT, FLAG, WHOLE, NUMBERS, LIST = ("a number", "a text", "true or false", "a whole number",
                                            "an object of numbers", "a list")
COMPLETION = {"text": TEXT, "reward": NUMBER, "terms": NUMBERS, "advantage": NUMBER, "truncated": FLAG,
              **{name: LIST for name in PER_TOKEN}}
SHAPES = {
    "run": {"experiment": TEXT, "run_name": TEXT, "group_size": NUMBER, "clip_eps": NUMBER, "kl_weight": NUMBER,
            "max_length": NUMBER, "temperature": NUMBER, "reward_weights": NUMBERS, "start_step": WHOLE},
    "step": {"step": WHOLE, "scalars": NUMBERS, "groups": [{"index": NUMBER, "prompt": TEXT, "question": TEXT,
                                                            "answer": TEXT, "rewards_equal": FLAG,
                                                            "completions": [COMPLETION]}]},
    "eval": {"step": WHOLE, "metrics": NUMBERS, "completions": [{"question": TEXT, "prompt": TEXT, "answer": TEXT,
                                                                 "text": TEXT, "correct": FLAG, "faithful": FLAG,
                                                                 "terms": NUMBERS}]}}


def _is(value, kind):
    if kind == TEXT:
        return isinstance(value, str)
    if kind == FLAG:
        return isinstance(value, bool)
    if kind == LIST:
        return isinstance(value, list)
    if kind == NUMBERS:
        return isinstance(value, dict) and all(v is None or _is(v, NUMBER) for v in value.values())
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and isinstance(value, int) if kind == WHOLE else number


def misshapen(record):
    """Where a parsed line departs from the shape the page reads, as 'groups[0].completions: not a list'; None if
    nowhere."""
    if not isinstance(record, dict):
        return "not an object"
    if record.get("kind") not in SHAPES:
        return "its kind is not run, step or eval"
    if record["kind"] != "run" and record.get("step") is None:
        return "no step"
    return _departs(record, SHAPES[record["kind"]], "")


def _departs(value, shape, path):
    if isinstance(shape, list):
        if not isinstance(value, list):
            return f"{path}: not a list"
        return next(filter(None, (_departs(v, shape[0], f"{path}[{i}]") for i, v in enumerate(value))), None)
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return f"{path}: not an object"
        return next(filter(None, (_departs(value[k], inner, f"{path}.{k}" if path else k)
                                  for k, inner in shape.items() if value.get(k) is not None)), None)
    return None if _is(value, shape) else f"{path}: not {shape}"


def _finite(value):
    """The record with nan and inf as null: JSON.parse takes neither."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def embed(data):
    """data as JSON safe inside <script type="application/json">: <, >, & and U+2028/2029 as \\u escapes, so nothing
    in it can close the script or open a comment; a lone surrogate as its \\u escape. Returns UTF-8 bytes."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for char in "<>&\u2028\u2029":
        text = text.replace(char, f"\\u{ord(char):04x}")
    return text.encode("utf-8", "backslashreplace")  # only a string can hold a lone surrogate: \udXXX is JSON there


def _embedded(record):
    """embed(record), a number JSON cannot hold (1e999 reads as inf) as null."""
    try:
        return embed(record)
    except ValueError:
        return embed(_finite(record))


def _without(step, keys):
    """A copy of a step record whose completions lack keys (or whose groups are gone, keys None)."""
    if keys is None:
        return {**step, "groups": [], "groups_left_out": True}
    groups = [{**g, "completions": [{k: v for k, v in c.items() if k not in keys} for c in g.get("completions") or []]}
              for g in step.get("groups") or []]
    return {**step, "groups": groups, "tokens_left_out": True}


class Tally:
    """The steps some part of was left out: how many, the first and the last (they go oldest first)."""

    def __init__(self):
        self.count, self.first, self.last = 0, None, None

    def add(self, step):
        self.count += 1
        self.first = step if self.first is None else min(self.first, step)
        self.last = step if self.last is None else max(self.last, step)

    def __str__(self):
        if self.count == 1:
            return f"step {self.first}"
        if self.count == self.last - self.first + 1:
            return f"steps {self.first}-{self.last}"
        return f"the {self.count:,} logged steps from {self.first} to {self.last}"


class Entry:
    """A record as the page may embed it: whole, lean (without per-token lists; the same bytes where it has none)
    and bare (its curve points only); shown is the one the page embeds."""

    __slots__ = ("step", "whole", "lean", "bare", "tokens", "shown")

    def __init__(self, record):
        self.step, self.whole = record["step"], _embedded(record)
        if record["kind"] == "eval":
            self.tokens, self.lean = False, self.whole
            self.bare = _embedded({**record, "completions": [], "completions_left_out": True})
        else:
            self.tokens = any(k in c for g in record.get("groups") or [] for c in g.get("completions") or []
                              for k in PER_TOKEN)
            self.lean = _embedded(_without(record, PER_TOKEN)) if self.tokens else self.whole
            self.bare = _embedded(_without(record, None))
        self.shown = self.whole


class Curve:
    """Records reduced to their curve points, oldest first, at most 2 * CURVE_POINTS of them held: past that every
    other one goes and the stride doubles, so the points stay evenly spaced and the memory does not grow with the run.
    The newest is held aside, so that the curve always ends at the last."""

    def __init__(self):
        self.kept, self.stride, self.seen, self.newest = [], 1, 0, None

    def add(self, entry):
        if self.seen % self.stride:
            self.newest = entry
        else:
            self.kept.append(entry)
            self.newest = None
        self.seen += 1
        if len(self.kept) > 2 * CURVE_POINTS:
            del self.kept[1::2]
            self.stride *= 2

    def insert(self, entry):
        """One logged out of order: in its place."""
        self.kept.insert(bisect.bisect([e.step for e in self.kept], entry.step), entry)
        self.seen += 1

    def drop(self, step):
        """Forget the points of this step (logged again); whether any were held."""
        held = len(self.kept) + (self.newest is not None)
        self.kept = [e for e in self.kept if e.step != step]
        if self.newest is not None and self.newest.step == step:
            self.newest = None
        return len(self.kept) + (self.newest is not None) < held

    def __len__(self):
        return len(self.kept) + (self.newest is not None)

    def entries(self, most=None):
        """The points held, or at most `most` of them, those nearest to evenly spaced steps from the first to the
        last."""
        points = self.kept + ([self.newest] if self.newest is not None else [])
        if most is None or len(points) <= most:
            return points
        steps, picked = [e.step for e in points], set()
        for i in range(most):
            target = steps[0] + (steps[-1] - steps[0]) * i / (most - 1)
            j = bisect.bisect_left(steps, target)
            picked.add(j if j == 0 or (j < len(steps) and steps[j] - target < target - steps[j - 1]) else j - 1)
        return [points[j] for j in sorted(picked)]

    def keep(self, most):
        """Hold at most `most` points, evenly spaced; the next ones are added to them."""
        self.kept, self.newest, self.stride, self.seen = self.entries(most), None, 1, 0


class Records:
    """The step (or evaluation) records of a log as they stream in, each kept in as much detail as budget bytes of
    page can hold, as fit cuts them at the end: the newest whole while their sum fits, older ones without their
    per-token lists while those fit, older still reduced to their curve points. What is dropped here fit would have
    cut too; what is held is at most twice the budget and the curve's points."""

    def __init__(self, budget):
        self.budget, self.count = budget, 0
        self.points, self.lean, self.whole = Curve(), collections.deque(), collections.deque()
        self.lean_size = self.whole_size = 0  # of the lean forms of lean and whole; of the whole forms of whole
        self.cut_tokens, self.cut_groups, self.newest = Tally(), Tally(), None

    def add(self, record):
        entry = Entry(record)
        if self.newest is not None and entry.step <= self.newest:
            self._place(entry)
        else:
            self.whole.append(entry)
            self.whole_size += len(entry.whole)
            self.lean_size += len(entry.lean)
            self.count, self.newest = self.count + 1, entry.step
        while self.whole_size > self.budget:  # the oldest cannot be whole on the page: it keeps its lean form
            self._lean(self.whole.popleft())
        while self.lean_size > self.budget:  # nor lean: its curve points (lean is not empty: lean <= whole in each)
            self._bare(self.lean.popleft())

    def _lean(self, entry):
        self.whole_size -= len(entry.whole)
        entry.whole, entry.shown = None, entry.lean
        if entry.tokens:
            self.cut_tokens.add(entry.step)
        self.lean.append(entry)

    def _bare(self, entry):
        self.lean_size -= len(entry.lean)
        entry.lean = entry.shown = entry.bare
        self.cut_groups.add(entry.step)
        self.points.add(entry)

    def _place(self, entry):
        """A step logged twice keeps its last record; one logged out of order goes where its step is."""
        replaced = self.points.drop(entry.step)
        for queue in (self.whole, self.lean):
            for old in [e for e in queue if e.step == entry.step]:
                queue.remove(old)
                self.whole_size -= len(old.whole or b"")
                self.lean_size -= len(old.lean)
                replaced = True
        self.count += not replaced
        points = self.points.entries()
        if not (self.lean or points) or entry.step > (self.lean or points)[-1].step:  # newer than all cut: whole
            self.whole.insert(bisect.bisect([e.step for e in self.whole], entry.step), entry)
            self.whole_size += len(entry.whole)
        elif not points or entry.step > points[-1].step:  # older than a lean one: lean at best
            entry.whole, entry.shown = None, entry.lean
            self.lean.insert(bisect.bisect([e.step for e in self.lean], entry.step), entry)
        else:  # older than one reduced to its curve points: its curve points
            entry.whole, entry.lean, entry.shown = None, entry.bare, entry.bare
            self.points.insert(entry)
            return
        self.lean_size += len(entry.lean)

    def held(self):
        return self.points.entries() + list(self.lean) + list(self.whole)


class Log:
    """What the page shows of a rollouts.jsonl, read line by line (read_log): the run's starts, the step and eval
    records in as much detail as fits, and the lines skipped."""

    def __init__(self, budget=BUDGET):
        self.steps, self.evals, self.starts = Records(budget), Records(budget), []
        self.unparsed = self.misshapen = self.starts_left_out = 0
        self.first_misshapen, self.unfinished = None, False

    def add(self, line, number):
        try:
            record = json.loads(line, parse_constant=lambda word: None)  # NaN and Infinity: null
            where = misshapen(record)
            if where is None:
                {"run": self.start, "step": self.steps.add, "eval": self.evals.add}[record["kind"]](record)
        except (ValueError, RecursionError):  # a line cut mid-write, or nested past reading
            if line.endswith("\n"):
                self.unparsed += 1
            else:  # the last, unfinished: a run writing it as the page is drawn, or one stopped mid-write
                self.unfinished = True
            return
        if where is not None:
            self.misshapen += 1
            self.first_misshapen = self.first_misshapen or f"line {number}: {where}"

    def start(self, record):
        """A start of the run (its run record): the starts at or after the step it starts at are gone from the log
        (a resumed run drops the steps after its checkpoint), so it takes their place."""
        begin = record.get("start_step") or 0
        self.starts = [s for s in self.starts if (s.get("start_step") or 0) < begin]
        if not self.starts:  # the first start's steps are gone too: the log begins again here
            self.starts_left_out = 0
        self.starts.append(_finite(record))
        if len(self.starts) > 2 * STARTS:  # the first and the newest are kept
            self.starts_left_out += len(self.starts) - STARTS
            self.starts = self.starts[:1] + self.starts[-(STARTS - 1):]


def read_log(path, budget=BUDGET):
    """The Log of a rollouts.jsonl, read a line at a time."""
    log = Log(budget)
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                log.add(line, number)
    return log


def fit(log, budget=BUDGET):
    """(steps, evals, notes): the entries the page embeds, within budget bytes. Over it, the per-token lists of the
    oldest steps go first, then the oldest steps' groups (their curves stay), then the oldest evaluations'
    completions, then curve points, evenly (at most CURVE_POINTS steps or evaluations are reduced to theirs); notes
    say what was left out."""
    steps, evals, notes = log.steps, log.evals, []
    steps.points.keep(CURVE_POINTS)  # a long run's curves first: the newest steps' groups are worth more
    evals.points.keep(CURVE_POINTS)
    total = len(embed(log.starts)) + sum(len(e.shown) for e in steps.held() + evals.held())
    for e in list(steps.lean) + list(steps.whole):
        if total <= budget:
            break
        if e.tokens and e.shown is e.whole:
            total += len(e.lean) - len(e.shown)
            e.shown = e.lean
            steps.cut_tokens.add(e.step)
    for records in (steps, evals):
        while (records.lean or records.whole) and total > budget:
            e = (records.lean or records.whole).popleft()
            # its curve point adds to the page while the curves hold fewer than CURVE_POINTS; then it takes the
            # place of another
            total += (len(e.bare) if len(records.points) < CURVE_POINTS else 0) - len(e.shown)
            e.shown = e.bare
            records.cut_groups.add(e.step)
            records.points.add(e)
    if steps.cut_tokens.count:
        notes.append(f"{CUT} the per-token lists of {steps.cut_tokens}; {LOG_NAME} holds them.")
    if steps.cut_groups.count:
        notes.append(f"{CUT} the groups of {steps.cut_groups}; {LOG_NAME} holds them.")
    if evals.cut_groups.count:
        notes.append(f"{CUT} the completions of the held-out evaluation{'s' * (evals.cut_groups.count > 1)} at "
                     f"{str(evals.cut_groups).replace('logged steps', 'steps')}; {LOG_NAME} holds them.")
    shown, sizes = [], lambda entries: sum(len(e.shown) for e in entries)
    total = len(embed(log.starts)) + sizes(steps.held()) + sizes(evals.held())
    for records, what in ((steps, "steps"), (evals, "held-out evaluations")):
        total -= sizes(records.points.entries())
        most = CURVE_POINTS
        kept = records.points.entries(most)
        while total + sizes(kept) > budget and most > 2:  # fewer points while over the budget
            most //= 2
            kept = records.points.entries(most)
        total += sizes(kept)
        if len(kept) < records.cut_groups.count:
            notes.append(f"{CUT} the curve points of {records.cut_groups.count - len(kept):,} of the "
                         f"{records.cut_groups.count:,} {what} whose {'groups' if what == 'steps' else 'completions'} "
                         f"were left out (the curves keep {len(kept):,} of them, evenly spaced, the first and the "
                         f"last among them); {LOG_NAME} holds them.")
        shown.append(kept + list(records.lean) + list(records.whole))
    return shown[0], shown[1], notes


def write_page(run_folder, output=None):
    """Write the run's page (run_folder/rollouts.html, or output) from run_folder/rollouts.jsonl and return its path.
    A line that does not parse (a crash mid-write), or a record of another shape than the page reads, is skipped and
    counted on the page. The page replaces the old one in one rename of a new file made beside it, so a reader never
    opens half of it, and a name planted there is not written through. InputError: no such folder, no rollouts.jsonl
    in it, or an output that is the log itself."""
    folder = Path(run_folder)
    if not folder.is_dir():
        raise InputError(f"{folder}: {'not a folder' if folder.exists() else 'no such run folder'}")
    log_path = folder / LOG_NAME
    if not log_path.is_file():
        raise InputError(f"{folder}: no {LOG_NAME} in it (a run writes one with --log-rollouts > 0)")
    target = Path(output) if output else folder / PAGE_NAME
    with contextlib.suppress(OSError):  # a target not there yet is not the log
        if os.path.samefile(target, log_path):
            raise InputError(f"{target}: is the {LOG_NAME} the page reads; give --output another file")
    try:
        log = read_log(log_path)
    except OSError as e:
        raise InputError(f"{log_path}: cannot be read ({e.strerror or e})")
    page = render(log, folder)
    try:
        write_atomically(target, page)  # a new file made in the folder: no name planted beforehand is written through
    except OSError as e:
        raise InputError(f"{target}: cannot be written ({e.strerror or e})")
    return target


def render(log, folder):
    """The page's bytes, a piece at a time: PAGE with the data embedded, each record's embedded form in turn."""
    steps, evals, notes = fit(log)
    if log.starts_left_out:
        notes.append(f"The options of {log.starts_left_out} of the run's starts are left out of the header (the first "
                     f"and the newest {STARTS - 1} are shown).")
    if log.unparsed:
        notes.append(f"{log.unparsed} line{'s' * (log.unparsed > 1)} of {LOG_NAME} did not parse and "
                     f"{'were' if log.unparsed > 1 else 'was'} skipped (a run stopped mid-write leaves one).")
    if log.unfinished:
        notes.append(f"The last line of {LOG_NAME} is unfinished and was skipped (the run was writing it, or stopped "
                     "mid-write).")
    if log.misshapen:
        notes.append(f"{log.misshapen} record{'s' * (log.misshapen > 1)} of {LOG_NAME} ({log.first_misshapen}"
                     f"{', the first' if log.misshapen > 1 else ''}) {'were' if log.misshapen > 1 else 'was'} not of "
                     "the shape docs/rollout-log.md gives and skipped.")
    run = log.starts[0] if log.starts else {}
    head, tail = PAGE.split("{data}")
    title = html.escape(f"GRPO rollouts: {run.get('run_name') or folder.name}")
    return itertools.chain((head.replace("{title}", title).encode("utf-8"), b'{"run":', embed(run), b',"runs":',
                            embed(log.starts), b',"steps":['), _joined(e.shown for e in steps), (b'],"evals":[',),
                           _joined(e.shown for e in evals),
                           (b'],"steps_logged":', embed(log.steps.count), b',"notes":', embed(notes), b',"folder":',
                            embed(folder.name), b"}", tail.encode("utf-8")))


def _joined(parts):
    """parts with a comma between each two, never all in one piece (a page is written a record at a time)."""
    for i, part in enumerate(parts):
        yield b"," + part if i else part


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tiny_grpo.view", description="Write a run's page, "
                                "RUN_FOLDER/rollouts.html, from its rollouts.jsonl (docs/rollout-log.md).")
    p.add_argument("run_folder", metavar="RUN_FOLDER", help="LOG_DIR/RUN_NAME, the folder holding rollouts.jsonl")
    p.add_argument("--output", metavar="FILE", help="write the page here instead of RUN_FOLDER/rollouts.html")
    args = p.parse_args(argv)
    try:
        path = write_page(args.run_folder, args.output)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1em 2em; color: #222; max-width: 1400px; }
h1 { font-size: 1.3em; } h2 { font-size: 1.15em; margin-top: 1.5em; border-bottom: 1px solid #ccc; }
.muted, .ctx { color: #888; } .note { background: #fff6d5; padding: .3em .6em; }
table.opts td, table.opts th { padding: 0 1em 0 0; text-align: left; font-weight: normal; }
table.opts th.current { font-weight: 600; background: #eef4ff; }
#charts { display: flex; flex-wrap: wrap; gap: 1em; }
.chart { border: 1px solid #ddd; padding: .3em; } .chart h3 { font-size: 1em; margin: 0; }
.chart svg { display: block; } .pt { cursor: pointer; } .legend span { margin-right: 1em; white-space: nowrap; }
.swatch { display: inline-block; width: .8em; height: .8em; margin-right: .3em; vertical-align: middle; }
.controls { position: sticky; top: 0; background: #fff; padding: .4em 0; border-bottom: 1px solid #ddd; z-index: 1; }
.group { border: 1px solid #ccc; margin: .8em 0; padding: .5em; }
.group h3 { font-size: 1em; margin: 0 0 .3em; }
.nograd { background: #eee; color: #555; border: 1px solid #aaa; padding: 0 .4em; margin-left: .6em; font-weight: normal; }
pre { white-space: pre-wrap; word-break: break-word; margin: .2em 0; font: 12px/1.35 ui-monospace, monospace; }
pre.prompt { max-height: 8em; overflow: auto; background: #f6f6f6; padding: .3em; }
.completion { border-top: 1px dashed #ddd; padding: .3em 0; }
.meta { font-size: 12px; } .meta b { font-weight: 600; }
.tokens { white-space: pre-wrap; word-break: break-word; font: 12px/1.6 ui-monospace, monospace; }
.tok { border-radius: 2px; border-right: 1px solid rgba(255,255,255,.9); }
.tok.ctx { background: #eee; color: #999; } .tok.na { color: #555; }
.tok.clip-hi { background: #f59e0b; color: #000; box-shadow: inset 0 -2px #b45309; }
.tok.clip-lo { background: #22d3ee; color: #000; box-shadow: inset 0 2px #0e7490; }
.cols { display: flex; gap: 1em; } .cols > div { flex: 1; min-width: 0; }
.ev { border-top: 1px dashed #ddd; padding: .3em 0; } .right { color: #1a7f37; } .wrong { color: #b42318; }
.faithful { color: #1a7f37; font-size: .85em; } .unfaithful { color: #9a6700; font-size: .85em; }
</style></head>
<body>
<h1 id="title"></h1>
<div id="notes"></div>
<table class="opts" id="opts"></table>
<h2>Learning curves</h2>
<div id="charts"></div>
<div class="controls">
<label>Step <select id="step"></select></label> <button id="prev">&larr;</button> <button id="next">&rarr;</button>
&nbsp; <label>Colour tokens by <select id="colour"></select></label> <span id="legend" class="legend"></span>
</div>
<h2 id="groups-title">Groups</h2>
<div id="groups"></div>
<h2 id="eval-title">Held-out evaluation</h2>
<div id="eval"></div>
<script type="application/json" id="data">{data}</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const $ = id => document.getElementById(id);
const NS = "http://www.w3.org/2000/svg";
const isNum = x => typeof x === "number" && isFinite(x);
function el(tag, cls, text, parent) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (parent) parent.appendChild(e);
  return e;
}
function sv(tag, attrs, parent) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e);
  return e;
}
function fmt(x) {
  if (x === null || x === undefined) return "n/a";
  if (!isNum(x)) return String(x);
  if (x !== 0 && (Math.abs(x) >= 1e5 || Math.abs(x) < 1e-3)) return x.toExponential(2);
  return String(+x.toPrecision(4));
}
const signed = x => isNum(x) && x > 0 ? "+" + fmt(x) : fmt(x);
const at = (list, t) => Array.isArray(list) && isNum(list[t]) ? list[t] : null;
const run = D.run || {}, steps = D.steps || [], evals = D.evals || [];
const runs = D.runs && D.runs.length ? D.runs : [run];  // each start of the run (a resume is one), oldest first
const started = r => isNum(r.start_step) ? r.start_step : 0;
// the start whose options held at a step: step N is the N-th update, made by the newest start before it
const startAt = step => runs.reduce((found, r, i) => started(r) < step ? i : found, 0);
const runAt = step => runs[startAt(step)];

// Header: the run, each start's options (the selected step's marked), what the page left out.
$("title").textContent = "GRPO rollouts: " + (run.run_name || D.folder || "") + (run.experiment ? " (" + run.experiment + ")" : "");
for (const n of D.notes || []) el("p", "note", n, $("notes"));
const OPTIONS = [["group size", r => r.group_size], ["clip eps", r => r.clip_eps], ["KL weight", r => r.kl_weight],
  ["max length", r => r.max_length], ["temperature", r => r.temperature],
  ["reward weights", r => Object.entries(r.reward_weights || {}).map(([k, v]) => k + "=" + fmt(v)).join(", ")]];
function header() {
  const table = $("opts"), cur = steps[+$("step").value], now = cur ? startAt(cur.step) : runs.length - 1;
  const cell = (tr, i, v) => el(i === now && runs.length > 1 ? "th" : "td", i === now && runs.length > 1 ? "current" : null,
    typeof v === "number" ? fmt(v) : v, tr);
  table.textContent = "";
  if (runs.length > 1) {
    const tr = el("tr", null, null, table); el("td", null, "", tr);
    runs.forEach((r, i) => cell(tr, i, (i || started(r) ? "resumed at step " : "started at step ") + started(r)));
  }
  for (const [k, get] of OPTIONS) {
    const values = runs.map(get);
    if (values.every(v => v === undefined || v === null || v === "")) continue;
    const tr = el("tr", null, null, table); el("td", "muted", k, tr);
    values.forEach((v, i) => cell(tr, i, v));
  }
  for (const [k, v] of [["steps logged", isNum(D.steps_logged) ? D.steps_logged : steps.length],
      ["held-out evaluations", evals.length]]) {
    const tr = el("tr", null, null, table); el("td", "muted", k, tr); el("td", null, String(v), tr).colSpan = runs.length;
  }
}

// Learning curves: one point per logged step (held-out accuracy: per evaluation).
const names = [...new Set(steps.flatMap(s => Object.keys(s.scalars || {})))].sort();
const pick = (...tests) => { for (const t of tests) { const n = names.find(x => t.test(x)); if (n) return n; } return null; };
const scalar = name => steps.filter(s => isNum((s.scalars || {})[name])).map(s => [s.step, s.scalars[name]]);
const COLOURS = ["#222", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
function curves() {
  const charts = [];
  const total = pick(/^rollout\\/reward_mean$/, /^reward\\/(total|mean)$/, /^reward(_mean)?$/, /reward_mean$/);
  // the run's terms where it names them; else every reward_X but the statistics and shares
  const weights = [...new Set(runs.flatMap(r => Object.keys(r.reward_weights || {})))];
  const terms = weights.length ? names.filter(n => weights.some(t => n === "rollout/reward_" + t || n === "reward/" + t))
    : names.filter(n => /^(rollout\\/reward_|reward\\/)/.test(n) && n !== total && !/share/.test(n)
      && !/(_|\\/)(mean|std|min|max|total)$/.test(n));
  const reward = [];
  if (total) reward.push({key: "total", label: "total reward (" + total + ")", points: scalar(total)});
  for (const t of terms) reward.push({key: t, label: t.replace(/^(rollout\\/reward_|reward\\/)/, ""), points: scalar(t)});
  charts.push(["reward", "Reward, total and per term (before weighting)", reward]);
  const accName = m => ["eval/accuracy", "accuracy"].find(k => isNum((m || {})[k]));
  let acc = evals.filter(e => accName(e.metrics)).map(e => [e.step, e.metrics[accName(e.metrics)]]);
  if (!acc.length && names.includes("eval/accuracy")) acc = scalar("eval/accuracy");
  charts.push(["accuracy", "Held-out accuracy", [{key: "accuracy", label: "held-out accuracy", points: acc}], [0, 1]]);
  for (const [key, title, re] of [["kl", "KL to the reference", /(^|\\/)kl$/], ["clip", "Clip fraction", /clip_fraction$/],
      ["length", "Completion length (tokens)", /completion_length$/]]) {
    const n = pick(re);
    charts.push([key, title, n ? [{key: key, label: n, points: scalar(n)}] : []]);
  }
  return charts;
}
function chart(key, title, series, parent, range) {
  const box = el("div", "chart", null, parent); box.dataset.chart = key;
  el("h3", null, title, box);
  const pts = series.flatMap(s => s.points);
  if (!pts.length) { el("p", "muted", "not logged in this run", box); return box; }
  const W = 330, H = 170, L = 48, R = 8, T = 8, B = 22;
  let [x0, x1] = [Math.min(...pts.map(p => p[0])), Math.max(...pts.map(p => p[0]))];
  let [y0, y1] = [Math.min(...pts.map(p => p[1]), ...(range || [])), Math.max(...pts.map(p => p[1]), ...(range || []))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - R), Y = y => T + (y1 - y) / (y1 - y0) * (H - T - B);
  const s = sv("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H}, box);
  sv("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999"}, s);
  sv("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#999"}, s);
  const label = (x, y, text, anchor) =>
    sv("text", {x: x, y: y, "font-size": 10, "text-anchor": anchor, fill: "#555"}, s).textContent = text;
  label(L - 3, T + 8, fmt(y1), "end"); label(L - 3, H - B, fmt(y0), "end");
  label(L, H - 6, "step " + fmt(x0), "start"); label(W - R, H - 6, fmt(x1), "end");
  const cur = steps[+$("step").value];
  if (cur && cur.step >= x0 && cur.step <= x1)
    sv("line", {x1: X(cur.step), y1: T, x2: X(cur.step), y2: H - B, stroke: "#bbb", "stroke-dasharray": "3 3", class: "cursor"}, s);
  const legend = el("div", "legend", null, box);
  series.forEach((ser, i) => {
    const colour = COLOURS[i % COLOURS.length];
    const g = sv("g", {"data-series": ser.key}, s);
    sv("polyline", {points: ser.points.map(p => X(p[0]) + "," + Y(p[1])).join(" "), fill: "none", stroke: colour, "stroke-width": 1.5}, g);
    for (const [x, y] of ser.points) {
      const c = sv("circle", {cx: X(x), cy: Y(y), r: 2.5, fill: colour, class: "pt", "data-step": x}, g);
      sv("title", {}, c).textContent = ser.label + " at step " + x + ": " + fmt(y);
      c.addEventListener("click", () => selectStep(x));
    }
    const item = el("span", null, null, legend);
    el("span", "swatch", null, item).style.background = colour;
    item.appendChild(document.createTextNode(ser.label));
  });
  return box;
}
const CHARTS = curves();
function drawCharts() {
  $("charts").textContent = "";
  for (const [key, title, series, range] of CHARTS) chart(key, title, series, $("charts"), range);
  const other = el("div", "chart", null, $("charts")); other.dataset.chart = "other";
  const sel = el("select", null, null, el("label", null, "Any scalar: ", other));
  for (const n of names) el("option", null, n, sel).value = n;
  sel.value = drawCharts.other || (names.includes("train/loss") ? "train/loss" : names[0]) || "";
  const redraw = () => { drawCharts.other = sel.value; const old = other.querySelector(".chart"); if (old) old.remove();
    chart("scalar", sel.value, [{key: "scalar", label: sel.value, points: scalar(sel.value)}], other); };
  sel.addEventListener("change", redraw); redraw();
}

// Controls: the step, and the quantity the tokens are coloured by.
for (let i = 0; i < steps.length; i++)
  el("option", null, "step " + steps[i].step + (steps[i].tokens_left_out ? " (tokens left out)" : "")
    + (steps[i].groups_left_out ? " (groups left out)" : ""), $("step")).value = i;
$("step").value = steps.length - 1;
const hasKL = steps.some(s => (s.groups || []).some(g => (g.completions || []).some(c => Array.isArray(c.kl))));
const MODES = [["adv_ratio", "advantage \\u00d7 ratio"], ["ratio", "ratio \\u03c1 = \\u03c0\\u03b8 / \\u03c0old"],
  ["clipped", "clipped or not"], ...(hasKL ? [["kl", "KL to \\u03c0ref (k3)"]] : []), ["logp", "log-prob under \\u03c0old"]];
for (const [v, t] of MODES) el("option", null, t, $("colour")).value = v;
function selectStep(stepNumber) {
  const i = steps.findIndex(s => s.step === stepNumber);
  if (i >= 0) { $("step").value = i; render(); }
}
$("step").addEventListener("change", render);
$("colour").addEventListener("change", renderGroups);
function move(by) {
  const i = +$("step").value + by;
  if (i >= 0 && i < steps.length) { $("step").value = i; render(); }
}
$("prev").addEventListener("click", () => move(-1));
$("next").addEventListener("click", () => move(1));

// Colours: diverging (blue above, red below) and sequential (purple); clipped tokens get classes of their own.
const diverging = x => x >= 0 ? "rgba(37,99,235," + Math.min(x, 1) * 0.8 + ")" : "rgba(220,38,38," + Math.min(-x, 1) * 0.8 + ")";
const sequential = x => "rgba(126,34,206," + Math.max(0, Math.min(x, 1)) * 0.75 + ")";
function scales(step) {
  const s = {ar: 0, kl: 0, logp: 0, ratio: runAt(step.step).clip_eps || 0.2};
  for (const g of step.groups || []) for (const c of g.completions || []) {
    (c.ratio || []).forEach((r, t) => { if (isNum(r) && isNum(c.advantage)) s.ar = Math.max(s.ar, Math.abs(c.advantage * r)); });
    (c.kl || []).forEach(k => { if (isNum(k)) s.kl = Math.max(s.kl, k); });
    (c.logp_old || []).forEach(l => { if (isNum(l)) s.logp = Math.max(s.logp, -l); });
  }
  return s;
}
function legend(mode, sc) {
  const box = $("legend"); box.textContent = "";
  const item = (cls, colour, text) => { const i = el("span", null, null, box); const sw = el("span", "swatch " + cls, null, i);
    if (colour) sw.style.background = colour; i.appendChild(document.createTextNode(text)); };
  if (mode === "clipped") {
    item("tok clip-hi", null, "clipped high (\\u03c1 > 1+\\u03b5, A > 0)");
    item("tok clip-lo", null, "clipped low (\\u03c1 < 1\\u2212\\u03b5, A < 0)");
  } else if (mode === "adv_ratio") {
    item("", diverging(1), "A\\u00b7\\u03c1 = +" + fmt(sc.ar)); item("", diverging(-1), "\\u2212" + fmt(sc.ar));
  } else if (mode === "ratio") {
    item("", diverging(1), "\\u03c1 \\u2265 1+" + fmt(sc.ratio)); item("", diverging(-1), "\\u03c1 \\u2264 1\\u2212" + fmt(sc.ratio));
  }
  else if (mode === "kl") item("", sequential(1), "KL " + fmt(sc.kl));
  else item("", sequential(1), "log-prob \\u2212" + fmt(sc.logp) + " (darker: less likely)");
  item("tok ctx", null, "context (not the policy's)");
}
function tokenSpan(c, t, mode, sc) {
  const s = el("span", "tok", c.tokens[t]);
  if (Array.isArray(c.action) && c.action[t] === 0) {
    s.classList.add("ctx"); s.title = "context: not chosen by the policy"; return s;
  }
  const r = at(c.ratio, t), lp = at(c.logp_old, t), cl = at(c.clipped, t), kl = at(c.kl, t);
  const A = isNum(c.advantage) ? c.advantage : null;
  s.title = "A " + fmt(A) + ", \\u03c1 " + fmt(r) + ", log \\u03c0old " + fmt(lp) + (kl !== null ? ", KL " + fmt(kl) : "")
    + (cl === 1 ? ", clipped high" : cl === -1 ? ", clipped low" : "");
  s.dataset.clipped = cl === null ? "" : cl;
  let colour = null;
  if (mode === "clipped") { if (cl === 1) s.classList.add("clip-hi"); else if (cl === -1) s.classList.add("clip-lo"); }
  else if (mode === "adv_ratio" && r !== null && A !== null) colour = diverging(sc.ar ? A * r / sc.ar : 0);
  else if (mode === "ratio" && r !== null) colour = diverging((r - 1) / sc.ratio);
  else if (mode === "kl" && kl !== null) colour = sequential(sc.kl ? kl / sc.kl : 0);
  else if (mode === "logp" && lp !== null) colour = sequential(sc.logp ? -lp / sc.logp : 0);
  if (colour) s.style.backgroundColor = colour;
  if ((mode === "clipped" && cl === null) || (mode !== "clipped" && colour === null)) s.classList.add("na");
  return s;
}
function completion(c, mode, sc, parent, rank) {
  const box = el("div", "completion", null, parent); box.dataset.advantage = isNum(c.advantage) ? c.advantage : "";
  const meta = el("div", "meta", null, box);
  el("span", "muted", "#" + rank + " ", meta);
  el("b", null, "advantage " + signed(c.advantage), meta);
  meta.appendChild(document.createTextNode(" \\u00b7 reward " + fmt(c.reward) + " \\u00b7 "
    + Object.entries(c.terms || {}).map(([k, v]) => k + " " + fmt(v)).join(", ") + (c.truncated ? " \\u00b7 truncated at the budget" : "")));
  if (Array.isArray(c.tokens)) {
    const toks = el("div", "tokens", null, box);
    for (let t = 0; t < c.tokens.length; t++) toks.appendChild(tokenSpan(c, t, mode, sc));
    if (!c.tokens.length) el("span", "muted", "(an empty completion)", toks);
    if (!Array.isArray(c.ratio) && !Array.isArray(c.logp_old))
      el("div", "muted", "no per-token values: no pass computed this completion (advantage 0 and no KL: the update skips it)", box);
  } else {
    el("pre", null, c.text, box);
    el("div", "muted", "per-token values left out of this page", box);
  }
}
function renderGroups() {
  const step = steps[+$("step").value], mode = $("colour").value, box = $("groups");
  box.textContent = "";
  if (!step) { $("groups-title").textContent = "Groups"; el("p", "muted", "No step logged yet.", box); return; }
  const sc = scales(step); legend(mode, sc);
  const groups = step.groups || [];
  $("groups-title").textContent = "Step " + step.step + ": " + groups.length + " group" + (groups.length === 1 ? "" : "s")
    + " logged, completions sorted by advantage";
  if (step.groups_left_out) el("p", "note", "This step's groups were left out to keep the page small; its curves stay.", box);
  for (const g of groups) {
    const gb = el("div", "group", null, box); gb.dataset.index = g.index;
    const h = el("h3", null, "Group " + g.index, gb);
    if (g.rewards_equal) el("span", "nograd", "no gradient: all rewards equal", h);
    if (g.question !== undefined && g.question !== g.prompt) {
      const q = el("div", null, null, gb); el("span", "muted", "question: ", q); el("span", "question", g.question, q);
    }
    const p = el("div", null, null, gb); el("span", "muted", "answer: ", p); el("span", "answer", g.answer, p);
    el("pre", "prompt", g.prompt, gb);
    const adv = c => isNum(c.advantage) ? c.advantage : -1e300;
    const cs = (g.completions || []).slice().sort((a, b) => adv(b) - adv(a));
    cs.forEach((c, i) => completion(c, mode, sc, gb, i + 1));
  }
}
function renderEval() {
  const step = steps[+$("step").value], box = $("eval");
  box.textContent = "";
  const limit = step ? step.step : Infinity;
  const ev = evals.filter(e => e.step <= limit).pop();
  if (!ev) {
    $("eval-title").textContent = "Held-out evaluation";
    el("p", "muted", "No held-out evaluation at or before this step.", box);
    return;
  }
  $("eval-title").textContent = "Held-out evaluation at step " + ev.step + ": "
    + Object.entries(ev.metrics || {}).map(([k, v]) => k + " " + fmt(v)).join(", ");
  if (ev.completions_left_out) { el("p", "note", "Its completions were left out to keep the page small.", box); return; }
  const cols = el("div", "cols", null, box), cs = ev.completions || [];
  for (const [ok, title] of [[false, "Wrong"], [true, "Right"]]) {
    const col = el("div", ok ? "right-col" : "wrong-col", null, cols), these = cs.filter(c => !!c.correct === ok);
    el("h3", ok ? "right" : "wrong", title + " (" + these.length + ")", col);
    for (const c of these) {
      const e = el("div", "ev", null, col);
      if (c.question !== undefined && c.question !== c.prompt) {  // the question, the whole prompt one click away
        el("div", "question", c.question, e);
        const d = el("details", null, null, e); el("summary", "muted", "prompt", d); el("pre", "prompt", c.prompt, d);
      } else el("pre", "prompt", c.prompt, e);
      const a = el("div", null, null, e); el("span", "muted", "answer: ", a); el("span", "answer", c.answer, a);
      el("pre", "text", c.text, e);
      if (ok && typeof c.faithful === "boolean")  // tiny_grpo/skill.py's check, where the task has one
        el("div", c.faithful ? "faithful" : "unfaithful", c.faithful ? "its reasoning computes this answer"
          : "its reasoning does not compute this answer (right by a guess, or by false steps)", e);
      el("div", "meta muted", Object.entries(c.terms || {}).map(([k, v]) => k + " " + fmt(v)).join(", "), e);
    }
  }
}
function render() { header(); drawCharts(); renderGroups(); renderEval(); }
render();
</script>
</body></html>
"""

if __name__ == "__main__":
    sys.exit(main())
