"""The README stays true: the test command CI runs, and every option of the base experiment."""

import re

from conftest import ROOT, run_script


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = "python -m pytest tests -q"
    assert command in readme
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_every_base_option_is_documented():
    help_text = run_script(ROOT / "experiment_base" / "train.py", "--help").stdout
    options = set(re.findall(r"(--[a-z][a-z0-9-]+)", help_text)) - {"--help"}
    readme = (ROOT / "README.md").read_text()
    assert options and not {o for o in options if f"`{o}`" not in readme}
