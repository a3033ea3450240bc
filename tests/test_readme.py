"""The README stays true: the test command CI runs, every option of the base experiment, and each experiment's
own options in its own README."""

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


def test_every_base_option_is_documented():
    readme = (ROOT / "README.md").read_text()
    base = options("experiment_base")
    assert base and not {o for o in base if f"`{o}`" not in readme}


@pytest.mark.parametrize("experiment", [name for name in EXPERIMENTS if name != "experiment_base"])
def test_each_experiments_own_options_are_documented(experiment):
    """What an experiment adds to the base's command line is in its README (the rest is in the main README)."""
    own = options(experiment) - options("experiment_base")
    readme = (ROOT / experiment / "README.md").read_text()
    assert not {o for o in own if f"`{o}`" not in readme}, f"{experiment}/README.md does not document them"


def test_the_contents_list_every_section_and_each_link_finds_it():
    """The table of contents at the top: one link per ## / ### heading, in order, each to the anchor GitHub makes."""
    readme = (ROOT / "README.md").read_text()
    body = re.sub(r"^```.*?^```", "", readme, flags=re.MULTILINE | re.DOTALL)  # no headings inside code blocks
    headings = re.findall(r"^#{2,3} (.+)$", body, re.MULTILINE)
    contents = readme.split("Contents:", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"^ *\* \[(.+)\]\(#([^)]+)\)$", contents, re.MULTILINE)
    assert [title for title, _ in links] == headings
    anchor = lambda title: re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")  # noqa: E731
    assert all(target == anchor(title) for title, target in links)


def test_the_reading_guide_gives_each_sections_lines_and_each_banner():
    """The table of experiment_base's sections ("How to read a train.py") names the lines each section spans, where
    a '# ---- ' heading starts it, and the table of the copies names each copy's plumbing banner."""
    readme = (ROOT / "README.md").read_text()
    base = (ROOT / "experiment_base" / "train.py").read_text().splitlines()
    headings = [number for number, line in enumerate(base, start=1) if line.startswith("# ---- ")]
    spans = [(int(a), int(b)) for a, b in re.findall(r"^\| (\d+)-(\d+) \| ", readme, re.MULTILINE)]
    assert [a for a, _ in spans] == [1] + headings  # the docstring, then one row per section, the banner last
    assert [b for _, b in spans] == [a - 1 for a, _ in spans[1:]] + [len(base)]
    for name in EXPERIMENTS:
        banner = next(n for n, line in enumerate((ROOT / name / "train.py").read_text().splitlines(), start=1)
                      if line.startswith("# ---- Plumbing"))
        if name == "experiment_base":
            assert spans[-1][0] == banner
        else:
            assert re.search(rf"^\| `{name}` \| {banner} \|", readme, re.MULTILINE), f"{name}: banner at {banner}"
