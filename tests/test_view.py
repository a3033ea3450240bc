"""The page per run (tiny_grpo/view.py), read as a reader would, in a real browser: Playwright driving Debian's
chromium-headless-shell (.ci/run installs it). The run's rollouts.jsonl is built here, field by field as
docs/rollout-log.md gives it. Where no browser is found the browser tests are skipped and say so, but under CI (the
CI variable set) they fail instead: CI must not skip them.

`python tests/test_view.py PAGE.html OUT.png` saves a screenshot of a page (the README's is made so)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tiny_grpo import view  # noqa: E402

HOSTILE = '<script>window.__pwned=1</script> </script> <img src=x onerror="window.__pwned=1"> &lt; \u2028<!-- {data}'
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
TERMS = {"correctness": 1.0, "format": 0.5}


# ---------------------------------------------------------------------------------------------------------------
# A run's log, as docs/rollout-log.md describes it

def completion(text, advantage, reward, ratio=1.0, clipped_at=None, context=None, kl=None, computed=True):
    """One completion of a step record: its text cut into tokens of three characters; ratio everywhere but at
    clipped_at ({token: (ratio, side)}); context: the token indices that are context (action 0)."""
    tokens = [text[i:i + 3] for i in range(0, len(text), 3)]
    action = [0 if context and t in context else 1 for t in range(len(tokens))]
    clipped_at = clipped_at or {}
    per = lambda value: [None if a == 0 else value(t) for t, a in enumerate(action)]  # noqa: E731
    record = {"text": text, "reward": reward, "terms": {"correctness": float(reward >= 1), "format": 1.0},
              "advantage": advantage, "truncated": len(tokens) > 20, "tokens": tokens, "action": action,
              "logp_old": per(lambda t: round(-0.1 - 0.37 * (t % 7), 4)) if computed else None,
              "ratio": per(lambda t: clipped_at.get(t, (ratio, 0))[0]) if computed else None,
              "clipped": per(lambda t: clipped_at.get(t, (ratio, 0))[1]) if computed else None}
    if kl is not None:
        record["kl"] = per(lambda t: round(kl * (1 + t % 3), 4)) if computed else None
    return record


def group(index, prompt, answer, completions):
    rewards = {c["reward"] for c in completions}
    return {"index": index, "prompt": prompt, "answer": answer, "rewards_equal": len(rewards) == 1,
            "completions": completions}


def step_record(step, groups):
    for g in groups:
        if g["prompt"].startswith("<|user|>"):  # a chat prompt: the task's question beside it
            g["question"] = g["prompt"][len("<|user|>"):].split("</s>")[0]
    cs = [c for g in groups for c in g["completions"]]
    mean = lambda values: round(sum(values) / len(values), 4)  # noqa: E731
    scalars = {"rollout/reward_mean": mean([c["reward"] for c in cs]), "rollout/reward_std": 0.5,
               **{f"rollout/reward_{t}": mean([c["terms"][t] for c in cs]) for t in TERMS},
               "rollout/completion_length": mean([len(c["tokens"]) for c in cs]),
               "train/loss": 0.01 * step, "train/clip_fraction": round(0.05 * step, 4), "perf/step_seconds": 3.5,
               **{f"rollout/reward_share_{t}": 0.5 for t in TERMS}}  # each term's share: no term of its own
    if any(c.get("kl") for c in cs):
        scalars["train/kl"] = 0.001 * step
    return {"kind": "step", "step": step, "scalars": scalars, "groups": groups}


def eval_record(step, accuracy, completions):
    return {"kind": "eval", "step": step, "metrics": {"eval/accuracy": accuracy, "eval/format_rate": 1.0},
            "completions": completions}


def records(kl=None, hostile=True):
    """A 3-step run of 2 groups x 4 completions: step 1 has tokens clipped on both sides and a context span, step 2 a
    group of equal rewards whose per-token lists are null (without KL), step 3 the planted hostile text; held-out
    evaluations at steps 0 and 3."""
    planted = HOSTILE if hostile else "plain"
    run = {"kind": "run", "experiment": "experiment_base", "run_name": "synthetic " + planted, "group_size": 4,
           "clip_eps": 0.2, "kl_weight": 0.01 if kl else 0.0, "max_length": 64, "temperature": 0.8,
           "reward_weights": TERMS}
    s1 = [group(0, "What is 2+3?", "5", [
              completion("<think>2+3=5</think><answer>5</answer>", 1.5, 1.5, ratio=1.05, clipped_at={2: (1.31, 1)}, kl=kl),
              completion("<think>guess</think><answer>6</answer>", -0.5, 0.5, ratio=0.95, clipped_at={1: (0.7, -1)}, kl=kl),
              completion("<answer>7</answer>", -0.5, 0.5, kl=kl),
              completion("no tags at all", -0.5, 0.0, kl=kl)]),
          group(1, "Search: capital of France", "Paris", [
              completion("<search>France</search><result>Paris is the capital</result><answer>Paris</answer>", 0.87,
                         1.5, ratio=1.1, context={6, 7, 8, 9, 10, 11, 12}, kl=kl),
              completion("<answer>Lyon</answer>", -0.29, 0.5, kl=kl),
              completion("<answer>Nice</answer>", -0.29, 0.5, kl=kl),
              completion("<answer>Rome</answer>", -0.29, 0.5, kl=kl)])]
    s2 = [group(0, "What is 1+1?", "2", [completion(f"<answer>2</answer>{' ' * i}", 0.0, 1.5, kl=kl,
                                                    computed=bool(kl)) for i in range(4)]),
          group(1, "<|user|>What is 9-4?</s><|assistant|>", "5", [
              completion("<answer>5</answer>", 1.2, 1.5, ratio=1.02, kl=kl),
              completion("<answer>4</answer>", -0.4, 0.5, kl=kl),
              completion("<answer>3</answer>", -0.4, 0.5, kl=kl),
              completion("five", -0.4, 0.0, kl=kl)])]
    s3 = [group(0, planted, planted, [
              completion(planted, 1.0, 1.5, kl=kl), completion("&lt;answer&gt;", -1.0, 0.0, kl=kl),
              completion("<answer>x</answer>", 0.5, 1.0, kl=kl), completion("", -0.5, 0.5, kl=kl)]),
          group(1, "What is 3*3?", "9", [
              completion("<answer>9</answer>", 0.75, 1.5, kl=kl), completion("<answer>8</answer>", -0.25, 0.5, kl=kl),
              completion("<answer>6</answer>", -0.25, 0.5, kl=kl), completion("<answer>3</answer>", -0.25, 0.5, kl=kl)])]
    evals0 = [{"prompt": "What is 4+4?", "answer": "8", "text": "<answer>9</answer>", "correct": False,
               "terms": {"correctness": 0.0, "format": 1.0}},
              {"prompt": "What is 1+4?", "answer": "5", "text": "<answer>5</answer>", "correct": True,
               "terms": {"correctness": 1.0, "format": 1.0}}]
    evals3 = [{"prompt": planted, "answer": planted, "text": planted, "correct": False,
               "terms": {"correctness": 0.0, "format": 0.0}},
              *[{"prompt": f"What is {i}+1?", "answer": str(i + 1), "text": f"<answer>{i + 1}</answer>", "correct": True,
                 "terms": {"correctness": 1.0, "format": 1.0}} for i in range(3)]]
    last = step_record(3, s3)
    if hostile:  # a term's name too: in the run's weights, a completion's terms and a scalar's name
        run["reward_weights"] = {**TERMS, planted: 0.0}
        s3[0]["completions"][0]["terms"][planted] = 1.0
        last["scalars"][f"rollout/reward_{planted}"] = 1.0
    return [run, eval_record(0, 0.5, evals0), step_record(1, s1), step_record(2, s2), last,
            eval_record(3, 0.75, evals3)]


def write_log(folder, recs, tail=""):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "rollouts.jsonl", "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
        f.write(tail)
    return folder


# ---------------------------------------------------------------------------------------------------------------
# Without a browser: the command line, bad input, a damaged log, the size

def cli(*args):
    return subprocess.run([sys.executable, "-m", "tiny_grpo.view", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def test_bad_input_is_one_line_and_exit_code_2(tmp_path):
    for folder, says in ((tmp_path / "missing", "no such run folder"), (tmp_path, "no rollouts.jsonl")):
        result = cli(folder)
        assert result.returncode == 2, result
        assert result.stderr.startswith("error: ") and says in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_a_truncated_last_line_is_skipped_and_said(tmp_path):
    folder = write_log(tmp_path / "run", records(), tail='{"kind": "step", "step": 4, "scalars": {"rollout/rew')
    result = cli(folder, "--output", tmp_path / "page.html")
    assert result.returncode == 0, result.stderr
    page = (tmp_path / "page.html").read_text()
    data = json.loads(page.split('<script type="application/json" id="data">')[1].split("</script>")[0])
    assert [s["step"] for s in data["steps"]] == [1, 2, 3] and [e["step"] for e in data["evals"]] == [0, 3]
    # the last line unfinished: a run writing it as its page is drawn (in a child process), or one stopped mid-write
    assert data["notes"] == ["The last line of rollouts.jsonl is unfinished and was skipped (the run was writing it, "
                             "or stopped mid-write)."]
    assert not (folder / "rollouts.html").exists()  # --output took it
    # the function a run calls, on a log cut mid-write (a lone quote, a half line of bytes) and on nan
    with open(folder / "rollouts.jsonl", "ab") as f:
        f.write(b'\n{"kind": "eval", "step": 5, "metrics": {"eval/accuracy": NaN}}\n{"kind": "st\xe2\x82')
    path = view.write_page(folder)
    assert path == folder / "rollouts.html"
    data = json.loads(path.read_text().split('id="data">')[1].split("</script>")[0],
                      parse_constant=lambda word: pytest.fail(f"{word} in the page's JSON: JSON.parse refuses it"))
    assert data["evals"][-1] == {"kind": "eval", "step": 5, "metrics": {"eval/accuracy": None}}
    assert data["notes"][0].startswith("1 line of rollouts.jsonl did not parse and was skipped")  # no longer the last
    assert data["notes"][1].startswith("The last line of rollouts.jsonl is unfinished") and len(data["notes"]) == 2


def test_the_data_cannot_close_its_script():
    """<, >, & and U+2028/2029 leave the embedded JSON only as \\u escapes; a lone surrogate becomes one too."""
    data = {"text": HOSTILE + "\u2029 \ud800 caf\u00e9", "n": 1}
    embedded = view.embed(data)
    text = embedded.decode("utf-8")
    assert not set("<>&\u2028\u2029") & set(text) and "caf\u00e9" in text
    assert json.loads(text)["text"] == data["text"]


def big_log(folder, steps=20, groups=8, size=8, tokens=300):
    """A log over 8 MB: long completions, every step and group logged."""
    recs = [records()[0]]
    for s in range(1, steps + 1):
        gs = [group(g, f"prompt {g}", "1", [completion("abc" * tokens, 1.0 - k / 4, 1.5 - k / 4, ratio=1.01)
                                            for k in range(size)]) for g in range(groups)]
        recs.append(step_record(s, gs))
    return write_log(folder, recs)


def test_a_large_log_keeps_the_page_under_10_mb(tmp_path):
    folder = big_log(tmp_path / "big")
    assert (folder / "rollouts.jsonl").stat().st_size > 8 * 2**20
    page = view.write_page(folder)
    assert page.stat().st_size < 10 * 10**6
    data = json.loads(page.read_text().split('id="data">')[1].split("</script>")[0])
    assert "Left out to keep this page under 10 MB: the per-token lists of steps 1-" in data["notes"][0]
    assert data["steps"][-1]["groups"][0]["completions"][0]["tokens"]  # the latest steps keep them
    assert "tokens" not in data["steps"][0]["groups"][0]["completions"][0]
    assert len(data["steps"]) == 20 and all(s["scalars"] for s in data["steps"])


# ---------------------------------------------------------------------------------------------------------------
# In a browser

def find_browser():
    """(executable path, None), or (None, why not): Debian's chromium-headless-shell, else a chromium on PATH."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return None, "the playwright package is not installed (pip install -r requirements-dev.txt)"
    for name in (os.environ.get("CHROMIUM"), "chromium-headless-shell", "chromium", "chromium-browser"):
        if name and shutil.which(name):
            return shutil.which(name), None
    return None, ("no Chromium browser found (apt-get install chromium-headless-shell, as .ci/run does; "
                  "or set CHROMIUM to one)")


def launch(playwright):
    path, why = find_browser()
    if path is None:
        raise RuntimeError(why)
    return playwright.chromium.launch(executable_path=path, args=BROWSER_ARGS)


@pytest.fixture(scope="module")
def browser():
    path, why = find_browser()
    if path is None:
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(f"CI must run the browser tests, but {why}")
        pytest.skip(f"no browser for the page's tests: {why}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = launch(p)
        yield b
        b.close()


class Reader:
    """A page opened as a reader opens it, every request and error recorded: requests other than the file itself
    are refused."""

    def __init__(self, browser, path):
        self.url = Path(path).resolve().as_uri()
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.requests, self.errors = [], []
        self.context.route("**/*", self.request)
        self.page = self.context.new_page()
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(f"console: {m.text}"))
        self.page.goto(self.url)

    def request(self, route):
        self.requests.append(route.request.url)
        route.continue_() if route.request.url == self.url else route.abort()

    def js(self, expression, arg=None):
        return self.page.evaluate(expression, arg)

    def choose(self, select, value):
        self.page.select_option(f"#{select}", value)

    def close(self):
        self.context.close()


@pytest.fixture
def reader(browser, tmp_path):
    opened = []

    def read(recs, tail=""):
        path = view.write_page(write_log(tmp_path / f"run{len(opened)}", recs, tail))
        opened.append(Reader(browser, path))
        return opened[-1]

    yield read
    for r in opened:  # what every page must never do, whatever the test did with it
        seen = {"requests other than the page": [u for u in r.requests if u != r.url], "JS errors": r.errors,
                "window.__pwned": r.js("window.__pwned")}
        r.close()
        assert seen == {"requests other than the page": [], "JS errors": [], "window.__pwned": None}
        assert r.requests == [r.url]


def groups_shown(r):
    return r.js("""[...document.querySelectorAll('#groups .group')].map(g => ({
        title: g.querySelector('h3').textContent, prompt: g.querySelector('pre.prompt').textContent,
        advantages: [...g.querySelectorAll('.completion')].map(c => +c.dataset.advantage)}))""")


def test_the_step_selector_changes_the_groups_shown(reader):
    r = reader(records(hostile=False))
    assert r.js("[...document.querySelectorAll('#step option')].map(o => o.textContent)") == ["step 1", "step 2",
                                                                                               "step 3"]
    last = groups_shown(r)
    assert [g["prompt"] for g in last] == ["plain", "What is 3*3?"]  # the latest step first
    r.choose("step", "0")
    first = groups_shown(r)
    assert [g["prompt"] for g in first] == ["What is 2+3?", "Search: capital of France"]
    assert "Step 1: 2 groups" in r.page.inner_text("#groups-title")
    for g in first + last:  # each group's completions by advantage, highest first
        assert g["advantages"] == sorted(g["advantages"], reverse=True) and len(g["advantages"]) == 4
    assert not any("no gradient" in g["title"] for g in first)
    r.page.click("#next")
    second = groups_shown(r)
    assert second[0]["title"] == "Group 0no gradient: all rewards equal" and "no gradient" not in second[1]["title"]
    assert "no pass computed" in r.page.inner_text("#groups .group >> nth=0")
    assert r.page.inner_text("#groups .group >> nth=1 >> .question") == "What is 9-4?"
    # the held-out evaluation at or before the step: step 0's for steps 1 and 2, step 3's for step 3
    assert r.page.inner_text("#eval-title").startswith("Held-out evaluation at step 0: eval/accuracy 0.5")
    assert r.js("document.querySelectorAll('#eval .wrong-col .ev').length") == 1
    assert r.js("document.querySelectorAll('#eval .right-col .ev').length") == 1
    r.choose("step", "2")
    assert r.page.inner_text("#eval-title").startswith("Held-out evaluation at step 3")
    assert r.js("document.querySelectorAll('#eval .right-col .ev').length") == 3


def background(r, selector):
    return r.js(f"[...document.querySelectorAll({json.dumps(selector)})].map(e => getComputedStyle(e).backgroundColor)")


def test_clipped_tokens_show_their_side_and_context_is_grey(reader):
    r = reader(records(hostile=False))
    r.choose("step", "0")
    assert r.js("[...document.querySelectorAll('#colour option')].map(o => o.value)") == \
        ["adv_ratio", "ratio", "clipped", "logp"]  # no KL in this run
    r.choose("colour", "clipped")
    high, low = background(r, '.tok[data-clipped="1"]'), background(r, '.tok[data-clipped="-1"]')
    assert high == ["rgb(245, 158, 11)"] and low == ["rgb(34, 211, 238)"]
    assert r.js("document.querySelector('.tok[data-clipped=\"1\"]').classList.contains('clip-hi')")
    assert r.js("document.querySelector('.tok[data-clipped=\"-1\"]').classList.contains('clip-lo')")
    assert set(background(r, '.tok[data-clipped="0"]')) == {"rgba(0, 0, 0, 0)"}
    context = background(r, "#groups .tok.ctx")
    assert len(context) == 7 and set(context) == {"rgb(238, 238, 238)"}
    text = records()[2]["groups"][1]["completions"][0]["text"]
    assert r.js("[...document.querySelectorAll('#groups .tok.ctx')].map(e => e.textContent).join('')") == text[18:39]
    r.choose("colour", "adv_ratio")  # coloured by A x rho: positive blue, negative red, context still grey
    assert set(background(r, "#groups .tok.ctx")) == {"rgb(238, 238, 238)"}
    first = r.js("getComputedStyle(document.querySelector('#groups .group .completion .tok')).backgroundColor")
    assert first.startswith("rgba(37, 99, 235")  # the best completion's first token: A > 0
    assert r.js("document.querySelectorAll('#groups .tok.clip-hi, #groups .tok.clip-lo').length") == 0


def test_kl_is_offered_only_where_logged(reader):
    r = reader(records(kl=0.002, hostile=False))
    assert "kl" in r.js("[...document.querySelectorAll('#colour option')].map(o => o.value)")
    r.choose("colour", "kl")
    assert background(r, ".tok:not(.ctx)")[0].startswith("rgba(126, 34, 206")
    assert r.js("document.querySelectorAll('[data-chart=\"kl\"] circle').length") == 3


def test_the_learning_curves_have_one_point_per_logged_step(reader):
    r = reader(records(hostile=False))
    count = lambda chart, series: r.js(  # noqa: E731
        f"document.querySelectorAll('[data-chart=\"{chart}\"] g[data-series=\"{series}\"] circle').length")
    assert count("reward", "total") == 3
    assert count("reward", "rollout/reward_correctness") == 3 and count("reward", "rollout/reward_format") == 3
    assert count("accuracy", "accuracy") == 2  # one per held-out evaluation: steps 0 and 3
    assert count("clip", "clip") == 3 and count("length", "length") == 3
    assert "not logged" in r.page.inner_text('[data-chart="kl"]')
    assert r.js("[...document.querySelectorAll('[data-chart=\"reward\"] g')].map(g => g.dataset.series)") == [
        "total", "rollout/reward_correctness", "rollout/reward_format"]  # the run's terms, not their shares
    assert r.js("[...document.querySelectorAll('[data-chart=\"reward\"] g[data-series=\"total\"] circle')]"
                ".map(c => +c.dataset.step)") == [1, 2, 3]
    r.page.click('[data-chart="reward"] g[data-series="total"] circle >> nth=0')  # a point selects its step
    assert r.page.input_value("#step") == "0"


def test_planted_markup_is_shown_as_text_and_runs_nothing(reader):
    r = reader(records())
    for mode in ("adv_ratio", "ratio", "clipped", "logp"):
        r.choose("colour", mode)
    assert r.page.title() == "GRPO rollouts: synthetic " + HOSTILE
    shown = r.js("""({prompt: document.querySelector('#groups pre.prompt').textContent,
        answer: document.querySelector('#groups .answer').textContent,
        completion: [...document.querySelector('#groups .completion .tokens').children].map(t => t.textContent).join(''),
        evalPrompt: document.querySelector('#eval .wrong-col pre.prompt').textContent,
        evalText: document.querySelector('#eval .wrong-col pre.text').textContent,
        title: document.querySelector('#title').textContent,
        scripts: document.scripts.length, images: document.images.length})""")
    assert shown == {"prompt": HOSTILE, "answer": HOSTILE, "completion": HOSTILE, "evalPrompt": HOSTILE,
                     "evalText": HOSTILE, "title": f"GRPO rollouts: synthetic {HOSTILE} (experiment_base)",
                     "scripts": 2, "images": 0}
    assert HOSTILE in r.js("document.querySelector('#groups .completion .meta').textContent")
    assert HOSTILE in r.js("document.querySelector('#opts').textContent")
    names = r.js("[...document.querySelectorAll('option')].map(o => o.textContent)")
    assert "rollout/reward_" + HOSTILE in names  # the scalar list's
    legend = r.js("document.querySelector('[data-chart=\"reward\"] .legend').textContent")
    assert HOSTILE in legend
    visible = r.page.inner_text("#groups")
    assert '<script>window.__pwned=1</script> </script> <img src=x onerror="window.__pwned=1"> &lt;' in visible
    assert "&lt;answer&gt;" in visible


def test_a_log_with_no_step_yet_opens(reader):
    """At a run's first checkpoint the log may hold the run record and step 0's evaluation only."""
    r = reader(records(hostile=False)[:2])
    assert "No step logged yet" in r.page.inner_text("#groups")
    assert r.page.inner_text("#eval-title").startswith("Held-out evaluation at step 0")
    assert "not logged in this run" in r.page.inner_text('[data-chart="reward"]')


def test_a_large_page_opens_and_says_what_it_left_out(reader, tmp_path):
    recs = [json.loads(line) for line in (big_log(tmp_path / "big") / "rollouts.jsonl").open()]
    r = reader(recs)
    assert "per-token lists of steps 1-" in r.page.inner_text("#notes")
    r.choose("step", "0")
    assert "per-token values left out" in r.page.inner_text("#groups .group >> nth=0")
    assert r.js("document.querySelectorAll('[data-chart=\"reward\"] g[data-series=\"total\"] circle').length") == 20


def screenshot(page_html, png_path, width=1280, height=900, full_page=True):
    """Save a PNG of a page (a run's rollouts.html) as a reader's browser shows it: the README's screenshot."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = launch(p)
        page = b.new_page(viewport={"width": width, "height": height})
        page.goto(Path(page_html).resolve().as_uri())
        page.screenshot(path=str(png_path), full_page=full_page)
        b.close()
    return Path(png_path)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python tests/test_view.py PAGE.html OUT.png")
    print(screenshot(sys.argv[1], sys.argv[2]))


def test_each_right_held_out_answer_says_whether_its_reasoning_computes_it(reader):
    """eval/faithful per completion (tiny_grpo/skill.py): a right answer is marked computed or not; a wrong one, and
    one of a task without a checker (null), carry no mark."""
    completions = [{"question": q, "prompt": q, "answer": "11", "text": HOSTILE, "correct": ok, "faithful": f,
                    "terms": {"correctness": float(ok)}}
                   for q, ok, f in [("a", True, True), ("b", True, False), ("c", False, False), ("d", True, None)]]
    r = reader([records(hostile=False)[0], eval_record(0, 0.75, completions)])
    assert r.js("[...document.querySelectorAll('#eval .right-col .ev')].map(e => "
                "(e.querySelector('.faithful, .unfaithful') || {}).className || null)") == [
        "faithful", "unfaithful", None]
    assert r.js("document.querySelectorAll('#eval .wrong-col .faithful, #eval .wrong-col .unfaithful').length") == 0
    assert "its reasoning does not compute this answer" in r.page.inner_text("#eval .right-col")
