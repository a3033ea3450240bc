"""The README and docs/ stay true: the test command CI runs, every option of the base experiment, and each
experiment's own options in its own README; the README short enough to read in ten minutes, every link and anchor
found, and benchmarks/results/ holding exactly the JSON the text cites."""

import os
import re

import pytest

from conftest import EXPERIMENTS, ROOT, help_text


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = "python -m pytest tests -q"
    assert command in readme
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


def options(experiment):
    """The options argparse lists in --help (where a line starts with one, or after ', ' for an alias); a wide
    terminal keeps it from wrapping an option's name."""
    return set(re.findall(r"(?:^ +|, )(--[a-z][a-z0-9-]*[a-z0-9])\b", help_text(experiment), re.MULTILINE)) - {"--help"}


MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted(ROOT.glob("experiment_*/README.md"))]


def text(paths=MARKDOWN):
    return "\n".join(path.read_text() for path in paths)


def anchor(title):
    """The anchor GitHub makes of a heading: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def headings(path):
    body = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)  # none inside code blocks
    return re.findall(r"^#{1,6} (.+)$", body, re.MULTILINE)


def test_every_base_option_is_documented():
    """Every option of experiment_base's --help, in the README or docs/ (the options table is docs/usage.md's)."""
    documented = text([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
    base = options("experiment_base")
    assert base and not {o for o in base if f"`{o}`" not in documented}


def test_the_readme_is_read_in_ten_minutes_and_no_line_runs_on():
    """At most 350 lines in the README (the READMEs a reader compares it with are 200-240); no line over 200
    characters in it or in docs/ (one was 2,079)."""
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 350
    long = [f"{path.relative_to(ROOT)}:{n}" for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
            for n, line in enumerate(path.read_text().splitlines(), start=1) if len(line) > 200]
    assert not long


def test_every_link_and_anchor_is_found():
    """Each relative link of the README, docs/ and the experiments' READMEs names a file that exists, and its #anchor
    a heading of that file (or of the same file)."""
    broken = []
    for path in MARKDOWN:
        body = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", body):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, fragment = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and linked.suffix == ".md" and fragment not in map(anchor, headings(linked)):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken


def test_the_results_folder_holds_what_the_text_cites():
    """Both ways: every JSON of benchmarks/results/ that the README, docs/ or an experiment's README names exists,
    and every JSON in the folder is named there (what no text cites any longer goes; git keeps it)."""
    cited = set(re.findall(r"(?<![\w*.-])([\w-]+\.json)\b", text()))
    kept = {path.name for path in (ROOT / "benchmarks" / "results").glob("*.json")}
    assert not kept - cited, "in benchmarks/results/ but cited nowhere"
    named = set(re.findall(r"benchmarks/results/([\w-]+\.json)\b", text()))  # a path: other names are other files
    assert named and not named - kept, "cited, but not in benchmarks/results/"


@pytest.mark.parametrize("experiment", [name for name in EXPERIMENTS if name != "experiment_base"])
def test_each_experiments_own_options_are_documented(experiment):
    """What an experiment adds to the base's command line is in its README (the rest is in the main README)."""
    own = options(experiment) - options("experiment_base")
    readme = (ROOT / experiment / "README.md").read_text()
    assert not {o for o in own if f"`{o}`" not in readme}, f"{experiment}/README.md does not document them"


def test_the_contents_list_every_section_and_each_link_finds_it():
    """The table of contents at the top: one link per ## / ### heading, in order, each to the anchor GitHub makes."""
    readme = (ROOT / "README.md").read_text()
    sections = [title for title in headings(ROOT / "README.md") if not title.startswith("tiny-grpo")]
    contents = readme.split("Contents:", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"^ *\* \[(.+)\]\(#([^)]+)\)$", contents, re.MULTILINE)
    assert [title for title, _ in links] == sections
    assert all(target == anchor(title) for title, target in links)


def test_the_reading_guide_gives_each_sections_lines_and_each_copys_own_plumbing():
    """The table of experiment_base's sections ("How to read a train.py") names the lines each section spans, where
    a '# ---- ' heading starts it; the table of the package names each module's lines; the table of the copies names
    each copy's length and the line where the plumbing it keeps starts."""
    readme = (ROOT / "README.md").read_text()
    base = (ROOT / "experiment_base" / "train.py").read_text().splitlines()
    headings = [number for number, line in enumerate(base, start=1) if line.startswith("# ---- ")]
    spans = [(int(a), int(b)) for a, b in re.findall(r"^\| (\d+)-(\d+) \| ", readme, re.MULTILINE)]
    assert [a for a, _ in spans] == [1] + headings  # the docstring, then one row per section
    assert [b for _, b in spans] == [a - 1 for a, _ in spans[1:]] + [len(base)]
    modules = sorted(p.stem for p in (ROOT / "tiny_grpo").glob("*.py") if p.stem != "__init__")
    listed = dict(re.findall(r"^\| `tiny_grpo/(\w+)\.py` \| (\d+) \|", readme, re.MULTILINE))
    assert sorted(listed) == modules
    for module, lines in listed.items():
        assert int(lines) == len((ROOT / "tiny_grpo" / f"{module}.py").read_text().splitlines()), module
    for name in EXPERIMENTS:
        if name == "experiment_base":
            continue
        lines = (ROOT / name / "train.py").read_text().splitlines()
        own = next(n for n, line in enumerate(lines, start=1) if line.startswith("# ---- This experiment's own plumbing"))
        assert re.search(rf"^\| `{name}` \| {len(lines)} \| {own} \|", readme, re.MULTILINE), f"{name}: {len(lines)}, {own}"
