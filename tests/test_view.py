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
    assert "no pass computed" not in r.page.inner_text("#groups .group >> nth=0")  # folded: it trains nothing
    r.page.click("#groups .group >> nth=0 >> summary")
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
    # step 3's ratios are all exactly 1: the ratio and clip views are greyed out there
    assert r.js("[...document.querySelectorAll('#colour option:disabled')].map(o => o.value)") == ["ratio", "clipped"]
    for mode in ("adv_ratio", "logp"):
        r.choose("colour", mode)
    r.choose("step", "0")
    for mode in ("ratio", "clipped"):
        r.choose("colour", mode)
    r.choose("step", "2")
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


# ---------------------------------------------------------------------------------------------------------------
# Issue #78: what the update did, the learning signal, charts a learner reads, evaluations compared, finding things

def with_logp_new(recs, epochs=None, updates=None):
    """The records with each computed completion's logp_new, the log-probs after the step's update: the policy moved
    towards a completion of A > 0 (log-prob halved: likelier) and away from one of A < 0 (log-prob x 1.5); the run
    record with epochs_per_step and updates_per_step where given."""
    recs = json.loads(json.dumps(recs))
    for r in recs:
        if r["kind"] == "run" and epochs is not None:
            r.update(epochs_per_step=epochs, updates_per_step=updates)
        for c in (c for g in r.get("groups", []) for c in g["completions"]):
            factor = 0.5 if c["advantage"] > 0 else 1.5 if c["advantage"] < 0 else 1.0
            c["logp_new"] = None if c["logp_old"] is None else [
                None if lp is None else round(lp * factor, 4) for lp in c["logp_old"]]
    return recs


def test_the_change_view_colours_tokens_by_their_log_prob_change_and_is_the_default(reader):
    import math

    r = reader(with_logp_new(records(hostile=False)))
    assert r.js("[...document.querySelectorAll('#colour option')].map(o => o.value)") == [
        "change", "adv_ratio", "ratio", "clipped", "logp"]
    r.choose("step", "0")
    assert r.page.input_value("#colour") == "change"  # the default where the log holds logp_new
    first = "#groups .group >> nth=0 >> .completion >> nth=0 >> .tok >> nth=0"  # A = +1.5: log-prob -0.1 -> -0.05
    second = "#groups .group >> nth=0 >> .completion >> nth=1 >> .tok >> nth=0"  # A = -0.5: -0.1 -> -0.15
    colour = lambda selector: r.page.locator(selector).evaluate("e => getComputedStyle(e).backgroundColor")  # noqa
    assert colour(first).startswith("rgba(37, 99, 235") and colour(second).startswith("rgba(220, 38, 38")
    title = r.page.locator(first).get_attribute("title")
    assert f"p {math.exp(-0.1):.3f} \u2192 {math.exp(-0.05):.3f}" in title and "log-prob +0.05" in title
    assert f"p {math.exp(-0.1):.3f} \u2192 {math.exp(-0.15):.3f}" in r.page.locator(second).get_attribute("title")
    # scaled to the step's largest |change|: -2.32 x 1.5 on a token of A < 0, 1.16
    legend = r.page.inner_text("#legend")
    assert "largest |log \u03c0new \u2212 log \u03c0old|, 1.16" in legend and "+1.16" in legend
    assert r.js("getComputedStyle(document.querySelector('#groups .tok.ctx')).backgroundColor") == "rgb(238, 238, 238)"
    r.choose("step", "1")  # group 0's per-token lists are null (no pass ran it): no colour, said so
    assert r.js("[...document.querySelectorAll('#groups .group:first-child .tok')]"
                ".every(t => t.classList.contains('na'))")
    assert r.js("document.querySelectorAll('#groups .no-new').length") == 0  # every computed one has logp_new
    recs = with_logp_new(records(hostile=False))  # a run takes logp_new for one group a step: the others say why
    steps = [x for x in recs if x["kind"] == "step"]
    i, c = next((i, c) for i, x in enumerate(steps) for g in x["groups"] for c in g["completions"] if c["logp_old"])
    c["logp_new"] = None
    r = reader(recs)
    r.choose("step", str(i))
    assert r.js("document.querySelectorAll('#groups .no-new').length") == 1
    assert "one group a step" in r.page.locator("#groups .no-new").inner_text()
    r.choose("colour", "logp")
    assert r.js("document.querySelectorAll('#groups .no-new').length") == 0  # said in the change view only


def test_the_ratio_views_are_greyed_out_where_a_step_makes_one_update(reader):
    sentence = ("With one update per step the policy that is trained is the one that sampled, so the ratio is "
                "exactly 1 and the clip cannot act; see the change view for what the update did.")
    disabled = "[...document.querySelectorAll('#colour option:disabled')].map(o => o.value)"
    r = reader(with_logp_new(records(hostile=False), epochs=1, updates=1))  # the run record says: at every step
    for step in ("0", "1", "2"):
        r.choose("step", step)
        assert r.js(disabled) == ["ratio", "clipped"] and r.page.inner_text("#ratio-note") == sentence
    assert "ratio, 1 here" in r.js("document.querySelector('#colour option[value=\"adv_ratio\"]').textContent")
    rows = r.js("[...document.querySelectorAll('#opts tr')].map(tr => [...tr.children].map(td => td.textContent))")
    assert ["epochs per step", "1"] in rows and ["updates per step", "1"] in rows
    r = reader(with_logp_new(records(hostile=False), epochs=2, updates=1))  # two: the ratio moves, the clip acts
    r.choose("step", "2")
    assert r.js(disabled) == [] and not r.page.is_visible("#ratio-note")
    assert "a step's update is 2 optimizer updates" in r.page.inner_text("#numbering")
    r = reader(records(hostile=False))  # an older log: its ratios say, step by step (step 3's are all exactly 1)
    assert r.js(disabled) == ["ratio", "clipped"] and "so it has no change view" in r.page.inner_text("#ratio-note")
    r.choose("step", "0")
    assert r.js(disabled) == [] and r.page.inner_text("#ratio-note") == ""
    r.choose("colour", "clipped")
    r.choose("step", "2")  # clipped is no view of step 3: the default instead
    assert r.page.input_value("#colour") == "adv_ratio"


def test_each_group_says_how_many_are_right_its_spread_and_advantages_and_groups_without_gradient_fold(reader):
    recs = records(hostile=False)
    recs[2]["scalars"].update({"rollout/completions_with_signal": 1.0, "rollout/tokens_with_signal": 1.0,
                               "rollout/zero_spread_groups": 0.0})
    for g in recs[4]["groups"]:  # step 3: every group's rewards equal, its scalars say so
        for c in g["completions"]:
            c.update(reward=1.0, advantage=0.0)
        g["rewards_equal"] = True
    recs[4]["scalars"]["rollout/zero_spread_groups"] = 1.0
    r = reader(recs)
    stats = lambda: r.js("[...document.querySelectorAll('#groups .gstats')].map(e => e.textContent)")  # noqa
    r.choose("step", "0")
    assert stats() == ["1 right of 4 \u00b7 reward spread 1.5 (std 0.6292) \u00b7 A+ +1.5 (reward 1.5), "
                       "A\u2212 -0.5 (reward 0)",
                       "1 right of 4 \u00b7 reward spread 1 (std 0.5) \u00b7 A+ +0.87 (reward 1.5), A\u2212 -0.29 "
                       "(reward 0.5)"]
    assert r.page.inner_text("#signal").startswith("Learning signal: 100% of the step's completions and 100% of their "
                                                   "tokens carried a gradient; of the 2 logged groups, 2 had rewards")
    assert "A_i = (r_i \u2212 mean) / (std + eps)" in r.page.inner_text("#adv-note")
    assert "sum to zero" in r.page.inner_text("#adv-note")
    r.choose("step", "1")
    tokens = [len(c["tokens"]) for g in recs[3]["groups"] for c in g["completions"]]
    assert r.page.inner_text("#signal") == (f"Learning signal: of the 2 logged groups, 1 had rewards that differ: 4 "
                                            f"of 8 completions, {sum(tokens[4:])} of {sum(tokens)} tokens.")
    assert stats()[0] == "4 right of 4 \u00b7 reward spread 0 (std 0) \u00b7 every A = 0"
    assert r.js("[...document.querySelectorAll('#groups .group')].map(g => g.open)") == [False, True]
    assert "1 without a gradient, folded" in r.page.inner_text("#groups-title")
    assert not r.page.is_visible("#groups .group >> nth=0 >> pre.prompt")  # folded, but one click away
    r.page.click("#unfold")
    assert r.js("[...document.querySelectorAll('#groups .group')].map(g => g.open)") == [True, True]
    r.page.click("#unfold")  # and back
    assert r.js("[...document.querySelectorAll('#groups .group')].map(g => g.open)") == [False, True]
    r.choose("step", "2")
    assert r.page.inner_text("#signal") == ("No gradient this step: every group's rewards were equal, so every "
                                            "advantage is 0. (AdamW's momentum from earlier steps may still move the "
                                            "weights.)")


def test_the_charts_fit_their_data_mark_unrewarded_terms_and_show_the_best_guess(reader):
    recs = records(hostile=False)
    recs[0]["reward_weights"] = {"correctness": 1.0, "format": 0.0}
    for s, entropy in zip(recs[2:5], (0.9, 0.7, 0.4)):
        s["scalars"].update({"train/entropy": entropy, "train/grad_norm": 2.0 * entropy,
                             "rollout/zero_spread_groups": 0.5, "rollout/accuracy": 0.25})
    recs[1]["metrics"].update({"eval/baseline_last_term_repeated": 0.1, "eval/baseline_most_common": 0.05})
    recs[5]["metrics"].update({"eval/baseline_last_term_repeated": 0.1, "eval/baseline_most_common": 0.2})
    r = reader(recs)
    legend = lambda chart: r.js(f"[...document.querySelectorAll('[data-chart=\"{chart}\"] .legend > span')]"  # noqa
                                ".map(s => s.textContent)")
    assert legend("reward") == ["total reward (rollout/reward_mean)", "correctness", "format (not rewarded)"]
    assert r.js("document.querySelector('[data-chart=\"reward\"] g[data-series=\"rollout/reward_format\"] polyline')"
                ".getAttribute('stroke-dasharray')") == "5 3"
    assert r.js("document.querySelector('[data-chart]').dataset.chart") == "reward"  # the total reward first
    axis = lambda chart: r.js(f"[...document.querySelectorAll('[data-chart=\"{chart}\"] text.axis')]"  # noqa
                              ".map(t => t.textContent)")
    values = lambda chart: r.js(f"[...document.querySelectorAll('[data-chart=\"{chart}\"] text.val')]"  # noqa
                                ".map(t => t.textContent)")
    # the accuracy chart's axis from its data (0.1 to 0.75, the guess among it), not 0 to 1
    assert axis("accuracy")[:2] == ["0.1", "0.75"] and "0.5" in values("accuracy") and "0.75" in values("accuracy")
    assert legend("accuracy") == ["held-out accuracy", "best guess needing no skill: most_common"]
    titles = r.js("[...document.querySelectorAll('[data-chart=\"accuracy\"] g[data-series=\"guess\"] title')]"
                  ".map(t => t.textContent)")
    assert titles == ["best guess needing no skill: most_common at step 0: 0.1 (last_term_repeated)",
                      "best guess needing no skill: most_common at step 3: 0.2 (most_common)"]
    assert axis("clip")[:2] == ["0.05", "0.15"] and values("clip") == ["0.15", "0.05", "0.1"]  # every point's value
    assert values("entropy") == ["0.4", "0.9", "0.7"] and axis("grad_norm")[:2] == ["0.8", "1.8"]
    assert r.js("[...document.querySelectorAll('[data-chart=\"signal\"] circle')].map(c => c.textContent)") == [
        "groups whose rewards differ (1 \u2212 rollout/zero_spread_groups) at step " + f"{s}: 0.5" for s in (1, 2, 3)]
    assert [r.js(f"document.querySelectorAll('[data-chart=\"{c}\"] circle').length") for c in
            ("entropy", "grad_norm", "length")] == [3, 3, 3]
    assert r.js("document.querySelector('[data-chart=\"other\"] select').value") == "rollout/accuracy"
    assert r.page.inner_text("#numbering").startswith("Step N's groups were sampled by the policy after N\u22121 "
                                                      "updates; its update is the N-th.")


def eval_completion(question, answer, given, correct, faithful=None):
    return {"question": question, "prompt": "Q: " + question, "answer": answer, "correct": correct,
            "text": f"<think>so</think> <answer> {given} </answer>" if given is not None else "I give up",
            "faithful": faithful, "terms": {"correctness": float(correct)}}


def compared_log(planted="plain"):
    """Evaluations at steps 0, 2 and 4 of the same four questions (and one asked only at step 4): from step 0 to 4,
    q1 gained, q2 lost, q3 wrong at both, q4 right at both; at step 4 three answers are 80, a multiple of 10."""
    before = [eval_completion("q1 " + planted, "17", "12", False), eval_completion("q2", "30", "30", True, True),
              eval_completion("q3", "41", None, False), eval_completion("q4", "5", "5", True, False)]
    middle = [eval_completion(c["question"], c["answer"], "80", False) for c in before]
    after = [eval_completion("q1 " + planted, "17", "17", True, False), eval_completion("q2", "30", "80", False),
             eval_completion("q3", "41", "80", False), eval_completion("q4", "5", "5", True, True),
             eval_completion("q5", "60", planted if planted != "plain" else "80", False)]
    run = records(hostile=False)[0]
    return [run, eval_record(0, 0.5, before), eval_record(2, 0.0, middle), eval_record(4, 0.4, after)]


def test_two_evaluations_side_by_side_show_the_questions_gained_and_lost_and_the_answers_given(reader):
    r = reader(compared_log())
    assert r.page.input_value("#eval-a") == "0" and r.page.input_value("#eval-b") == "2"  # the first and the last
    assert r.page.inner_text("#compare .compare-summary") == (
        "From step 0 to step 4: accuracy 0.5 \u2192 0.4; of the 4 questions asked at both, 1 gained "
        "(wrong \u2192 right), 1 lost (right \u2192 wrong).")
    questions = lambda cls: r.js(f"[...document.querySelectorAll('#compare .{cls} .ev > .question')]"  # noqa
                                 ".map(e => e.textContent)")
    assert questions("gained") == ["q1 plain"] and questions("lost") == ["q2"]
    assert r.js("[...document.querySelectorAll('#compare .gained .said')].map(d => d.firstChild.textContent + "
                "d.querySelector('.given').textContent)") == ["step 0, wrong: 12", "step 4, right: 17"]
    # each right answer says whether its reasoning computes it
    assert "its reasoning does not compute this answer" in r.page.inner_text("#compare .gained")
    assert "its reasoning computes this answer" in r.page.inner_text("#compare .lost")
    bins = lambda step: r.js(f"[...document.querySelectorAll('#compare .hist[data-step=\"{step}\"] g.bin')]"  # noqa
                             ".map(g => [g.dataset.answer, +g.dataset.given, +g.dataset.true])")
    assert bins(4) == [["80", 3, 0], ["17", 1, 1], ["5", 1, 1]]
    assert bins(0) == [["12", 1, 0], ["30", 1, 1], ["(none)", 1, 0], ["5", 1, 1]]
    assert r.page.inner_text('#compare .hist[data-step="4"] .tens') == (
        "Multiples of 10: 3 of the 5 answers given that are numbers (60%); 2 of the 5 true answers (40%).")
    r.choose("eval-a", "1")  # step 2 answered 80 everywhere: from it to step 4, q1 and q4 gained
    assert questions("gained") == ["q1 plain", "q4"] and questions("lost") == []
    r.choose("eval-b", "1")
    assert "The same evaluation twice" in r.page.inner_text("#compare")
    assert r.js("document.querySelectorAll('#compare .hist').length") == 1


def until(r, expression, seconds=10):
    """Wait until the expression holds in the page (wait_for_function evaluates a string: the page's CSP refuses)."""
    import time

    deadline = time.monotonic() + seconds
    while not r.js(expression):
        assert time.monotonic() < deadline, f"not within {seconds} s: {expression}"
        time.sleep(0.05)


def test_find_lists_matches_across_steps_and_evaluations_and_a_click_opens_them(reader):
    recs = records(hostile=False)
    recs[2]["groups"][1]["completions"][2] = completion("<answer>Zebra-42</answer>", -0.29, 0.5)  # step 1, group 1
    recs[4]["groups"][1]["prompt"] = "What is the zebra-42 rule?"  # step 3, group 1
    recs[5]["completions"][1]["text"] = "a ZEBRA-42 here"  # the evaluation at step 3, its second
    r = reader(recs)
    r.page.fill("#find", "zebra-42")
    until(r, "document.getElementById('find-count').textContent !== ''")
    assert r.page.inner_text("#find-count") == "3 found"
    assert r.js("[...document.querySelectorAll('#found li button')].map(b => b.textContent)") == [
        "step 1, group 1, completion #3", "step 3, group 1, prompt",
        "held-out evaluation at step 3, question 2, completion"]
    assert r.js("[...document.querySelectorAll('#found mark')].map(m => m.textContent)") == [
        "Zebra-42", "zebra-42", "ZEBRA-42"]
    r.page.click("#found li >> nth=0 >> button")
    assert r.page.input_value("#step") == "0"
    target = r.js("""(() => { const c = document.querySelector('#groups .completion.flash');
        const box = c.getBoundingClientRect();
        return {text: c.querySelector('.tokens').textContent, group: c.closest('.group').dataset.index,
                seen: box.top >= 0 && box.bottom <= innerHeight}; })()""")
    assert target == {"text": "<answer>Zebra-42</answer>", "group": "1", "seen": True}
    r.page.click("#found li >> nth=2 >> button")
    assert r.page.inner_text("#eval-title").startswith("Held-out evaluation at step 3")
    assert r.js("document.querySelector('#eval .ev.flash pre.text').textContent") == "a ZEBRA-42 here"
    r.page.fill("#find", "no such text anywhere")
    until(r, "document.getElementById('find-count').textContent === 'not found'")
    assert r.js("document.querySelectorAll('#found li').length") == 0


def test_the_filters_hide_the_completions_that_do_not_match_and_the_groups_left_empty(reader):
    r = reader(records(hostile=False))
    r.choose("step", "0")
    visible = lambda: r.js("[...document.querySelectorAll('#groups .group')].filter(g => !g.hidden)"  # noqa
                           ".map(g => [...g.querySelectorAll('.completion')].filter(c => !c.hidden)"
                           ".map(c => +c.dataset.advantage))")
    assert visible() == [[1.5, -0.5, -0.5, -0.5], [0.87, -0.29, -0.29, -0.29]]
    r.choose("f-adv", "pos")
    assert visible() == [[1.5], [0.87]] and r.page.inner_text("#filter-count") == "2 of 8 completions shown"
    r.choose("f-adv", "all")
    r.choose("f-reward", "unrewarded")  # reward 0: only "no tags at all"
    assert visible() == [[-0.5]]
    r.choose("f-reward", "all")
    r.choose("f-cut", "cut")  # cut at the budget: the search completion of 28 tokens
    assert visible() == [[0.87]]
    r.choose("f-cut", "all")
    r.choose("step", "1")
    r.choose("f-adv", "zero")  # the folded group without a gradient is where A = 0: shown, unfolded
    assert visible() == [[0.0, 0.0, 0.0, 0.0]]
    assert r.js("document.querySelector('#groups .group').open")
    r.choose("f-adv", "all")
    assert visible() == [[0.0, 0.0, 0.0, 0.0], [1.2, -0.4, -0.4, -0.4]] and r.page.inner_text("#filter-count") == ""


def test_a_prompt_drawn_at_several_steps_links_to_its_other_draws(reader):
    recs = records(hostile=False)
    recs[4]["groups"][1]["prompt"] = recs[2]["groups"][0]["prompt"]  # step 3's group 1 draws step 1's group 0 again
    r = reader(recs)
    drawn = lambda: r.js("[...document.querySelectorAll('#groups .group')].map(g => "  # noqa
                         "(g.querySelector('.drawn') || {}).textContent || null)")
    assert drawn() == [None, "also drawn at step 1"]
    r.page.click("#groups .group >> nth=1 >> .drawn button")
    assert r.page.input_value("#step") == "0"
    assert r.js("document.querySelector('#groups .group.flash').dataset.index") == "0"
    assert drawn() == ["also drawn at step 3", None]


def test_planted_markup_in_the_new_views_is_shown_as_text(reader):
    recs = with_logp_new(records(), epochs=1, updates=1)
    for c in recs[4]["groups"][0]["completions"]:  # strings where numbers belong: shown as no number
        c["logp_new"] = [HOSTILE] * len(c["tokens"])
    recs = recs + compared_log(HOSTILE)[1:]
    r = reader(recs)
    assert r.js("[...document.querySelectorAll('#groups .group:first-child .tok')]"
                ".every(t => t.classList.contains('na'))")
    assert HOSTILE not in r.js("document.querySelector('#groups .tok').title")
    # the first evaluation (step 0's, logged twice: the last kept) and the last (step 4's), the planted text in both
    first = r.js("[...document.querySelectorAll('#eval-a option')].map(o => o.textContent)")[0]
    assert first == "step 0 (accuracy 0.5)"
    assert HOSTILE in r.js("[...document.querySelectorAll('#compare .gained .question')].map(e => e.textContent)")[0]
    assert r.js("document.querySelector('#compare .hist[data-step=\"4\"] g.bin:last-child').dataset.answer") == HOSTILE
    assert HOSTILE in r.page.inner_text("#compare")
    r.page.fill("#find", "onerror")
    until(r, "document.getElementById('find-count').textContent !== ''")
    assert r.js("document.querySelectorAll('#found li').length") > 3
    for i in range(r.js("document.querySelectorAll('#found li').length")):  # each result opens
        r.page.click(f"#found li >> nth={i} >> button")
    assert r.js("({scripts: document.scripts.length, images: document.images.length})") == {"scripts": 2, "images": 0}


def test_a_misshapen_logp_new_or_update_count_skips_its_record_and_logp_new_is_trimmed_for_size(tmp_path):
    recs = with_logp_new(records(hostile=False), epochs=1, updates=1)
    bad = json.loads(json.dumps(recs[3]))
    bad["groups"][0]["completions"][0]["logp_new"] = HOSTILE
    page = view.write_page(write_log(tmp_path / "run", recs[:3] + [bad] + recs[4:]))
    data = json.loads(page.read_text().split('id="data">')[1].split("</script>")[0])
    assert [s["step"] for s in data["steps"]] == [1, 3] and data["run"]["epochs_per_step"] == 1
    assert data["notes"] == ["1 record of rollouts.jsonl (line 4: groups[0].completions[0].logp_new: not a list) was "
                             "not of the shape docs/rollout-log.md gives and skipped."]
    assert view.misshapen({**recs[0], "updates_per_step": HOSTILE}) == "updates_per_step: not a number"
    folder = big_log(tmp_path / "big")  # over the budget: logp_new goes with the other per-token lists
    log = [json.loads(line) for line in (folder / "rollouts.jsonl").open()]
    write_log(folder, with_logp_new(log))
    data = json.loads(view.write_page(folder).read_text().split('id="data">')[1].split("</script>")[0])
    assert "logp_new" in data["steps"][-1]["groups"][0]["completions"][0]
    assert not {"logp_new", "logp_old", "tokens"} & set(data["steps"][0]["groups"][0]["completions"][0])
