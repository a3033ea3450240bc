"""The copies stay experiment_base wherever their experiment does not change it. Every top-level statement a copy
shares with experiment_base (a function, a class, a constant, or a statement such as TASKS' entries) has
experiment_base's source, except the ones its topic changes, listed here with the reason; and the plumbing a copy
keeps in its own file instead of importing it from tiny_grpo/ is listed too. Both lists are held exact: a fix made in
experiment_base and not carried to a copy fails here, and so does a name that no longer differs but is still listed."""

import ast
import difflib

import pytest
from conftest import EXPERIMENTS, ROOT

ACCELERATE = {"parse_args": "--mixed-precision's checks, the accelerate launch line", "complete_args": "--gradient-"
              "accumulation-steps' checks", "train_step": "accelerator.accumulate and backward", "run": "the "
              "Accelerator, save_state and load_state"}
MULTI_TURN = {"DEFAULT_REWARD_WEIGHTS": "its own reward terms", "DEVICE_DEFAULTS": "its data and sizes",
              "REWARD_TERMS": "its own reward terms", "Rollout": "the episodes' turns", "STOP_STRINGS": "a turn ends at "
              "a tool call", "Scorer": "its reward terms", "add_prompts": "the worked episode", "complete_args": "the "
              "tool's checks", "correctness": "its answers", "evaluate": "episodes", "format_prompt": "the tool's "
              "instructions", "format_score": "tool calls in the format", "load_inputs": "its data and tool",
              "parse_args": "the tool's options", "reward_terms": "its reward terms", "rollout": "multi-turn episodes",
              "run": "episodes", "sequence_log_probs": "an action mask with holes (the tool's results)",
              "system_prompt": "the tool", "train_step": "the action mask with holes"}
# What each copy's experiment changes in the story: the names whose source differs from experiment_base's
TOPIC = {
    "experiment_accelerate": ACCELERATE,
    "experiment_accelerate_ddp": {**ACCELERATE, "train_step": "DDP's all-reduced gradients",
                                  "run": "processes that split the prompts and stop together"},
    "experiment_drgrpo": {"DEVICE_DEFAULTS": "the algorithms' own sizes and rewards (measured without the format term)",
                          "complete_args": "--algorithm and --preset",
                          "group_advantages": "each algorithm's advantages", "grpo_loss": "each algorithm's loss",
                          "parse_args": "--algorithm, --preset and their options", "run": "dynamic sampling",
                          "train_step": "token-level means, several updates a rollout"},
    "experiment_multiturn_qa": MULTI_TURN,
    "experiment_multiturn_tool_calling": MULTI_TURN,
}
# How many of experiment_base's lines each listed name drops / adds in the copy (difflib's diff of the two sources):
# a reason above covers those lines only, so a change anywhere else in the function (a fix made in experiment_base and
# not carried over) fails here too, with the diff shown
CHANGED_LINES = {
    "experiment_accelerate": "complete_args 4/6 parse_args 4/9 run 7/24 train_step 22/32",
    "experiment_accelerate_ddp": "complete_args 4/0 parse_args 6/15 run 13/34 train_step 29/39",
    "experiment_drgrpo": "DEVICE_DEFAULTS 2/2 complete_args 0/9 group_advantages 1/9 grpo_loss 12/46 parse_args 7/44 run 7/25 "
                         "train_step 10/41",
    "experiment_multiturn_qa": "DEFAULT_REWARD_WEIGHTS 1/1 DEVICE_DEFAULTS 4/3 REWARD_TERMS 1/1 Rollout 4/10 STOP_STRINGS 1/1 "
                               "Scorer 5/4 add_prompts 3/3 complete_args 5/3 correctness 8/7 evaluate 5/12 format_prompt 11/8 "
                               "format_score 6/9 load_inputs 4/4 parse_args 5/8 reward_terms 5/7 rollout 11/26 run 8/8 "
                               "sequence_log_probs 5/7 system_prompt 3/4 train_step 1/2",
    "experiment_multiturn_tool_calling": "DEFAULT_REWARD_WEIGHTS 1/1 DEVICE_DEFAULTS 4/3 REWARD_TERMS 1/1 Rollout 4/9 "
                                         "STOP_STRINGS 1/1 Scorer 5/2 add_prompts 1/1 complete_args 4/2 correctness 6/2 "
                                         "evaluate 2/5 format_prompt 12/7 format_score 6/6 load_inputs 4/4 parse_args 8/9 "
                                         "reward_terms 5/5 rollout 11/16 run 5/4 sequence_log_probs 5/7 system_prompt 3/5 "
                                         "train_step 1/2",
}
# The plumbing a copy keeps in its own file, where tiny_grpo/ has a version of the same name: what its experiment
# changes there, and what calls that (a package function would call the package's own version)
KEPT = {
    "experiment_accelerate": {"save_checkpoint": "accelerator.save_state", "checkpoint_problem": "accelerate's state "
                              "files (tiny_grpo/accelerate_checkpoints.py's), judged for this experiment"},
    "experiment_drgrpo": {"StepStatistics": "the clip fractions at each side"},
    "experiment_multiturn_qa": {"load_tasks": "the QA rows",
                                "check_context": "room for the passages"},
    "experiment_multiturn_tool_calling": {"load_tasks": "the tool tasks' rows", "check_context": "room for the tool results",
                                          "NUMBER": "the calculator's numbers", "parse_number": "the calculator's numbers"},
}
KEPT["experiment_accelerate_ddp"] = {**KEPT["experiment_accelerate"], "save_checkpoint": "accelerator.save_state, on "
                                     "the main process", "StepStatistics": "the package's, summed over the processes",
                                     "Interrupts": "a stop reaches every process: all stop together, after a rollout"}


def statements(name):
    """{key: source} of the file's top-level statements but its imports and docstring: a definition by its name,
    any other statement by its first line."""
    source = (ROOT / name / "train.py").read_text()
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body[1:]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        key = getattr(node, "name", None)
        if key is None and isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            key = node.targets[0].id
        found[key or lines[node.lineno - 1]] = "\n".join(lines[first - 1 : node.end_lineno])
    return found


def package_names():
    names = set()
    for module in (ROOT / "tiny_grpo").glob("*.py"):
        for node in ast.parse(module.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


@pytest.mark.parametrize("name", [name for name in EXPERIMENTS if name != "experiment_base"])
def test_a_copy_is_experiment_base_but_for_its_topic(name):
    base, copy = statements("experiment_base"), statements(name)
    differ = {n for n in base.keys() & copy.keys() if base[n] != copy[n]}
    unlisted, same = sorted(differ - set(TOPIC[name])), sorted(set(TOPIC[name]) - differ)
    assert not unlisted and not same, f"differ from experiment_base, no reason listed: {unlisted}; listed, the same: {same}"
    words = CHANGED_LINES[name].split()
    listed = dict(zip(words[::2], words[1::2]))  # {name: "dropped/added"}
    for function in sorted(differ):
        diff = [line for line in difflib.unified_diff(base[function].splitlines(), copy[function].splitlines(), lineterm="",
                                                      n=0) if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        counted = f"{sum(line[0] == '-' for line in diff)}/{sum(line[0] == '+' for line in diff)}"
        assert counted == listed.get(function), f"{function} differs from experiment_base in other lines than listed " \
            f"({counted}, listed {listed.get(function)}):\n" + "\n".join(diff)
    assert sorted(listed) == sorted(differ)


@pytest.mark.parametrize("name", [name for name in EXPERIMENTS if name != "experiment_base"])
def test_a_copy_keeps_experiment_bases_order(name):
    """The README's "the copies keep this order and these names": the statements a copy shares with experiment_base
    come in experiment_base's order, and a copy drops none but the few its experiment has no use for."""
    base, copy = list(statements("experiment_base")), list(statements(name))
    assert [n for n in copy if n in base] == [n for n in base if n in copy]
    # the multi-turn copies have their own data (no TASKS), reward terms and episodes (no sample_in_batches)
    dropped = {"TASKS", "reasoning_quality", "sample_in_batches"} if "multiturn" in name else set()
    assert {n for n in base if n not in copy} == dropped


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_the_plumbing_a_copy_keeps_is_listed(name):
    kept = set(statements(name)) & package_names() - {"main"}  # a script's entry point (tiny_grpo.view has its own)
    assert kept == set(KEPT.get(name, {})), (sorted(kept - set(KEPT.get(name, {}))), sorted(set(KEPT.get(name, {})) - kept))


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_no_experiment_imports_another_and_the_package_knows_none(name):
    source = (ROOT / name / "train.py").read_text()
    imported = {n.module or "" for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import) for a in n.names}
    assert not [m for m in imported if m.startswith("experiment_")]
    for module in (ROOT / "tiny_grpo").glob("*.py"):
        assert name not in module.read_text(), f"{module.name} names {name}"
