"""The page per run: `python -m tiny_grpo.view LOG_DIR/RUN_NAME [--output FILE]` writes LOG_DIR/RUN_NAME/rollouts.html
from the run's rollouts.jsonl (docs/rollout-log.md): one self-contained file, its data embedded as JSON, that opens
offline and makes no network request. It shows the learning curves, each logged step's groups sorted by advantage with
every completion's tokens coloured by a quantity the reader picks (advantage x ratio, ratio, clipped, KL, log-prob),
and the held-out evaluation's completions, right and wrong. A run calls write_page at each checkpoint and at its end.

Standard library only. Every text from the data reaches the page through textContent, never as HTML."""

import argparse, contextlib, html, json, math, os, sys, tempfile  # noqa: E401
from pathlib import Path

from tiny_grpo.errors import InputError

LOG_NAME, PAGE_NAME = "rollouts.jsonl", "rollouts.html"
BUDGET = 8 * 2**20  # bytes of embedded data: the page stays under 10 MB
PER_TOKEN = ("tokens", "action", "logp_old", "ratio", "clipped", "kl")


def read_log(path):
    """(run, steps, evals, skipped) from a rollouts.jsonl: the first run record, the step and eval records by step
    (a step logged twice keeps its last record), and how many lines did not parse (a crash mid-write leaves one)."""
    run, steps, evals, skipped = {}, {}, {}, 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = _finite(json.loads(line))
            except (ValueError, RecursionError):  # a line cut mid-write, or nested past reading
                skipped += 1
                continue
            if not isinstance(record, dict):
                skipped += 1
                continue
            kind, step = record.get("kind"), record.get("step")
            if kind == "run" and not run:
                run = record
            elif kind in ("step", "eval") and isinstance(step, (int, float)) and not isinstance(step, bool):
                (steps if kind == "step" else evals)[step] = record
    return run, [steps[s] for s in sorted(steps)], [evals[s] for s in sorted(evals)], skipped


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


def _without(step, keys):
    """A copy of a step record whose completions lack keys (or whose groups are gone, keys None)."""
    if keys is None:
        return {**step, "groups": [], "groups_left_out": True}
    groups = [{**g, "completions": [{k: v for k, v in c.items() if k not in keys} for c in g.get("completions") or []
                                    if isinstance(c, dict)]} for g in step.get("groups") or [] if isinstance(g, dict)]
    return {**step, "groups": groups, "tokens_left_out": True}


def _steps(numbers):
    """[1, 2, 3, 5] -> '1-3, 5'."""
    spans = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def fit(steps, evals, budget=BUDGET):
    """(steps, evals, notes): what fits in budget bytes of embedded JSON. Over it, the per-token lists of the oldest
    steps go first, then the oldest steps' groups (their curves stay), then the oldest evaluations' completions;
    notes say what was left out."""
    steps, evals, notes = list(steps), list(evals), []
    sizes = [len(embed(s)) for s in steps] + [len(embed(e)) for e in evals]
    total = sum(sizes)
    for stage, keys in (("per-token lists", PER_TOKEN), ("groups", None)):
        cut = []
        for i, step in enumerate(steps):
            if total <= budget:
                break
            if keys is None or any(k in c for g in step.get("groups") or [] if isinstance(g, dict)
                                   for c in g.get("completions") or [] if isinstance(c, dict) for k in keys):
                steps[i] = _without(step, keys)
                new = len(embed(steps[i]))
                total, sizes[i] = total + new - sizes[i], new
                cut.append(step["step"])
        if cut:
            notes.append(f"Left out to keep this page under 10 MB: the {stage} of step{'s' * (len(cut) > 1)} "
                         f"{_steps(cut)}; {LOG_NAME} holds them.")
    cut = []
    for i, record in enumerate(evals):
        if total <= budget:
            break
        evals[i] = {**record, "completions": [], "completions_left_out": True}
        new = len(embed(evals[i]))
        total, sizes[len(steps) + i] = total + new - sizes[len(steps) + i], new
        cut.append(record["step"])
    if cut:
        notes.append(f"Left out to keep this page under 10 MB: the completions of the held-out evaluation"
                     f"{'s' * (len(cut) > 1)} at step{'s' * (len(cut) > 1)} {_steps(cut)}; {LOG_NAME} holds them.")
    return steps, evals, notes


def write_page(run_folder, output=None):
    """Write the run's page (run_folder/rollouts.html, or output) from run_folder/rollouts.jsonl and return its path.
    A line that does not parse (a crash mid-write) is skipped and counted on the page. The page replaces the old one
    in one rename, so a reader never opens half of it. InputError: no such folder, or no rollouts.jsonl in it."""
    folder = Path(run_folder)
    if not folder.is_dir():
        raise InputError(f"{folder}: {'not a folder' if folder.exists() else 'no such run folder'}")
    log = folder / LOG_NAME
    if not log.is_file():
        raise InputError(f"{folder}: no {LOG_NAME} in it (a run writes one with --log-rollouts > 0)")
    try:
        run, steps, evals, skipped = read_log(log)
    except OSError as e:
        raise InputError(f"{log}: cannot be read ({e.strerror or e})")
    steps, evals, notes = fit(steps, evals)
    if skipped:
        notes.append(f"{skipped} line{'s' * (skipped > 1)} of {LOG_NAME} did not parse and {'were' if skipped > 1 else 'was'} "
                     "skipped (a run stopped mid-write leaves one).")
    title = html.escape(f"GRPO rollouts: {run.get('run_name') or folder.name}")
    data = embed({"run": run, "steps": steps, "evals": evals, "notes": notes, "folder": folder.name})
    head, tail = PAGE.split("{data}")
    page = head.replace("{title}", title).encode("utf-8") + data + tail.encode("utf-8")
    target = Path(output) if output else folder / PAGE_NAME
    temporary = None
    try:
        with tempfile.NamedTemporaryFile("wb", dir=target.parent, prefix=f".{target.name}.", delete=False) as f:
            temporary = f.name
            f.write(page)
        os.chmod(temporary, 0o644)
        os.replace(temporary, target)
    except OSError as e:
        if temporary:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        raise InputError(f"{target}: cannot be written ({e.strerror or e})")
    return target


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
table.opts td { padding: 0 1em 0 0; }
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

// Header: the run, its options, what the page left out.
$("title").textContent = "GRPO rollouts: " + (run.run_name || D.folder || "") + (run.experiment ? " (" + run.experiment + ")" : "");
for (const n of D.notes || []) el("p", "note", n, $("notes"));
const opts = [["group size", run.group_size], ["clip eps", run.clip_eps], ["KL weight", run.kl_weight],
  ["max length", run.max_length], ["temperature", run.temperature],
  ["reward weights", Object.entries(run.reward_weights || {}).map(([k, v]) => k + "=" + fmt(v)).join(", ")],
  ["steps logged", steps.length], ["held-out evaluations", evals.length]];
for (const [k, v] of opts) {
  if (v === undefined || v === null || v === "") continue;
  const tr = el("tr", null, null, $("opts")); el("td", "muted", k, tr); el("td", null, typeof v === "number" ? fmt(v) : v, tr);
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
  const weights = Object.keys(run.reward_weights || {});
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
  const s = {ar: 0, kl: 0, logp: 0, ratio: run.clip_eps || 0.2};
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
      el("div", "meta muted", Object.entries(c.terms || {}).map(([k, v]) => k + " " + fmt(v)).join(", "), e);
    }
  }
}
function render() { drawCharts(); renderGroups(); renderEval(); }
render();
</script>
</body></html>
"""

if __name__ == "__main__":
    sys.exit(main())
