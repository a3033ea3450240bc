"""Nothing lost, round five (issue 75), items 1 (the page's part), 3, 11, 12, 15 (the page's part) and 16: the run's
page (tiny_grpo/view.py, docs/rollout-log.md). Each test failed on the code before its fix, but where its docstring
says it held before. The browser tests use test_view.py's browser and reader."""

import json
import os
import subprocess
import sys

import pytest

from test_view import ROOT, browser, cli, reader, records, write_log  # noqa: F401  (browser and reader: fixtures)
from tiny_grpo import view


def embedded(page):
    """The data a page embeds, as its script reads it."""
    return json.loads(page.read_text(encoding="utf-8").split('<script type="application/json" id="data">')[1]
                      .split("</script>")[0])


# ---- item 3: --output the log itself replaced the log with the page ----

@pytest.mark.parametrize("how", ["the same path", "a relative path", "a symbolic link", "a hard link"])
def test_item_3_an_output_that_is_the_log_it_reads_is_refused(tmp_path, how):
    folder = write_log(tmp_path / "run", records(hostile=False))
    log = folder / "rollouts.jsonl"
    before = log.read_bytes()
    output = {"the same path": log, "a relative path": os.path.relpath(log, ROOT)}.get(how)
    if how == "a symbolic link":
        output = tmp_path / "link.jsonl"
        output.symlink_to(log)
    elif how == "a hard link":
        output = tmp_path / "hard.jsonl"
        os.link(log, output)
    result = cli(folder, "--output", output)
    assert result.returncode == 2, result
    assert result.stderr.startswith("error: ") and "rollouts.jsonl" in result.stderr and "reads" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert log.read_bytes() == before and not log.is_symlink()
    assert sorted(p.name for p in folder.iterdir()) == ["rollouts.jsonl"]  # no page, no temporary file left


# ---- item 1, the page's part: a left-over name must lead no write out of the run folder ----

def test_item_1_planted_links_at_the_pages_names_lead_no_write_out_of_the_folder(tmp_path):
    """The page is written to a new file made in the folder (a name no one can plant beforehand), then renamed over
    rollouts.html: a link planted at rollouts.html or at its .partial name is never written through. This held
    before (the page's write went through tempfile already); the test keeps it so."""
    folder = write_log(tmp_path / "run", records(hostile=False))
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("rollouts.html", "rollouts.html.partial", ".rollouts.html.partial"):
        (outside / name).write_text("not the run's")
        (folder / name).symlink_to(outside / name)
    page = view.write_page(folder)
    assert page == folder / "rollouts.html" and page.is_file() and not page.is_symlink()
    assert [s["step"] for s in embedded(page)["steps"]] == [1, 2, 3]
    for name in ("rollouts.html", "rollouts.html.partial", ".rollouts.html.partial"):
        assert (outside / name).read_text() == "not the run's"
    for name in ("rollouts.html.partial", ".rollouts.html.partial"):
        assert os.readlink(folder / name) == str(outside / name)
    assert sorted(p.name for p in folder.iterdir()) == [".rollouts.html.partial", "rollouts.html",
                                                        "rollouts.html.partial", "rollouts.jsonl"]


# ---- item 11: the page read the whole log into memory, in the training process ----

def long_log(folder, steps, tokens=0, groups=1, size=4, scalars=12):
    """A log of `steps` steps written fast: one step record's line repeated with its step number changed; each
    completion with `tokens` tokens and their per-token lists (none: no tokens at all)."""
    completion = {"text": "abc", "reward": 1.0, "terms": {"correctness": 1.0}, "advantage": 0.5,
                  "truncated": False}
    if tokens:
        completion.update(tokens=["abc"] * tokens, action=[1] * tokens, logp_old=[-0.1234] * tokens,
                          ratio=[1.002] * tokens, clipped=[0] * tokens)
    record = {"kind": "step", "step": 0, "scalars": {f"rollout/scalar_{i:02d}": 0.1234 for i in range(scalars)},
              "groups": [{"index": g, "prompt": "What is 2+3?", "answer": "5", "rewards_equal": False,
                          "completions": [completion] * size} for g in range(groups)]}
    head, tail = json.dumps(record).split('"step": 0', 1)
    folder.mkdir(parents=True)
    with open(folder / "rollouts.jsonl", "w", encoding="utf-8") as f:
        f.write(json.dumps(records(hostile=False)[0]) + "\n")
        for s in range(1, steps + 1):
            f.write(f'{head}"step": {s}{tail}\n')
    return folder / "rollouts.jsonl"


def peak_memory(folder):
    """The peak memory of `python -m tiny_grpo.view folder`, in bytes: measured by a parent that runs nothing else."""
    measure = ("import resource, subprocess, sys; r = subprocess.run([sys.executable, '-m', 'tiny_grpo.view', "
               "sys.argv[1]], stdout=subprocess.DEVNULL); "
               "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    result = subprocess.run([sys.executable, "-c", measure, str(folder)], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    code, peak_kb = map(int, result.stdout.split())
    assert code == 0, result.stderr
    return peak_kb * 1024


def test_item_11_the_pages_memory_does_not_grow_with_the_log(tmp_path):
    """Logs of 20 and 110 steps of 1 MB (19 and 103 MB, both past what the page holds): the command's peak memory is
    about the same for both, and under half the larger log's size. Reading a log whole took several times its size
    (618 MB for the larger one here; 1 GB for a 190 MB log)."""
    small, large = (long_log(tmp_path / name, steps, tokens=1000, groups=4, size=8)
                    for name, steps in (("small", 20), ("large", 110)))
    small_size, large_size = small.stat().st_size, large.stat().st_size
    assert large_size > 100 * 10**6
    small_peak, large_peak = peak_memory(small.parent), peak_memory(large.parent)
    assert large_peak < small_peak + (large_size - small_size) / 10, (small_peak / 2**20, large_peak / 2**20)
    assert large_peak < large_size / 2, large_peak / 2**20
    data = embedded(large.parent / "rollouts.html")
    assert [s["step"] for s in data["steps"]] == list(range(1, 111))  # every step's curve points
    assert "tokens" in data["steps"][-1]["groups"][0]["completions"][0]  # the newest steps whole
    whole = sum("tokens" in s["groups"][0]["completions"][0] for s in data["steps"])
    assert 0 < whole < 20 and data["steps"][0]["tokens_left_out"] and data["notes"] == [
        f"Left out to keep this page under 10 MB: the per-token lists of steps 1-{110 - whole}; "
        "rollouts.jsonl holds them."]


def test_item_11_a_small_log_is_embedded_record_for_record(tmp_path):
    """What streaming the log must not change: under the budget the page embeds each record as the log holds it
    (a step logged twice: its last record). This held before; the test keeps it so."""
    recs = records()
    again = json.loads(json.dumps(recs[3]))
    again["scalars"]["train/loss"] = 42.0
    data = embedded(view.write_page(write_log(tmp_path / "run", recs + [again])))
    assert data["run"] == recs[0] and data["notes"] == []
    assert data["steps"] == [recs[2], again, recs[4]] and data["evals"] == [recs[1], recs[5]]


# ---- item 12: one record of the wrong shape blanked the whole page ----

BAD = {  # a record of the wrong shape, and where the page's note says it departs
    "groups an object": ({"kind": "step", "step": 4, "scalars": {}, "groups": {"0": "x"}}, "groups: not a list"),
    "a group a text": ({"kind": "step", "step": 4, "groups": ["x"]}, "groups[0]: not an object"),
    "completions an object": ({"kind": "step", "step": 4, "groups": [{"index": 0, "completions": {"0": {}}}]},
                              "groups[0].completions: not a list"),
    "a completion a number": ({"kind": "step", "step": 4, "groups": [{"index": 0, "completions": [1]}]},
                              "groups[0].completions[0]: not an object"),
    "a per-token list a number": ({"kind": "step", "step": 4, "groups": [{"completions": [{"ratio": 1}]}]},
                                  "groups[0].completions[0].ratio: not a list"),
    "a scalar a text": ({"kind": "step", "step": 4, "scalars": {"train/loss": "high"}},
                        "scalars: not an object of numbers"),
    "a step a text": ({"kind": "step", "step": "4", "scalars": {}}, "step: not a whole number"),
    "an eval's completions an object": ({"kind": "eval", "step": 4, "metrics": {}, "completions": {"a": 1}},
                                        "completions: not a list"),
    "an unknown kind": ({"kind": "note", "step": 4}, "its kind is not run, step or eval"),
    "reward weights a list": ({"kind": "run", "reward_weights": [1, 2]}, "reward_weights: not an object of numbers")}


@pytest.mark.parametrize("bad", BAD)
def test_item_12_a_record_of_the_wrong_shape_is_skipped_and_counted(tmp_path, bad):
    recs, (record, where) = records(hostile=False), BAD[bad]
    data = embedded(view.write_page(write_log(tmp_path / "run", recs[:4] + [record] + recs[4:])))
    assert [s["step"] for s in data["steps"]] == [1, 2, 3] and [e["step"] for e in data["evals"]] == [0, 3]
    assert data["run"] == recs[0] and data["runs"] == [recs[0]]
    assert data["notes"] == [f"1 record of rollouts.jsonl (line 5: {where}) was not of the shape docs/rollout-log.md "
                             "gives and skipped."]


def test_item_12_the_page_draws_the_rest_of_a_log_with_a_misshapen_record(reader):
    recs = records(hostile=False)
    r = reader(recs[:4] + [BAD["groups an object"][0]] + recs[4:])  # the reader fails on any script error
    assert r.js("[...document.querySelectorAll('#step option')].map(o => o.textContent)") == ["step 1", "step 2",
                                                                                               "step 3"]
    assert r.js("document.querySelectorAll('#groups .group').length") == 2
    assert "1 record of rollouts.jsonl (line 5: groups: not a list)" in r.page.inner_text("#notes")


# ---- item 16: a 30,000-step log gave a 15 to 20 MB page that said it was cut to stay under 10 MB ----

def test_item_16_a_30000_step_log_keeps_its_page_under_10_mb_and_says_what_it_left_out(tmp_path):
    log = long_log(tmp_path / "run", 30000, scalars=24)
    page = view.write_page(log.parent)
    assert page.stat().st_size < 10 * 10**6
    data = embedded(page)
    shown = [s["step"] for s in data["steps"]]
    assert shown[0] == 1 and shown[-1] == 30000 and len(shown) < 30000
    assert data["steps"][-1]["groups"]  # the newest steps whole
    thinned = next(n for n in data["notes"] if "curve points" in n)
    assert f"of the {30000 - sum(1 for s in data['steps'] if s['groups'])} " in thinned.replace(",", "")
    assert data["steps_logged"] == 30000


# ---- item 15, the page's part: the header showed the first start's options only ----

def test_item_15_the_header_shows_each_starts_options_and_marks_the_selected_steps(reader):
    recs = records(hostile=False)
    resumed = {**recs[0], "temperature": 1.25, "start_step": 2, "reward_weights": {"<b>terse</b>": 0.5}}
    r = reader([{**recs[0], "start_step": 0}, *recs[1:4], resumed, *recs[4:]])
    table = lambda: r.js("[...document.querySelectorAll('#opts tr')].map(tr => [...tr.children]"  # noqa: E731
                         ".map(td => (td.classList.contains('current') ? '*' : '') + td.textContent))")
    rows = table()
    assert rows[0] == ["", "started at step 0", "*resumed at step 2"]  # step 3 is selected: the second start's
    assert ["temperature", "0.8", "*1.25"] in rows and ["group size", "4", "*4"] in rows
    r.choose("step", "1")  # step 2: the first start's
    rows = table()
    assert rows[0] == ["", "*started at step 0", "resumed at step 2"] and ["temperature", "*0.8", "1.25"] in rows
    assert ["reward weights", "*correctness=1, format=0.5", "<b>terse</b>=0.5"] in rows  # as text
    assert r.js("document.querySelectorAll('#opts b').length") == 0
