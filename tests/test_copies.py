"""The copies stay experiment_base wherever their experiment does not change it: below the plumbing banner, every
function, class and constant a copy shares with experiment_base has experiment_base's source, except the ones its
topic changes, listed here with the reason. A fix made in experiment_base and not carried to a copy fails here."""

import ast

import pytest
from conftest import EXPERIMENTS, ROOT

# Below the banner, what each copy's experiment changes (the names whose source differs from experiment_base's), and
# the plumbing it has no use for. Both lists are held exact: a name that no longer differs must leave its list.
TOPIC = {
    "experiment_accelerate": {
        "add_setup_options": "--mixed-precision", "complete_args": "--gradient-accumulation-steps' checks",
        "save_checkpoint": "accelerator.save_state", "checkpoint_problem": "accelerate's state files",
        "resume": "accelerator.load_state", "STATE_KEYS": "the rest is accelerate's state"},
    "experiment_accelerate_ddp": {
        "add_setup_options": "--mixed-precision, the per-process batch", "complete_args": "the processes' share",
        "save_checkpoint": "accelerator.save_state, on the main process", "checkpoint_problem": "accelerate's state files",
        "resume": "accelerator.load_state", "STATE_KEYS": "the rest is accelerate's state",
        "StepStatistics": "summed over the processes",
        "report": "only the main process logs", "Interrupts": "a stop reaches every process",
        "stopped": "every process stops together"},
    "experiment_drgrpo": {
        "complete_args": "--algorithm and --preset", "StepStatistics": "the clip fractions at each side",
        "report": "dynamic sampling's groups"},
    "experiment_multiturn_qa": {
        "add_setup_options": "the search tool's options", "complete_args": "the search tool's checks",
        "fast_log_probs": "an action mask with holes (the passages)", "load_inputs": "the corpus and its index",
        "load_tasks": "the QA rows", "check_context": "room for the passages", "step_metrics": "searches, recall",
        "sample_text": "the episodes' turns"},
    "experiment_multiturn_tool_calling": {
        "add_setup_options": "--max-turns' neighbours", "complete_args": "the tool's checks",
        "fast_log_probs": "an action mask with holes (the tool results)", "load_inputs": "the tool tasks",
        "load_tasks": "the tool tasks' rows", "step_metrics": "tool calls and errors", "sample_text": "the episodes' turns"},
}
NO_USE = {name: set() for name in TOPIC}
for name in ("experiment_multiturn_qa", "experiment_multiturn_tool_calling"):  # their own rewards and data, no --task
    NO_USE[name] = {"gsm8k_final_answer", "check_latex_answer", "parse_count", "parse_roles", "reference_roles",
                    "latex_equal", "parse_latex", "math_verify", "last_boxed", "task_correctness", "answer_parses",
                    "sample_in_batches", "ROLE_CLAIM", "NUMBER_WORDS", "MATH_VERIFY_SECONDS"}


def plumbing(name):
    """{name: source} of the top-level functions, classes and constants below the file's plumbing banner."""
    source = (ROOT / name / "train.py").read_text()
    lines = source.splitlines()
    banner = next(n for n, line in enumerate(lines, start=1) if line.startswith("# ---- Plumbing"))
    found = {}
    for node in ast.parse(source).body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        text = "\n".join(lines[first - 1 : node.end_lineno])
        if node.lineno < banner:
            continue
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = text
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = text
    return found


@pytest.mark.parametrize("name", [name for name in EXPERIMENTS if name != "experiment_base"])
def test_below_the_banner_a_copy_is_experiment_base_but_for_its_topic(name):
    base, copy = plumbing("experiment_base"), plumbing(name)
    differ = {n for n in base.keys() & copy.keys() if base[n] != copy[n]}
    unlisted, same = sorted(differ - set(TOPIC[name])), sorted(set(TOPIC[name]) - differ)
    assert not unlisted and not same, f"differ from experiment_base, no reason listed: {unlisted}; listed, the same: {same}"
    assert set(base) - set(copy) == NO_USE[name]
