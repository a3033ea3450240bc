"""Round five, items 8 and 9: a train.py takes tiny_grpo/ from the checkout it lies in, whatever pip installed.

A second clone or a `git worktree` made to try a change ran the first checkout's package (the editable install's),
and read that checkout's data/, without a word; a virtual environment without the editable install ended every
train.py in `ModuleNotFoundError: No module named 'tiny_grpo'`."""

import re
import shutil
import sys

import pytest
from conftest import EXPERIMENTS, ROOT, run_command

# Runs a train.py as `python train.py --help` does, with pip's editable install of tiny_grpo taken out of the import
# system first: a virtual environment made before the package, or with the dependencies installed by hand.
WITHOUT_INSTALL = ("import runpy, sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
                   "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def second_checkout(folder, experiment):
    """A copy of the checkout's experiment and package in folder, its package marked so that a run shows it."""
    shutil.copytree(ROOT / "tiny_grpo", folder / "tiny_grpo", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / experiment, folder / experiment, ignore=shutil.ignore_patterns("__pycache__"))
    init = folder / "tiny_grpo" / "__init__.py"
    init.write_text(init.read_text() + "\nimport sys; print('the second checkout', file=sys.stderr)\n")
    return folder / experiment / "train.py"


def test_item8_every_copy_puts_its_checkout_first_before_it_imports_the_package():
    """The line that does it, in each copy, above the first import of tiny_grpo (test_copies leaves imports and this
    statement's presence unchecked; the run below shows what the line does, in experiment_base)."""
    for experiment in EXPERIMENTS:
        lines = (ROOT / experiment / "train.py").read_text().splitlines()
        guard = lines.index("if (CHECKOUT := str(Path(__file__).resolve().parent.parent)) not in sys.path:  # take "
                            "tiny_grpo/ from this checkout,")
        first_import = min(i for i, line in enumerate(lines) if re.match(r"(from|import) tiny_grpo", line))
        assert lines[guard + 1].startswith("    sys.path.insert(0, CHECKOUT)") and guard < first_import, experiment


def test_item8_a_second_checkout_runs_its_own_package(tmp_path):
    experiment = "experiment_base"
    script = second_checkout(tmp_path, experiment)
    result = run_command([sys.executable, script, "--help"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "the second checkout" in result.stderr, "the train.py ran another checkout's tiny_grpo/"


def test_item8_the_package_reads_its_own_checkouts_data(tmp_path):
    script = second_checkout(tmp_path, "experiment_base")
    probe = "import sys; sys.argv = sys.argv[1:]; import runpy; g = runpy.run_path(sys.argv[0]); " \
            "import tiny_grpo.data; print(tiny_grpo.data.REPOSITORY)"
    result = run_command([sys.executable, "-c", probe, script], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(tmp_path.resolve())


def test_item9_a_venv_without_the_editable_install_still_runs(tmp_path):
    result = run_command([sys.executable, "-c", WITHOUT_INSTALL, ROOT / "experiment_base" / "train.py", "--help"],
                         cwd=tmp_path)
    assert "No module named 'tiny_grpo'" not in result.stderr
    assert result.returncode == 0 and "--group-size" in result.stdout, result.stderr[-2000:]
