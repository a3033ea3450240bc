"""The page per run: `python -m tiny_grpo.view LOG_DIR/RUN_NAME [--output FILE]` writes LOG_DIR/RUN_NAME/rollouts.html
from the run's rollouts.jsonl (docs/rollout-log.md): one self-contained file, its data embedded as JSON, that opens
offline and makes no network request. It shows the learning curves (reward, held-out accuracy beside the best guess
that needs no skill, the share of groups with a gradient, entropy, gradient norm, completion length, ...), two held-out
evaluations compared (the questions gained and lost, the answers given against the true ones), a search over every
prompt and completion, each logged step's learning signal and groups (those without a gradient folded; filters by
reward, advantage sign and cut at the budget) sorted by advantage, with every completion's tokens coloured by a
quantity the reader picks (the change of its log-prob under the update, advantage x ratio, ratio, clipped, KL,
log-prob), and the held-out evaluation's completions, right and wrong. A run draws it at each checkpoint and at its
end.

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
PER_TOKEN = ("tokens", "action", "logp_old", "logp_new", "ratio", "clipped", "kl")
CUT = "Left out to keep this page under 10 MB:"

# The shape of each kind of record the page reads (docs/rollout-log.md); a field may be absent or null, but a step's
# number. A record of another shape is skipped and counted: one would stop the page's script.
NUMBER, TEXT, FLAG, WHOLE, NUMBERS, LIST = ("a number", "a text", "true or false", "a whole number",
                                            "an object of numbers", "a list")
COMPLETION = {"text": TEXT, "reward": NUMBER, "terms": NUMBERS, "advantage": NUMBER, "truncated": FLAG,
              **{name: LIST for name in PER_TOKEN}}
SHAPES = {
    "run": {"experiment": TEXT, "run_name": TEXT, "group_size": NUMBER, "clip_eps": NUMBER, "kl_weight": NUMBER,
            "max_length": NUMBER, "temperature": NUMBER, "reward_weights": NUMBERS, "start_step": WHOLE,
            "epochs_per_step": NUMBER, "updates_per_step": NUMBER},
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
[hidden] { display: none !important; }
.muted, .ctx { color: #888; } .note { background: #fff6d5; padding: .3em .6em; }
table.opts td, table.opts th { padding: 0 1em 0 0; text-align: left; font-weight: normal; }
table.opts th.current { font-weight: 600; background: #eef4ff; }
#charts { display: flex; flex-wrap: wrap; gap: 1em; }
.chart { border: 1px solid #ddd; padding: .3em; } .chart h3 { font-size: 1em; margin: 0; }
.chart svg { display: block; } .pt { cursor: pointer; } .legend span { margin-right: 1em; white-space: nowrap; }
.chart .legend { max-width: 330px; font-size: 12px; } .chart .legend > span { display: inline-block; max-width: 100%; white-space: normal; }
text.val { paint-order: stroke; stroke: #fff; stroke-width: 3px; stroke-linejoin: round; }
.swatch { display: inline-block; width: .8em; height: .8em; margin-right: .3em; vertical-align: middle; }
.swatch.dashed { height: 0; border-top: 2px dashed; background: none !important; }
.controls { position: sticky; top: 0; background: #fff; padding: .4em 0; border-bottom: 1px solid #ddd; z-index: 1; }
.controls .row { margin-top: .3em; font-size: 13px; }
option:disabled { color: #aaa; }
button.link { background: none; border: none; padding: 0; color: #1d4ed8; text-decoration: underline; cursor: pointer;
  font: inherit; }
.group { border: 1px solid #ccc; margin: .8em 0; padding: .5em; }
.group > summary { cursor: pointer; } .group > summary h3 { display: inline; }
.group h3 { font-size: 1em; margin: 0 0 .3em; }
.gstats { font-size: 12px; margin-left: .8em; color: #444; } .drawn { font-size: 12px; color: #555; margin: .2em 0; }
.nograd { background: #eee; color: #555; border: 1px solid #aaa; padding: 0 .4em; margin-left: .6em; font-weight: normal; }
.signal { background: #eef4ff; padding: .3em .6em; }
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
.changes { max-height: 30em; overflow: auto; } .said { font-size: 12px; margin-top: .2em; }
.given { font-family: ui-monospace, monospace; background: #f3f3f3; padding: 0 .2em; }
.hist { border: 1px solid #ddd; padding: .3em; margin-top: .8em; } .hist h3 { font-size: 1em; margin: 0; }
#found { max-height: 20em; overflow: auto; font-size: 13px; } #found li { margin: .15em 0; }
.snippet { color: #444; margin-left: .6em; font-family: ui-monospace, monospace; font-size: 12px; }
mark { background: #fde68a; } .flash { outline: 3px solid #f59e0b; outline-offset: 2px; }
</style></head>
<body>
<h1 id="title"></h1>
<div id="notes"></div>
<table class="opts" id="opts"></table>
<h2>Learning curves</h2>
<p class="muted" id="numbering"></p>
<div id="charts"></div>
<h2>Held-out evaluations compared</h2>
<div><label>from <select id="eval-a"></select></label> <label>to <select id="eval-b"></select></label></div>
<div id="compare"></div>
<h2>Find</h2>
<div><input id="find" type="search" size="60" aria-label="find"
  placeholder="a text in any prompt or completion, at every step and held-out evaluation">
<span id="find-count" class="muted"></span></div>
<ol id="found"></ol>
<div class="controls">
<label>Step <select id="step"></select></label> <button id="prev">&larr;</button> <button id="next">&rarr;</button>
&nbsp; <label>Colour tokens by <select id="colour"></select></label> <span id="legend" class="legend"></span>
<div id="ratio-note" class="row muted" hidden></div>
<div class="row">Show completions: <label>reward <select id="f-reward"><option value="all">all</option>
<option value="rewarded">rewarded (&gt; 0)</option><option value="unrewarded">unrewarded (&le; 0)</option>
</select></label>
<label>advantage <select id="f-adv"><option value="all">all</option><option value="pos">A &gt; 0</option>
<option value="neg">A &lt; 0</option><option value="zero">A = 0</option></select></label>
<label>cut at the budget <select id="f-cut"><option value="all">all</option><option value="cut">cut</option>
<option value="whole">not cut</option></select></label>
<button id="unfold"></button> <span id="filter-count" class="muted"></span></div>
</div>
<h2 id="groups-title">Groups</h2>
<p id="signal"></p>
<p class="muted" id="adv-note"></p>
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
const list = x => Array.isArray(x) ? x : [];
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
const words = (parent, text) => parent.appendChild(document.createTextNode(text));
function fmt(x) {
  if (x === null || x === undefined) return "n/a";
  if (!isNum(x)) return String(x);
  if (x !== 0 && (Math.abs(x) >= 1e5 || Math.abs(x) < 1e-3)) return x.toExponential(2);
  return String(+x.toPrecision(4));
}
const signed = x => isNum(x) && x > 0 ? "+" + fmt(x) : fmt(x);
const pct = x => isNum(x) ? +(100 * x).toPrecision(3) + "%" : "n/a";
const at = (values, t) => Array.isArray(values) && isNum(values[t]) ? values[t] : null;
function prob(lp) {  // a probability from its log, as many digits as tell it from its neighbours
  const p = Math.exp(lp);
  return p > 0.99 ? p.toFixed(4) : p >= 0.001 ? p.toFixed(3) : p.toExponential(1);
}
const run = D.run || {}, steps = D.steps || [], evals = D.evals || [];
const runs = D.runs && D.runs.length ? D.runs : [run];  // each start of the run (a resume is one), oldest first
const started = r => isNum(r.start_step) ? r.start_step : 0;
// the start whose options held at a step: step N is the N-th update, made by the newest start before it
const startAt = step => runs.reduce((found, r, i) => started(r) < step ? i : found, 0);
const runAt = step => runs[startAt(step)];
const completionsOf = step => list(step.groups).flatMap(g => list(g.completions));
// the optimizer updates a step makes (epochs per step x updates per step), where the run record says
const updatesOf = r => isNum(r.epochs_per_step) && isNum(r.updates_per_step)
  ? r.epochs_per_step * r.updates_per_step : null;
const klOn = step => isNum(runAt(step.step).kl_weight) && runAt(step.step).kl_weight > 0;
// the answer a completion gave: the text inside its last <answer>...</answer>, trimmed; null where it gave none
function answerOf(text) {
  let found = null;
  if (typeof text === "string") for (const m of text.matchAll(/<answer>([\\s\\S]*?)<\\/answer>/g)) found = m[1].trim();
  return found;
}

// Header: the run, each start's options (the selected step's marked), what the page left out.
$("title").textContent = "GRPO rollouts: " + (run.run_name || D.folder || "") + (run.experiment ? " (" + run.experiment + ")" : "");
for (const n of D.notes || []) el("p", "note", n, $("notes"));
const OPTIONS = [["group size", r => r.group_size], ["clip eps", r => r.clip_eps], ["KL weight", r => r.kl_weight],
  ["max length", r => r.max_length], ["temperature", r => r.temperature],
  ["epochs per step", r => r.epochs_per_step], ["updates per step", r => r.updates_per_step],
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
// How steps are numbered (tiny_grpo/bookkeeping.py: a step's record is written after its update, the count of
// updates done already advanced), so that a reader knows which policy sampled what.
const perStep = updatesOf(run);
$("numbering").textContent = "Step N's groups were sampled by the policy after N\\u22121 updates; its update is the "
  + "N-th. A held-out evaluation at step N tests the policy after N updates (at step 0: the model before any)."
  + (perStep > 1 ? " Here a step's update is " + perStep + " optimizer updates (epochs per step \\u00d7 updates per "
    + "step)." : "");

// Learning curves: one point per logged step (held-out accuracy: per evaluation).
const names = [...new Set(steps.flatMap(s => Object.keys(s.scalars || {})))].sort();
const pick = (...tests) => { for (const t of tests) { const n = names.find(x => t.test(x)); if (n) return n; } return null; };
const scalar = name => steps.filter(s => isNum((s.scalars || {})[name])).map(s => [s.step, s.scalars[name]]);
const COLOURS = ["#222", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
// a reward term whose weight is 0 in every start that names it: logged, but no part of the total the policy learns
// from
function unrewarded(term) {
  const weights = runs.map(r => (r.reward_weights || {})[term]).filter(isNum);
  return weights.length > 0 && weights.every(w => w === 0);
}
// an evaluation's best score among the guesses that need no skill (eval/baseline_*): [step, score, which guess]
function bestGuess(e) {
  const guesses = Object.entries(e.metrics || {}).filter(([k, v]) => k.startsWith("eval/baseline_") && isNum(v));
  if (!guesses.length) return null;
  const best = Math.max(...guesses.map(g => g[1]));
  const top = guesses.filter(g => g[1] === best).map(g => g[0].slice("eval/baseline_".length));
  const ties = top.length + " guesses tie (" + top.slice(0, 2).join(", ") + (top.length > 2 ? ", \\u2026" : "") + ")";
  return [e.step, best, top.length === 1 ? top[0] : ties];
}
function curves() {
  const charts = [];
  const total = pick(/^rollout\\/reward_mean$/, /^reward\\/(total|mean)$/, /^reward(_mean)?$/, /reward_mean$/);
  // the run's terms where it names them; else every reward_X but the statistics and shares
  const weights = [...new Set(runs.flatMap(r => Object.keys(r.reward_weights || {})))];
  const terms = weights.length ? names.filter(n => weights.some(t => n === "rollout/reward_" + t || n === "reward/" + t))
    : names.filter(n => /^(rollout\\/reward_|reward\\/)/.test(n) && n !== total && !/share/.test(n)
      && !/(_|\\/)(mean|std|min|max|total)$/.test(n));
  const termOf = n => n.replace(/^(rollout\\/reward_|reward\\/)/, "");
  const reward = [];
  if (total) reward.push({key: "total", label: "total reward (" + total + ")", points: scalar(total)});
  for (const t of terms) {
    const off = unrewarded(termOf(t));  // drawn dashed: a reader must not take it for what the policy is paid for
    reward.push({key: t, label: termOf(t) + (off ? " (not rewarded)" : ""), points: scalar(t), dashed: off});
  }
  charts.push({key: "reward", title: "Reward: the total, then each term (before weighting)", series: reward});
  const accName = m => ["eval/accuracy", "accuracy"].find(k => isNum((m || {})[k]));
  let acc = evals.filter(e => accName(e.metrics)).map(e => [e.step, e.metrics[accName(e.metrics)]]);
  if (!acc.length && names.includes("eval/accuracy")) acc = scalar("eval/accuracy");
  const accuracy = [{key: "accuracy", label: "held-out accuracy", points: acc}];
  const guesses = evals.map(bestGuess).filter(Boolean);
  if (guesses.length && acc.length)
    accuracy.push({key: "guess", label: "best guess needing no skill: " + guesses[guesses.length - 1][2],
      points: guesses, dashed: true});
  charts.push({key: "accuracy", title: "Held-out accuracy, and the best guess", series: accuracy});
  const zero = "rollout/zero_spread_groups";
  const differ = {key: "signal", label: "groups whose rewards differ (1 \\u2212 " + zero + ")",
    points: scalar(zero).map(([x, y]) => [x, 1 - y])};
  charts.push({key: "signal", title: "Share of groups with a gradient", series: names.includes(zero) ? [differ] : []});
  for (const [key, title, re] of [["entropy", "Entropy (per token, of the completions trained)", /^train\\/entropy$/],
      ["grad_norm", "Gradient norm", /(^|\\/)grad_norm$/],
      ["length", "Completion length (tokens)", /completion_length$/],
      ["clip", "Clip fraction", /clip_fraction$/], ["kl", "KL to the reference", /(^|\\/)kl$/]]) {
    const n = pick(re);
    charts.push({key: key, title: title, series: n ? [{key: key, label: n, points: scalar(n)}] : []});
  }
  return charts;
}
const extent = xs => [Math.min(...xs), Math.max(...xs)];
// the points whose value is written beside them, the most wanted first: the last, first, highest and lowest of the
// first curve (every one of a short lone curve), the last of the others
function marked(points, first, alone) {
  if (!points.length) return [];
  const last = points.length - 1, ys = points.map(p => p[1]);
  if (!first) return [last];
  const most = [last, 0, ys.lastIndexOf(Math.max(...ys)), ys.lastIndexOf(Math.min(...ys))];
  return [...new Set(alone && points.length <= 12 ? [...most, ...points.keys()] : most)];
}
// A line chart, its y axis fitted to the data (no range forced on it), the lowest and highest values marked on it.
function chart(spec, parent) {
  const box = el("div", "chart", null, parent); box.dataset.chart = spec.key;
  el("h3", null, spec.title, box);
  const series = spec.series.filter(s => s.points.length), pts = series.flatMap(s => s.points);
  if (!pts.length) { el("p", "muted", "not logged in this run", box); return box; }
  const W = 330, H = 170, L = 48, R = 16, T = 14, B = 22;
  let [x0, x1] = extent(pts.map(p => p[0]));
  const [lo, hi] = extent(pts.map(p => p[1]));
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  const pad = (hi - lo) * 0.1 || Math.abs(hi) * 0.1 || 0.1, y0 = lo - pad, y1 = hi + pad;  // room for the labels
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - R), Y = y => T + (y1 - y) / (y1 - y0) * (H - T - B);
  const s = sv("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H}, box);
  sv("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999"}, s);
  sv("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#999"}, s);
  const label = (x, y, text, anchor, parent, cls) => sv("text", {x: x, y: y, "font-size": cls ? 9 : 10,
    "text-anchor": anchor, fill: cls ? "#333" : "#555", class: cls || "axis"}, parent || s).textContent = text;
  for (const y of lo === hi ? [lo] : [lo, hi]) {  // the data's lowest and highest values, with a faint line across
    sv("line", {x1: L, y1: Y(y), x2: W - R, y2: Y(y), stroke: "#eee"}, s);
    label(L - 3, Y(y) + 3, fmt(y), "end");
  }
  label(L, H - 6, "step " + fmt(x0), "start"); label(W - R, H - 6, fmt(x1), "end");
  const cur = steps[+$("step").value];
  if (cur && cur.step >= x0 && cur.step <= x1)
    sv("line", {x1: X(cur.step), y1: T, x2: X(cur.step), y2: H - B, stroke: "#bbb", "stroke-dasharray": "3 3", class: "cursor"}, s);
  const legend = el("div", "legend", null, box), placed = [];
  // a value label is written only where it covers no other: curves that meet (a term equal to the total) say it once
  const free = (x, y, text, anchor) => {
    const w = text.length * 5 + 4, mid = anchor === "start" ? x + w / 2 : anchor === "end" ? x - w / 2 : x;
    if (placed.some(([px, py, pw]) => Math.abs(px - mid) < (pw + w) / 2 && Math.abs(py - y) < 10)) return false;
    placed.push([mid, y, w]);
    return true;
  };
  spec.series.forEach((ser, i) => {
    const colour = COLOURS[i % COLOURS.length];
    const g = sv("g", {"data-series": ser.key}, s);
    sv("polyline", {points: ser.points.map(p => X(p[0]) + "," + Y(p[1])).join(" "), fill: "none", stroke: colour,
      "stroke-width": 1.5, ...(ser.dashed ? {"stroke-dasharray": "5 3"} : {})}, g);
    for (const [x, y, note] of ser.points) {
      const c = sv("circle", {cx: X(x), cy: Y(y), r: 2.5, fill: colour, class: "pt", "data-step": x}, g);
      sv("title", {}, c).textContent = ser.label + " at step " + x + ": " + fmt(y) + (note ? " (" + note + ")" : "");
      c.addEventListener("click", () => selectStep(x));
    }
    for (const j of marked(ser.points, i === 0, spec.series.length === 1)) {
      const [x, y] = ser.points[j], ty = Y(y) < T + 10 ? Y(y) + 11 : Y(y) - 4;
      const anchor = X(x) < L + 15 ? "start" : X(x) > W - R - 15 ? "end" : "middle";
      if (free(X(x), ty, fmt(y), anchor)) label(X(x), ty, fmt(y), anchor, g, "val");
    }
    const item = el("span", null, null, legend);
    const swatch = el("span", "swatch" + (ser.dashed ? " dashed" : ""), null, item);
    swatch.style[ser.dashed ? "borderColor" : "background"] = colour;
    words(item, ser.label);
  });
  return box;
}
const CHARTS = curves();
function drawCharts() {
  $("charts").textContent = "";
  for (const spec of CHARTS) chart(spec, $("charts"));
  const other = el("div", "chart", null, $("charts")); other.dataset.chart = "other";
  const sel = el("select", null, null, el("label", null, "Any scalar: ", other));
  for (const n of names) el("option", null, n, sel).value = n;
  // a quantity a reader learns from first, not the loss (about 0 in GRPO whatever the policy does)
  sel.value = drawCharts.other
    || ["rollout/accuracy", "train/entropy", "rollout/reward_mean"].find(n => names.includes(n)) || names[0] || "";
  const redraw = () => { drawCharts.other = sel.value; const old = other.querySelector(".chart"); if (old) old.remove();
    chart({key: "scalar", title: sel.value, series: [{key: "scalar", label: sel.value, points: scalar(sel.value)}]},
      other); };
  sel.addEventListener("change", redraw); redraw();
}

// Controls: the step, and the quantity the tokens are coloured by.
for (let i = 0; i < steps.length; i++)
  el("option", null, "step " + steps[i].step + (steps[i].tokens_left_out ? " (tokens left out)" : "")
    + (steps[i].groups_left_out ? " (groups left out)" : ""), $("step")).value = i;
$("step").value = steps.length - 1;
const logged = name => steps.some(s => completionsOf(s).some(c => Array.isArray(c[name])));
const hasKL = logged("kl"), hasNew = logged("logp_new");
const MODES = [...(hasNew ? [["change", "change under the update: log \\u03c0new \\u2212 log \\u03c0old"]] : []),
  ["adv_ratio", "advantage \\u00d7 ratio"], ["ratio", "ratio \\u03c1 = \\u03c0\\u03b8 / \\u03c0old"],
  ["clipped", "clipped or not"], ...(hasKL ? [["kl", "KL to \\u03c0ref (k3)"]] : []), ["logp", "log-prob under \\u03c0old"]];
for (const [v, t] of MODES) el("option", null, t, $("colour")).value = v;
const firstMode = hasNew ? "change" : "adv_ratio";  // what the update did, where the log holds it
$("colour").value = firstMode;
const ONE_UPDATE = "With one update per step the policy that is trained is the one that sampled, so the ratio is "
  + "exactly 1 and the clip cannot act; see the change view for what the update did.";
// Whether a step's update was its only one: the run record says (epochs per step x updates per step); an older log
// does not, and then its ratios say (all exactly 1).
function oneUpdate(step) {
  const n = updatesOf(runAt(step.step));
  if (n !== null) return n === 1;
  let seen = false;
  for (const c of completionsOf(step)) for (const r of list(c.ratio)) {
    if (!isNum(r)) continue;
    if (r !== 1) return false;
    seen = true;
  }
  return seen;
}
// The ratio and clip views show nothing where the ratio is 1 at every token: greyed out, and the reason said.
function ratioModes(step) {
  const one = !!step && oneUpdate(step), sel = $("colour");
  for (const o of sel.options) {
    if (o.value === "ratio" || o.value === "clipped") o.disabled = one;
    if (o.value === "adv_ratio")
      o.textContent = one ? "advantage (\\u00d7 the ratio, 1 here)" : "advantage \\u00d7 ratio";
  }
  $("ratio-note").hidden = !one;
  $("ratio-note").textContent = one ? ONE_UPDATE + (hasNew ? "" : " This log holds no log-probs after the update "
    + "(logp_new), so it has no change view.") : "";
  if (sel.selectedOptions.length && sel.selectedOptions[0].disabled) sel.value = firstMode;
}
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
  const s = {ar: 0, kl: 0, logp: 0, change: 0, ratio: runAt(step.step).clip_eps || 0.2};
  for (const c of completionsOf(step)) {
    list(c.ratio).forEach(r => {
      if (isNum(r) && isNum(c.advantage)) s.ar = Math.max(s.ar, Math.abs(c.advantage * r));
    });
    list(c.kl).forEach(k => { if (isNum(k)) s.kl = Math.max(s.kl, k); });
    list(c.logp_old).forEach((l, t) => {
      if (!isNum(l)) return;
      s.logp = Math.max(s.logp, -l);
      const n = at(c.logp_new, t);
      if (n !== null) s.change = Math.max(s.change, Math.abs(n - l));
    });
  }
  return s;
}
function legend(mode, sc) {
  const box = $("legend"); box.textContent = "";
  const item = (cls, colour, text) => { const i = el("span", null, null, box); const sw = el("span", "swatch " + cls, null, i);
    if (colour) sw.style.background = colour; words(i, text); };
  if (mode === "clipped") {
    item("tok clip-hi", null, "clipped high (\\u03c1 > 1+\\u03b5, A > 0)");
    item("tok clip-lo", null, "clipped low (\\u03c1 < 1\\u2212\\u03b5, A < 0)");
  } else if (mode === "change") {
    item("", diverging(1), "+" + fmt(sc.change) + " (likelier after the update)");
    item("", diverging(-1), "\\u2212" + fmt(sc.change) + " (less likely)");
    words(el("span", "muted", null, box),
      "scale: this step's largest |log \\u03c0new \\u2212 log \\u03c0old|, " + fmt(sc.change));
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
  const r = at(c.ratio, t), lp = at(c.logp_old, t), cl = at(c.clipped, t), kl = at(c.kl, t), lpn = at(c.logp_new, t);
  const A = isNum(c.advantage) ? c.advantage : null, change = lp !== null && lpn !== null ? lpn - lp : null;
  s.title = "A " + fmt(A) + ", \\u03c1 " + fmt(r) + ", log \\u03c0old " + fmt(lp) + (kl !== null ? ", KL " + fmt(kl) : "")
    + (change !== null ? ", p " + prob(lp) + " \\u2192 " + prob(lpn) + " (log-prob " + signed(change) + ")" : "")
    + (cl === 1 ? ", clipped high" : cl === -1 ? ", clipped low" : "");
  s.dataset.clipped = cl === null ? "" : cl;
  let colour = null;
  if (mode === "clipped") { if (cl === 1) s.classList.add("clip-hi"); else if (cl === -1) s.classList.add("clip-lo"); }
  else if (mode === "change" && change !== null) colour = diverging(sc.change ? change / sc.change : 0);
  else if (mode === "adv_ratio" && r !== null && A !== null) colour = diverging(sc.ar ? A * r / sc.ar : 0);
  else if (mode === "ratio" && r !== null) colour = diverging((r - 1) / sc.ratio);
  else if (mode === "kl" && kl !== null) colour = sequential(sc.kl ? kl / sc.kl : 0);
  else if (mode === "logp" && lp !== null) colour = sequential(sc.logp ? -lp / sc.logp : 0);
  if (colour) s.style.backgroundColor = colour;
  if ((mode === "clipped" && cl === null) || (mode !== "clipped" && colour === null)) s.classList.add("na");
  return s;
}
function completion(c, ci, mode, sc, parent, rank) {
  const box = el("div", "completion", null, parent); box.dataset.advantage = isNum(c.advantage) ? c.advantage : "";
  box.dataset.ci = ci;  // its place in the group as sampled: what Find links to
  const meta = el("div", "meta", null, box);
  el("span", "muted", "#" + rank + " ", meta);
  el("b", null, "advantage " + signed(c.advantage), meta);
  words(meta, " \\u00b7 reward " + fmt(c.reward) + " \\u00b7 " + Object.entries(c.terms || {}).map(([k, v]) => k + " "
    + fmt(v)).join(", ") + (c.truncated ? " \\u00b7 truncated at the budget" : ""));
  if (Array.isArray(c.tokens)) {
    const toks = el("div", "tokens", null, box);
    for (let t = 0; t < c.tokens.length; t++) toks.appendChild(tokenSpan(c, t, mode, sc));
    if (!c.tokens.length) el("span", "muted", "(an empty completion)", toks);
    if (!Array.isArray(c.ratio) && !Array.isArray(c.logp_old))
      el("div", "muted", "no per-token values: no pass computed this completion (advantage 0 and no KL: the update skips it)", box);
    else if (mode === "change" && !Array.isArray(c.logp_new))
      el("div", "muted no-new", "no change shown: a run takes log \u03c0new after the update for one group a step, the "
        + "first with a gradient (one more pass, as costly per completion as the training's forward)", box);
  } else {
    el("pre", null, c.text, box);
    el("div", "muted", "per-token values left out of this page", box);
  }
  return box;
}

// The learning signal: which completions carry a gradient. A_i = (r_i - mean) / (std + eps) within a group, so a
// group whose rewards are equal has A = 0 everywhere and adds nothing to the loss (but for the KL term).
const std = xs => { const m = xs.reduce((a, b) => a + b, 0) / xs.length;
  return xs.length > 1 ? Math.sqrt(xs.reduce((a, x) => a + (x - m) * (x - m), 0) / (xs.length - 1)) : 0; };
function groupStats(g) {
  const cs = list(g.completions), parts = [];
  if (cs.some(c => isNum((c.terms || {}).correctness)))  // right: correctness 1, as the held-out accuracy counts
    parts.push(cs.filter(c => (c.terms || {}).correctness === 1).length + " right of " + cs.length);
  const rs = cs.map(c => c.reward).filter(isNum);
  if (rs.length) {
    const hi = Math.max(...rs), lo = Math.min(...rs);
    parts.push("reward spread " + fmt(hi - lo) + " (std " + fmt(std(rs)) + ")");
    const adv = r => { const c = cs.find(c => c.reward === r && isNum(c.advantage)); return c ? c.advantage : null; };
    parts.push(hi > lo ? "A+ " + signed(adv(hi)) + " (reward " + fmt(hi) + "), A\\u2212 " + signed(adv(lo))
      + " (reward " + fmt(lo) + ")" : "every A = 0");
  }
  return parts.join(" \\u00b7 ");
}
// a completion's own tokens (action 1: not context); null where the page holds no tokens of it
const tokensOf = c => Array.isArray(c.action) ? c.action.filter(a => a === 1).length
  : Array.isArray(c.tokens) ? c.tokens.length : null;
function tokenCount(cs) {
  const counts = cs.map(tokensOf);
  return counts.includes(null) ? null : counts.reduce((a, b) => a + b, 0);
}
// The step's line: the share of completions and tokens with a gradient (the scalars cover the whole step; the logged
// groups may be some of it), or that it had none.
function signal(step) {
  const box = $("signal"), s = step.scalars || {}, gs = list(step.groups), live = gs.filter(g => !g.rewards_equal);
  const zero = s["rollout/zero_spread_groups"], cws = s["rollout/completions_with_signal"];
  const tws = s["rollout/tokens_with_signal"];
  const whole = isNum(zero) || isNum(cws);
  if (whole ? zero === 1 || cws === 0 : gs.length > 0 && !live.length) {
    box.className = "note nograd-step";
    box.textContent = "No gradient " + (whole ? "this step" : "in the logged groups") + ": every group's rewards were "
      + "equal, so every advantage is 0" + (klOn(step) ? "; only the KL term to \\u03c0ref pulls on the weights."
        : ". (AdamW's momentum from earlier steps may still move the weights.)");
    return;
  }
  const parts = [];
  if (isNum(cws))
    parts.push(pct(cws) + " of the step's completions" + (isNum(tws) ? " and " + pct(tws) + " of their tokens" : "")
      + " carried a gradient");
  else if (isNum(zero)) parts.push(pct(1 - zero) + " of the step's groups had rewards that differ");
  if (gs.length) {
    const all = gs.flatMap(g => list(g.completions)), some = live.flatMap(g => list(g.completions));
    const tokens = tokenCount(all);
    parts.push("of the " + gs.length + " logged groups, " + live.length + " had rewards that differ: " + some.length
      + " of " + all.length + " completions" + (tokens ? ", " + tokenCount(some) + " of " + tokens + " tokens" : ""));
  }
  box.className = "signal";
  box.textContent = parts.length ? "Learning signal: " + parts.join("; ") + "." : "";
}

// Where each prompt was drawn: a prompt drawn at several steps links to its other draws.
const DRAWS = new Map();
steps.forEach((s, i) => list(s.groups).forEach(g => {
  if (typeof g.prompt !== "string") return;
  if (!DRAWS.has(g.prompt)) DRAWS.set(g.prompt, []);
  DRAWS.get(g.prompt).push([i, g.index]);
}));
function drawnElsewhere(g, stepIndex, parent) {
  const others = (DRAWS.get(g.prompt) || []).filter(([i]) => i !== stepIndex);
  if (!others.length) return;
  const line = el("div", "drawn", "also drawn at step" + (others.length > 1 ? "s " : " "), parent);
  others.forEach(([i, index], n) => {
    if (n) words(line, ", ");
    el("button", "link", steps[i].step, line).addEventListener("click", () => jumpTo(i, index));
  });
}
function flash(e) {
  e.scrollIntoView({block: "center"});
  e.classList.add("flash");
  setTimeout(() => e.classList.remove("flash"), 2500);
}
// Open a step's group (and one of its completions, ci), filters cleared: they must not hide what was asked for.
function jumpTo(stepIndex, index, ci) {
  for (const id of Object.keys(FILTERS)) $(id).value = "all";
  $("step").value = stepIndex; render();
  const gb = [...document.querySelectorAll("#groups .group")].find(e => e.dataset.index === String(index));
  if (!gb) return;
  gb.open = true;
  const c = ci === undefined ? null : [...gb.querySelectorAll(".completion")].find(e => e.dataset.ci === String(ci));
  flash(c || gb);
}

// Filters on the groups: completions by reward, advantage sign and cut at the budget; a group with none left is hidden.
const FILTERS = {
  "f-reward": {rewarded: c => isNum(c.reward) && c.reward > 0, unrewarded: c => !(isNum(c.reward) && c.reward > 0)},
  "f-adv": {pos: c => isNum(c.advantage) && c.advantage > 0, neg: c => isNum(c.advantage) && c.advantage < 0,
    zero: c => c.advantage === 0},
  "f-cut": {cut: c => c.truncated === true, whole: c => c.truncated !== true}};
let drawn = [];  // the groups drawn: {box, g, completions: [{box, c}]}
function filter() {
  const tests = Object.entries(FILTERS).map(([id, t]) => t[$(id).value]).filter(Boolean);
  let kept = 0, all = 0;
  for (const d of drawn) {
    let n = 0;
    for (const {box, c} of d.completions) { box.hidden = !tests.every(t => t(c)); n += !box.hidden; }
    d.box.hidden = tests.length > 0 && n === 0;
    if (tests.length && n) d.box.open = true;  // a match is shown, even in a group folded for having no gradient
    kept += n; all += d.completions.length;
  }
  $("filter-count").textContent = tests.length ? kept + " of " + all + " completions shown" : "";
}
for (const id of Object.keys(FILTERS)) $(id).addEventListener("change", filter);
function foldLabel() {
  $("unfold").textContent = drawn.some(d => !d.box.open) ? "unfold every group" : "fold the groups without a gradient";
}
$("unfold").addEventListener("click", () => {
  const open = drawn.some(d => !d.box.open);
  for (const d of drawn) d.box.open = open || !d.g.rewards_equal;
  foldLabel();
});
$("adv-note").textContent = "A group's advantages sum to zero: A_i = (r_i \\u2212 mean) / (std + eps) over its "
  + "completions, "
  + "so a group whose rewards are all equal has every A_i = 0 and trains nothing"
  + (runs.some(r => isNum(r.kl_weight) && r.kl_weight > 0) ? " (but for the KL term)" : "")
  + ". Such groups are folded; a click unfolds one.";

// a group's completions, each with its place as sampled, highest advantage first (the rank the page shows)
function byAdvantage(g) {
  const adv = c => isNum(c.advantage) ? c.advantage : -1e300;
  return list(g.completions).map((c, ci) => [c, ci]).sort((a, b) => adv(b[0]) - adv(a[0]));
}
function groupBox(g, stepIndex, mode, sc, parent) {
  const gb = el("details", "group", null, parent); gb.dataset.index = g.index;
  gb.open = !g.rewards_equal;  // a group without a gradient trains nothing: folded, one click away
  gb.addEventListener("toggle", foldLabel);
  const head = el("summary", null, null, gb);
  const h = el("h3", null, "Group " + g.index, head);
  if (g.rewards_equal) el("span", "nograd", "no gradient: all rewards equal", h);
  el("span", "gstats", groupStats(g), head);
  drawnElsewhere(g, stepIndex, gb);
  if (g.question !== undefined && g.question !== g.prompt) {
    const q = el("div", null, null, gb); el("span", "muted", "question: ", q); el("span", "question", g.question, q);
  }
  const p = el("div", null, null, gb); el("span", "muted", "answer: ", p); el("span", "answer", g.answer, p);
  el("pre", "prompt", g.prompt, gb);
  const completions = byAdvantage(g).map(([c, ci], rank) => ({box: completion(c, ci, mode, sc, gb, rank + 1), c: c}));
  drawn.push({box: gb, g: g, completions: completions});
}
function renderGroups() {
  const step = steps[+$("step").value], box = $("groups");
  box.textContent = ""; drawn = [];
  ratioModes(step);
  const mode = $("colour").value;
  if (!step) {
    $("groups-title").textContent = "Groups"; $("signal").textContent = "";
    el("p", "muted", "No step logged yet.", box); foldLabel(); return;
  }
  const sc = scales(step); legend(mode, sc);
  const groups = list(step.groups), folded = groups.filter(g => g.rewards_equal).length;
  $("groups-title").textContent = "Step " + step.step + ": " + groups.length + " group" + (groups.length === 1 ? "" : "s")
    + " logged" + (folded ? " (" + folded + " without a gradient, folded)" : "") + ", completions sorted by advantage";
  signal(step);
  if (step.groups_left_out) el("p", "note", "This step's groups were left out to keep the page small; its curves stay.", box);
  for (const g of groups) groupBox(g, +$("step").value, mode, sc, box);
  filter(); foldLabel();
}

// The held-out evaluation at or before the selected step (or the one a Find result opened), right and wrong.
let pinned = null;
function faithfulness(c, parent) {  // tiny_grpo/skill.py's check, where the task has one
  if (c.correct && typeof c.faithful === "boolean")
    el("div", c.faithful ? "faithful" : "unfaithful", c.faithful ? "its reasoning computes this answer"
      : "its reasoning does not compute this answer (right by a guess, or by false steps)", parent);
}
function renderEval() {
  const step = steps[+$("step").value], box = $("eval");
  box.textContent = "";
  const limit = step ? step.step : Infinity;
  const ev = pinned !== null ? evals[pinned] : evals.filter(e => e.step <= limit).pop();
  if (!ev) {
    $("eval-title").textContent = "Held-out evaluation";
    el("p", "muted", "No held-out evaluation at or before this step.", box);
    return;
  }
  $("eval-title").textContent = "Held-out evaluation at step " + ev.step + ": "
    + Object.entries(ev.metrics || {}).map(([k, v]) => k + " " + fmt(v)).join(", ");
  if (pinned !== null) el("p", "muted", "Opened from Find; choosing a step shows the evaluation at or before it.", box);
  if (ev.completions_left_out) { el("p", "note", "Its completions were left out to keep the page small.", box); return; }
  const cols = el("div", "cols", null, box), cs = list(ev.completions).map((c, ci) => [c, ci]);
  for (const [ok, title] of [[false, "Wrong"], [true, "Right"]]) {
    const col = el("div", ok ? "right-col" : "wrong-col", null, cols), these = cs.filter(([c]) => !!c.correct === ok);
    el("h3", ok ? "right" : "wrong", title + " (" + these.length + ")", col);
    for (const [c, ci] of these) {
      const e = el("div", "ev", null, col); e.dataset.ci = ci;
      if (c.question !== undefined && c.question !== c.prompt) {  // the question, the whole prompt one click away
        el("div", "question", c.question, e);
        const d = el("details", null, null, e); el("summary", "muted", "prompt", d); el("pre", "prompt", c.prompt, d);
      } else el("pre", "prompt", c.prompt, e);
      const a = el("div", null, null, e); el("span", "muted", "answer: ", a); el("span", "answer", c.answer, a);
      el("span", "muted", " \\u00b7 given: ", a); el("span", "given", answerOf(c.text) ?? "(no <answer>)", a);
      el("pre", "text", c.text, e);
      faithfulness(c, e);
      el("div", "meta muted", Object.entries(c.terms || {}).map(([k, v]) => k + " " + fmt(v)).join(", "), e);
    }
  }
}
function jumpToEval(i, ci) {
  pinned = i; renderEval();
  const e = [...document.querySelectorAll("#eval .ev")].find(x => x.dataset.ci === String(ci));
  flash(e || $("eval-title"));
}

// Two held-out evaluations side by side: the questions gained (wrong -> right) and lost (right -> wrong) between
// them, and the answers each gave against the true answers.
const accuracyOf = e => isNum((e.metrics || {})["eval/accuracy"]) ? e.metrics["eval/accuracy"]
  : list(e.completions).length ? list(e.completions).filter(c => c.correct).length / e.completions.length : null;
evals.forEach((e, i) => { for (const id of ["eval-a", "eval-b"])
  el("option", null, "step " + e.step + " (accuracy " + fmt(accuracyOf(e)) + ")", $(id)).value = i; });
$("eval-a").value = 0; $("eval-b").value = evals.length - 1;
const questionOf = c => typeof c.question === "string" && c.question !== "" ? c.question : String(c.prompt);
function keyed(ev) {  // each completion by its question (the n-th of a question asked n times)
  const seen = new Map(), out = new Map();
  for (const c of list(ev.completions)) {
    const q = questionOf(c), n = (seen.get(q) || 0) + 1;
    seen.set(q, n); out.set(q + "\\u0000" + n, c);
  }
  return out;
}
function changes(parent, cls, title, pairs, a, b) {
  const col = el("div", cls, null, parent);
  el("h3", cls === "gained" ? "right" : "wrong", title + " (" + pairs.length + ")", col);
  const box = el("div", "changes", null, col);
  if (!pairs.length) el("p", "muted", "none", box);
  for (const [ca, cb] of pairs) {
    const e = el("div", "ev", null, box);
    el("div", "question", questionOf(ca), e);
    const t = el("div", "meta", null, e); el("span", "muted", "true answer: ", t); el("span", "answer", ca.answer, t);
    for (const [ev, c] of [[a, ca], [b, cb]]) {
      const d = el("div", "said", null, e);
      el("span", c.correct ? "right" : "wrong", "step " + ev.step + (c.correct ? ", right: " : ", wrong: "), d);
      el("span", "given", answerOf(c.text) ?? "(no <answer>)", d);
      faithfulness(c, d);
      el("pre", "text", c.text, d);
    }
  }
}
const isNumber = x => typeof x === "string" && /^-?\\d+(\\.\\d+)?$/.test(x);
const tens = xs => { const ns = xs.filter(isNumber); return [ns.filter(x => Number(x) % 10 === 0).length, ns.length]; };
function countOf(xs) {
  const m = new Map();
  for (const x of xs) m.set(x, (m.get(x) || 0) + 1);
  return m;
}
// The answers an evaluation gave against the true answers: the most frequent given, each beside how often it is the
// true answer; and the share of multiples of 10 among each (a guess of round numbers shows there).
function histogram(ev, parent) {
  const box = el("div", "hist", null, parent); box.dataset.step = ev.step;
  el("h3", null, "Answers given at step " + ev.step + " against the true answers", box);
  if (ev.completions_left_out) {
    el("p", "muted", "Its completions were left out to keep the page small.", box);
    return;
  }
  const cs = list(ev.completions), given = cs.map(c => answerOf(c.text));
  const truth = cs.map(c => typeof c.answer === "string" ? c.answer.trim() : null);
  const G = countOf(given), T = countOf(truth);
  const top = [...G].sort((p, q) => q[1] - p[1]).slice(0, 12);
  el("p", "meta", cs.length + " answers, " + G.size + " different; the most frequent given:", box);
  const most = Math.max(1, ...top.map(([v, n]) => Math.max(n, T.get(v) || 0)));
  const W = 40 + top.length * 40, H = 150, B = 30, S = (H - B - 14) / most;
  const s = sv("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H}, box);
  sv("line", {x1: 30, y1: H - B, x2: W, y2: H - B, stroke: "#999"}, s);
  sv("text", {x: 26, y: 18, "font-size": 9, "text-anchor": "end", fill: "#555"}, s).textContent = String(most);
  top.forEach(([value, n], i) => {
    const name = value === null ? "(none)" : value, truths = T.get(value) || 0, x = 36 + i * 40;
    const g = sv("g", {class: "bin", "data-answer": name, "data-given": n, "data-true": truths}, s);
    sv("title", {}, g).textContent = name + ": given " + n + " times, the true answer " + truths + " times";
    sv("rect", {x: x, y: H - B - n * S, width: 15, height: n * S, fill: "#1f77b4", class: "given-bar"}, g);
    sv("rect", {x: x + 16, y: H - B - truths * S, width: 15, height: truths * S, fill: "#9ca3af", class: "true-bar"},
      g);
    const tally = sv("text", {x: x + 15, y: H - B - n * S - 2, "font-size": 9, "text-anchor": "middle", fill: "#333"},
      g);
    tally.textContent = String(n);
    sv("text", {x: x + 15, y: H - B + 11, "font-size": 9, "text-anchor": "middle", fill: "#333"}, g).textContent =
      name.length > 6 ? name.slice(0, 5) + "\\u2026" : name;
  });
  const key = el("div", "legend", null, box);
  for (const [colour, text] of [["#1f77b4", "given"], ["#9ca3af", "true answer"]]) {
    const i = el("span", null, null, key); el("span", "swatch", null, i).style.background = colour; words(i, text);
  }
  const [g10, gn] = tens(given), [t10, tn] = tens(truth);
  el("p", "tens meta", "Multiples of 10: " + g10 + " of the " + gn + " answers given that are numbers ("
    + pct(gn ? g10 / gn : null) + "); " + t10 + " of the " + tn + " true answers (" + pct(tn ? t10 / tn : null) + ").",
    box);
}
function renderCompare() {
  const box = $("compare");
  box.textContent = "";
  if (!evals.length) { el("p", "muted", "No held-out evaluation logged.", box); return; }
  const a = evals[+$("eval-a").value], b = evals[+$("eval-b").value];
  if (a.completions_left_out || b.completions_left_out)
    el("p", "note", "The completions of one of these evaluations were left out to keep the page small.", box);
  else if (a === b) el("p", "muted", "The same evaluation twice: pick two to see what changed between them.", box);
  else {
    const A = keyed(a), B = keyed(b), gained = [], lost = [];
    let both = 0;
    for (const [k, ca] of A) {
      const cb = B.get(k);
      if (!cb) continue;
      both++;
      if (!ca.correct && cb.correct) gained.push([ca, cb]);
      if (ca.correct && !cb.correct) lost.push([ca, cb]);
    }
    el("p", "compare-summary", "From step " + a.step + " to step " + b.step + ": accuracy " + fmt(accuracyOf(a))
      + " \\u2192 " + fmt(accuracyOf(b)) + "; of the " + both + " questions asked at both, " + gained.length
      + " gained (wrong \\u2192 right), " + lost.length + " lost (right \\u2192 wrong).", box);
    const cols = el("div", "cols", null, box);
    changes(cols, "gained", "Gained: wrong at step " + a.step + ", right at step " + b.step, gained, a, b);
    changes(cols, "lost", "Lost: right at step " + a.step + ", wrong at step " + b.step, lost, a, b);
  }
  const hists = el("div", "cols", null, box);
  for (const ev of a === b ? [a] : [a, b]) histogram(ev, el("div", null, null, hists));
}
for (const id of ["eval-a", "eval-b"]) $(id).addEventListener("change", renderCompare);

// Find: a text in any prompt or completion, at every step and held-out evaluation; a result opens where it is.
const MAX_FOUND = 200;
let corpus = null;  // [{text, lower, where, go}], made at the first search
function buildCorpus() {
  corpus = [];
  const add = (text, where, go) => {
    if (typeof text === "string" && text) corpus.push({text, lower: text.toLowerCase(), where, go});
  };
  steps.forEach((s, i) => list(s.groups).forEach(g => {
    add(g.prompt, "step " + s.step + ", group " + g.index + ", prompt", () => jumpTo(i, g.index));
    byAdvantage(g).forEach(([c, ci], rank) => add(c.text, "step " + s.step + ", group " + g.index + ", completion #"
      + (rank + 1), () => jumpTo(i, g.index, ci)));
  }));
  evals.forEach((e, i) => list(e.completions).forEach((c, ci) => {
    const where = "held-out evaluation at step " + e.step + ", question " + (ci + 1);
    add(c.prompt, where + ", prompt", () => jumpToEval(i, ci));
    add(c.text, where + ", completion", () => jumpToEval(i, ci));
  }));
}
function snippet(parent, text, start, length) {
  const s = el("span", "snippet", null, parent);
  const from = Math.max(0, start - 40), to = Math.min(text.length, start + length + 40);
  words(s, (from ? "\\u2026" : "") + text.slice(from, start));
  el("mark", null, text.slice(start, start + length), s);
  words(s, text.slice(start + length, to) + (to < text.length ? "\\u2026" : ""));
}
function findText() {
  const q = $("find").value.toLowerCase(), found = $("found");
  found.textContent = "";
  if (q.length < 2) { $("find-count").textContent = q ? "type two characters or more" : ""; return; }
  if (!corpus) buildCorpus();
  let n = 0;
  for (const item of corpus) {
    const start = item.lower.indexOf(q);
    if (start < 0 || ++n > MAX_FOUND) continue;
    const li = el("li", null, null, found);
    el("button", "link", item.where, li).addEventListener("click", item.go);
    snippet(li, item.text, start, q.length);
  }
  $("find-count").textContent = !n ? "not found"
    : n + " found" + (n > MAX_FOUND ? ", the first " + MAX_FOUND + " listed" : "");
}
let typing = null;
$("find").addEventListener("input", () => { clearTimeout(typing); typing = setTimeout(findText, 200); });

function render() { pinned = null; header(); drawCharts(); renderGroups(); renderEval(); }
render();
renderCompare();
</script>
</body></html>
"""

if __name__ == "__main__":
    sys.exit(main())
