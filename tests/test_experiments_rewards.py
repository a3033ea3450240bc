"""Tasks and rewards: answer extraction per task, reward terms and weights, custom and remote rewards."""

import subprocess
import sys
import time

import pytest

from conftest import ROOT, load_experiment, tensorboard_scalars, write_jsonl
import tiny_grpo.answers
import tiny_grpo.rewards
import tiny_grpo.errors

THINK = "<think>I add the two numbers carefully.</think>"


@pytest.mark.parametrize("answer_text, reference, expected", [
    ("12", "12", 1.0),
    ("12.0", "12", 1.0),
    ("1,234", "1234", 1.0),
    ("$1,234.50", "1234.5", 1.0),
    ("12 apples", "12", 1.0),
    ("The answer is 12.", "12", 1.0),
    ("\\boxed{42}", "42", 1.0),
    ("-7", "-7", 1.0),
    ("7", "-7", 0.0),
    ("3/4", "0.75", 1.0),
    ("12 then 13", "13", 1.0),  # the last number counts
    ("twelve", "12", 0.0),
    ("", "12", 0.0),
])
def test_numeric_answers(task_experiment, answer_text, reference, expected):
    for task in ("math", "gsm8k"):
        completion = f"{THINK}<answer>{answer_text}</answer>"
        assert task_experiment.correctness(completion, reference, task) == expected, (task, answer_text)


def test_only_the_last_answer_tag_counts(task_experiment):
    assert task_experiment.correctness("<answer>5</answer> no wait <answer>6</answer>", "6") == 1.0
    assert task_experiment.correctness("<answer>6</answer> no wait <answer>5</answer>", "6") == 0.0
    assert task_experiment.correctness("the answer is 6", "6") == 0.0  # no tags, no credit


KK_REFERENCE = "(1) Zoey is a knight\n(2) Ethan is a knave\n(3) Mia is a knave"


@pytest.mark.parametrize("given, exact, partial", [
    ("(1) Zoey is a knight\n(2) Ethan is a knave\n(3) Mia is a knave", 1.0, 1.0),
    ("Mia is a knave, Zoey is a knight, Ethan is a knave", 1.0, 1.0),  # any order
    ("Zoey: knight; Ethan: knave; Mia: knave", 1.0, 1.0),
    ("zoey is a Knight. ethan is a KNAVE. mia is a knave.", 1.0, 1.0),  # any case
    ("Zoey is a knight, Ethan is not a knight, Mia is not a knight", 1.0, 1.0),  # negation
    ("Zoey is a knight, Ethan is a knight, Mia is a knave", 0.0, 2 / 3),
    ("Zoey is a knight, Ethan is a knave", 0.0, 2 / 3),  # Mia missing
    ("Everyone is a knight", 0.0, 0.0),
])
def test_knights_and_knaves_answers(task_experiment, given, exact, partial):
    completion = f"<think>Zoey cannot lie.</think><answer>{given}</answer>"
    assert task_experiment.correctness(completion, KK_REFERENCE, "knights_knaves") == pytest.approx(exact)
    assert task_experiment.correctness(completion, KK_REFERENCE, "knights_knaves", partial_credit=True) == pytest.approx(partial)


def test_knights_and_knaves_generated_answers_parse(task_experiment):
    import json

    row = json.loads((ROOT / "data" / "knights_knaves_eval.jsonl").read_text().splitlines()[0])
    assert task_experiment.correctness(f"<think>x</think><answer>{row['answer']}</answer>", row["answer"], "knights_knaves") == 1.0
    assert set(tiny_grpo.answers.reference_roles(row["answer"])) == {n.lower() for n in row["names"]}


@pytest.mark.parametrize("completion, score", [
    (f"{THINK} <answer>12</answer>", 1.0),
    ("I add them.</think><answer>12</answer>", 1.0),  # the plain template writes the opening tag
    (f"{THINK}<answer>13</answer>", 1.0),  # wrong but well formed
    (f"{THINK}<answer></answer>", 0.0),  # empty tags cannot win the format credit
    (f"{THINK}<answer>   </answer>", 0.0),
    (f"{THINK}<answer>a number</answer>", 0.0),  # nor tags around no answer
    ("<think></think><answer>12</answer>", 0.0),  # nor empty reasoning
    (f"{THINK}<answer>12</answer> and then more", 0.0),  # nothing after the answer
    ("<answer>12</answer>", 0.0),
])
def test_strict_format(task_experiment, completion, score):
    assert task_experiment.format_score(completion) == score


def test_plain_template_without_a_chat_template(task_experiment, tiny_model_dir):
    """A base model (no chat template, like the packaged Gemma-3-270M) gets the R1-Zero style prompt, the task's
    worked example first as an earlier exchange, and the reasoning tag opened for it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = None
    example = task_experiment.TASKS["math"]
    prompt = task_experiment.format_prompt(tokenizer, "What is 2 + 3?")
    assert prompt == (f"{task_experiment.system_prompt()}\nUser: {example.question}\nAssistant: <think> "
                      f"{example.reasoning} </think> <answer> {example.answer} </answer>\nUser: What is 2 + 3?\nAssistant: <think>")
    prompt = task_experiment.format_prompt(tokenizer, "Who is a knight?", "knights_knaves", "reasoning")
    assert prompt.startswith(task_experiment.system_prompt("reasoning") + "\nUser: Zoey says")
    assert prompt.endswith("User: Who is a knight?\nAssistant: <reasoning>") and "<reasoning> If Zoey were a knave" in prompt


def test_chat_template_shows_the_worked_example_as_an_earlier_exchange(task_experiment, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = task_experiment.format_prompt(tokenizer, "How many words are in this sentence: \"a b c\"?", "count_words")
    example = task_experiment.TASKS["count_words"]
    assert prompt.index(example.question) < prompt.index(example.reasoning) < prompt.index('"a b c"')
    assert prompt.count(task_experiment.system_prompt()) == 1


@pytest.mark.parametrize("task", ["math", "gsm8k", "math_latex", "knights_knaves", "count_words", "sequence"])
def test_every_worked_example_earns_the_full_reward(task_experiment, task):
    """The example a task shows is itself right and in the format: a wrong example would teach a wrong answer."""
    example = task_experiment.TASKS[task]
    completion = f"<think> {example.reasoning} </think> <answer> {example.answer} </answer>"
    assert task_experiment.correctness(completion, example.answer, task) == 1.0
    assert task_experiment.format_score(completion, task) == 1.0
    if task == "count_words":  # and copying it is never right: no sentence of the task has its length
        assert int(example.answer) == len(example.question.split('"')[1].split())
        rows = (ROOT / "data" / "count_words.jsonl").read_text() + (ROOT / "data" / "count_words_eval.jsonl").read_text()
        assert f'"answer": "{example.answer}"' not in rows
    if task == "sequence":  # the terms written on to the answer, reasoning that computes it; its step is no question's
        import json

        from tiny_grpo.skill import faithful

        assert faithful("sequence", example.question, completion) is True
        terms = [int(t) for t in example.question.split(": ")[1].split(", ...")[0].split(", ")]
        step = terms[1] - terms[0]
        assert ", ".join(map(str, [*terms, terms[-1] + step])) in example.reasoning
        for path in ("sequence.jsonl", "sequence_eval.jsonl"):
            for line in (ROOT / "data" / path).read_text().splitlines():
                numbers = [int(t) for t in json.loads(line)["question"].split(": ")[1].split(", ...")[0].split(", ")]
                assert numbers[1] - numbers[0] != step


@pytest.mark.parametrize("answer_text, reference, expected", [
    ("4", "4", 1.0),
    ("four", "4", 1.0),  # a count may be written in words
    ("Four words", "4", 1.0),
    ("there are 4 words", "4", 1.0),
    ("4.0", "4", 1.0),
    ("4.5", "4", 0.0),  # no count
    ("3 or 4", "4", 1.0),  # the last number counts, as for the other tasks
    ("5", "4", 0.0),
    ("fourteen", "4", 0.0),  # whole words only
    ("twenty", "20", 1.0),
    ("", "4", 0.0),
])
def test_count_answers(task_experiment, answer_text, reference, expected):
    completion = f"{THINK}<answer>{answer_text}</answer>"
    assert task_experiment.correctness(completion, reference, "count_words") == expected, answer_text
    assert task_experiment.format_score(completion, "count_words") == float(answer_text not in ("", "4.5"))


@pytest.mark.parametrize("answer, score", [
    ("(1) Zoey is a knight (2) Ethan is a knave", 1.0),
    ("Zoey: knave", 1.0),
    ("Zoey is not a Knight", 1.0),  # wrong or partial answers are still well formed
    ("knight", 0.0),  # a role for no one cannot win the format credit
    ("knights and knaves", 0.0),
    ("A knight", 0.0),
    ("", 0.0),
])
def test_knights_and_knaves_format_needs_a_role_claim(task_experiment, answer, score):
    assert task_experiment.format_score(f"{THINK}<answer>{answer}</answer>", "knights_knaves") == score


def test_reasoning_format_tags(task_experiment):
    completion = "<reasoning>I add them up: 5 + 7 = 12.</reasoning><answer>12</answer>"
    assert task_experiment.format_score(completion, "math", "reasoning") == 1.0
    assert task_experiment.format_score(completion, "math", "think") == 0.0
    assert task_experiment.reasoning_quality(completion, "reasoning") == 1.0


def test_reasoning_quality(task_experiment):
    assert task_experiment.reasoning_quality("<think>First 3 * 4 = 12, then 12 + 1 = 13.</think>") == 1.0
    assert task_experiment.reasoning_quality("<think>13</think>") == 0.5  # too short
    assert task_experiment.reasoning_quality("<think>" + "so we add one more " * 20 + "</think>") == 0.5  # a loop
    assert task_experiment.reasoning_quality("<think></think>") == 0.0
    assert task_experiment.reasoning_quality("<think>never closed") == 0.0


def test_reward_weights(task_experiment):
    def reward(completion, answer, weights=""):  # the run's reward: the Scorer's weighted sum of the terms
        return task_experiment.Scorer(weights=weights)([completion], [answer], [{}])[0].item()

    good = "<think>First 3 * 4 = 12, then 12 + 1 = 13.</think><answer>13</answer>"
    assert reward(good, "13") == pytest.approx(1 + 0.1 + 0.1)  # the default weights
    weights = "correctness=2,format=1,reasoning=0.5"
    assert reward(good, "13", weights) == pytest.approx(2 + 1 + 0.5)
    assert reward(good, "14", weights) == pytest.approx(0 + 1 + 0.5)
    hacked = "<think></think><answer></answer>"  # empty tags score nothing under any weights
    assert reward(hacked, "13", weights) == 0.0
    with pytest.raises(ValueError, match="unknown reward term 'style'"):
        task_experiment.parse_weights("style=1")


def test_bad_reward_weights_option(task_experiment, capsys):
    with pytest.raises(SystemExit):
        task_experiment.parse_args(["--device", "cpu", "--reward-weights", "correctness=2,style=1"])
    assert "--reward-weights 'correctness=2,style=1': unknown reward term 'style'" in capsys.readouterr().err


# ---- custom reward functions ----

@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_bonus(completion, answer, metadata):\n"
        "    return len(completion) / 100 + metadata.get('bonus', 0)\n"
        "def broken(completion, answer, metadata):\n"
        "    raise ValueError('cannot score this')\n"
        "not_a_function = 3\n"
        "calls = 0\n"
        "def fails_later(completion, answer, metadata):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls > 4:\n"
        "        raise ConnectionError('the scorer went away')\n"
        "    return calls / 4\n"
    )
    monkeypatch.chdir(tmp_path)  # --reward-fn finds modules next to where the run starts
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_custom_reward_function(task_experiment, reward_module):
    score = task_experiment.Scorer(reward_fn=f"{reward_module}:length_bonus", weights="custom=2")
    rewards, terms = score(["abcd", "<think>First 3 * 4 = 12, then add 1.</think><answer>13</answer>"], ["1", "13"],
                           [{"bonus": 1}, {}])
    assert terms["custom"].tolist() == pytest.approx([1.04, 0.63])
    assert rewards.tolist() == pytest.approx([2 * 1.04, 2 * 0.63 + 1 + 0.1 + 0.1])


@pytest.mark.parametrize("spec, message", [
    ("no_such_module:f", "--reward-fn no_such_module:f: cannot import no_such_module: ModuleNotFoundError"),
    ("my_rewards:missing", "--reward-fn my_rewards:missing: my_rewards has no function 'missing'"),
    ("my_rewards:not_a_function", "has no function 'not_a_function'"),
    ("my_rewards", "--reward-fn my_rewards: expected package.module:function"),
])
def test_custom_reward_loading_errors(task_experiment, reward_module, spec, message):
    with pytest.raises(task_experiment.InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        task_experiment.Scorer(reward_fn=spec)


def test_a_module_raising_attribute_error_on_import_is_a_failed_import(task_experiment, tmp_path, monkeypatch):
    """pkgutil.resolve_name raises AttributeError both for a missing function and for a module whose import raises
    one: the second is reported as the import that failed, not as a missing function."""
    (tmp_path / "bad_import.py").write_text("import math\nmath.no_such_thing\n\ndef f(completion, answer, metadata):\n"
                                            "    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_reward_fn appends the working directory
    with pytest.raises(task_experiment.InputError, match="--reward-fn bad_import:f: cannot import bad_import: "
                                                         "AttributeError: module 'math' has no attribute"):
        tiny_grpo.rewards.load_reward_fn("bad_import:f")


def test_a_raising_reward_function_names_the_example(task_experiment, reward_module):
    score = task_experiment.Scorer(reward_fn=f"{reward_module}:broken")
    with pytest.raises(tiny_grpo.errors.RewardError) as error:
        score(["<answer>7</answer>"], ["7"], [{}])
    assert "my_rewards:broken failed on completion '<answer>7</answer>' (answer '7'): ValueError: cannot score this" in str(error.value)


def test_a_reward_failing_mid_run_keeps_the_steps_done(task_experiment, reward_module, tiny_model_dir, tmp_path):
    """The reward works for step 1 (4 completions) and raises in step 2: the run stops with the failing example,
    and step 1 is in a checkpoint and in TensorBoard."""
    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)])
    with pytest.raises(SystemExit) as stop:
        task_experiment.main([
            "--model-name", str(tiny_model_dir), "--device", "cpu", "--quantization", "none", "--dtype", "float32",
            "--data-path", str(data), "--max-steps", "3", "--group-size", "2", "--rollouts-per-step", "2",
            "--max-length", "4", "--eval-interval", "0", "--reward-fn", f"{reward_module}:fails_later",
            "--log-dir", str(tmp_path / "runs"), "--checkpoint-path", str(tmp_path / "out"), "--run-name", "r",
        ])
    assert "my_rewards:fails_later failed on completion" in str(stop.value) and "the scorer went away" in str(stop.value)
    assert (tmp_path / "out" / "r" / "step_000001" / "training_state.pt").is_file()
    assert not (tmp_path / "out" / "r" / "step_000002").exists()
    assert [step for step, _ in tensorboard_scalars(tmp_path / "runs")["train/loss"]] == [1]


# ---- the function's own process: a deadline no code can defeat, its failures in one line ----

STUCK = """import os, re, signal, time

def reward(completion, answer, metadata):
    if completion == "fast":
        return 0.5
    {body}
"""

CALL_IT = """import tiny_grpo.errors, tiny_grpo.rewards
function = tiny_grpo.rewards.load_reward_fn("stuck:reward", timeout=1.0)
try:
    function("slow", "a", {})
except tiny_grpo.errors.RewardError as e:
    print(e)
print("and then:", function("fast", "a", {}))
"""


@pytest.mark.parametrize("body, says", [
    ('return float(bool(re.match(r"(a+)+$", "a" * 40 + "b")))', "TimeoutError: no result within 1.0 s"),
    ("signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n    while True:\n        time.sleep(1)",
     "TimeoutError: no result within 1.0 s"),
    ("signal.signal(signal.SIGUSR1, signal.SIG_DFL)\n    while True:\n        time.sleep(1)",
     "TimeoutError: no result within 1.0 s"),
    ("os._exit(3)", "its process ended with exit code 3"),
], ids=["busy-in-c", "ignores-sigusr1", "sigusr1-to-default", "ends-its-process"])
def test_no_reward_fn_outlives_its_deadline_or_takes_the_caller_with_it(body, says, tmp_path):
    """The deadline was a timer thread's SIGUSR1 to the calling thread: a backtracking regex, busy in C, holds the GIL
    and hung the run (the timer never ran); a function that set SIGUSR1 to be ignored ran on past it, one that set it
    back to the default was killed with the run; os._exit ended the run. Now the function runs in a process of its
    own, killed at the deadline; the caller gets a RewardError and the next call a fresh process. In a fresh
    interpreter: the code before the fix hangs or dies there, not in the test's."""
    from conftest import run_command

    (tmp_path / "stuck.py").write_text(STUCK.format(body=body))
    result = run_command([sys.executable, "-c", CALL_IT], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [f"--reward-fn stuck:reward failed on completion 'slow' (answer 'a'): {says}",
                                          "and then: 0.5"]


def test_a_reward_fns_failure_is_one_line_saying_where(tmp_path, monkeypatch):
    """The function's traceback, condensed: the error, then the frames that raised it, outermost first."""
    (tmp_path / "deep.py").write_text("def reward(completion, answer, metadata):\n    return check(completion)\n\n"
                                      "def check(completion):\n    raise ValueError('no good:\\n' + completion)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_reward_fn appends the working directory
    function = tiny_grpo.rewards.load_reward_fn("deep:reward")
    with pytest.raises(tiny_grpo.errors.RewardError) as error:
        function("c", "a", {})
    assert str(error.value) == ("--reward-fn deep:reward failed on completion 'c' (answer 'a'): ValueError: no good: c "
                                "(deep.py:2 in reward > deep.py:5 in check)")


def test_what_cannot_cross_to_the_functions_process_is_one_line(reward_module, tmp_path):
    """Metadata is sent to the function's process pickled: what cannot be pickled is named, in one line. What the
    function returns is turned into a number there: anything else (a generator, here) is 'not a finite number'."""
    function = tiny_grpo.rewards.load_reward_fn(f"{reward_module}:length_bonus")
    with pytest.raises(tiny_grpo.errors.RewardError) as error:
        function.many(["abcd", "efgh"], ["1", "2"], [{}, {"bonus": 1, "hook": lambda: 0}])
    said = str(error.value)
    assert said.startswith("--reward-fn my_rewards:length_bonus failed on completion 'efgh' (answer '2'): its metadata "
                           "cannot be sent to the function's process: ") and "\n" not in said
    assert function.many(["abcd"], ["1"], [{"bonus": 1}]) == [1.04]  # the next call is answered
    (tmp_path / "generator_reward.py").write_text("def reward(completion, answer, metadata):\n"
                                                  "    return (x for x in [1.0])\n")
    with pytest.raises(tiny_grpo.errors.RewardError, match=r"returned '<generator object .*', not a finite number"):
        tiny_grpo.rewards.load_reward_fn("generator_reward:reward")("c", "a", {})


def test_one_process_serves_the_run_and_a_fresh_one_follows_a_failure(reward_module):
    """The function's process lives from call to call (its module's state with it: fails_later counts its calls); a
    call past the deadline kills it, and the next call starts another, the module imported afresh."""
    function = tiny_grpo.rewards.load_reward_fn(f"{reward_module}:fails_later", timeout=30)
    first = function.process
    assert function.many(["a", "b", "c"], ["1"] * 3, [{}] * 3) == [0.25, 0.5, 0.75]
    assert function("d", "1", {}) == 1.0 and function.process is first
    with pytest.raises(tiny_grpo.errors.RewardError, match="ConnectionError: the scorer went away"):
        function("e", "1", {})
    assert first.poll() is not None  # killed
    assert function.many(["f", "g"], ["1"] * 2, [{}] * 2) == [0.25, 0.5] and function.process is not first
    second = function.process
    del function
    assert second.wait(timeout=60) is not None  # the function gone, its process is stopped (a guard, not a timing)


# ---- the HTTP reward service ----

@pytest.fixture
def reward_server():
    """Start tools/reward_server.py on a free port; yields a function (delay) -> URL."""
    processes = []

    def start(delay=0.0):
        process = subprocess.Popen([sys.executable, str(ROOT / "tools" / "reward_server.py"), "--port", "0", "--quiet",
                                    "--delay", str(delay)], stdout=subprocess.PIPE, text=True)
        processes.append(process)
        return process.stdout.readline().split()[-1]  # "listening on http://127.0.0.1:PORT/reward"

    yield start
    for process in processes:
        process.terminate()
        process.wait(timeout=10)


def test_reward_service_up(task_experiment, reward_server):
    score = task_experiment.Scorer(reward_url=reward_server(), weights="correctness=0,format=0,reasoning=0")
    rewards, terms = score(["<answer>12</answer>", "<answer>11</answer>"], ["12", "12"], [{}, {}])
    assert terms["remote"].tolist() == [1.0, 0.0] and rewards.tolist() == [1.0, 0.0]


def test_reward_service_slow(task_experiment, reward_server):
    url = reward_server(delay=2.0)
    started = time.perf_counter()
    with pytest.raises(tiny_grpo.errors.RewardError, match="no answer after 2 tries"):
        task_experiment.Scorer(reward_url=url, timeout=0.3, retries=2)
    assert time.perf_counter() - started < 5  # two short timeouts and one back-off, not a hang


def test_reward_service_down(task_experiment):
    with pytest.raises(tiny_grpo.errors.RewardError, match=r"--reward-url http://127.0.0.1:9/reward: no answer after 2 tries .*is the service running"):
        task_experiment.Scorer(reward_url="http://127.0.0.1:9/reward", retries=2, timeout=1)


def test_reward_service_bad_request_is_not_retried(task_experiment, reward_server):
    url = reward_server()
    with pytest.raises(tiny_grpo.errors.RewardError, match="HTTP 400"):
        tiny_grpo.rewards.remote_rewards(url, ["a", "b"], ["1"], [{}, {}])


# ---- each task end to end ----

# Every task through experiment_base; each other copy that shares its tasks runs one of them end to end (their task
# code is the base's, and every copy's correctness, format and loader are tested for every task above and in
# test_data_loading.py). Through main() in this process: a fresh one costs about 5 s, and each copy's fresh-process
# runs are tested elsewhere (test_experiments_end_to_end.py). Four copies x every task in fresh processes took about
# 3 minutes of the suite.
TASK_RUNS = [("experiment_base", task) for task in ["math", "gsm8k", "math_latex", "knights_knaves", "count_words", "sequence"]]
TASK_RUNS += [("experiment_accelerate", "gsm8k"), ("experiment_accelerate_ddp", "math_latex"), ("experiment_drgrpo", "knights_knaves")]


def test_the_task_runs_cover_every_task_and_every_copy():
    from conftest import TASK_EXPERIMENTS

    assert {name for name, _ in TASK_RUNS} == set(TASK_EXPERIMENTS)
    assert {task for name, task in TASK_RUNS if name == "experiment_base"} == set(load_experiment("experiment_base").TASKS)


@pytest.mark.parametrize("name, task", TASK_RUNS)
def test_each_task_runs_two_steps(tiny_model_dir, tmp_path, monkeypatch, name, task):
    data = []
    if task == "gsm8k":  # the hub is out of reach here: a local copy laid out as openai/gsm8k is, its answers after ####
        from test_data_loading import write_gsm8k_copy

        data = ["--data-path", write_gsm8k_copy(tmp_path / "gsm8k")]
    monkeypatch.chdir(ROOT)  # the task files are named from the repository root
    load_experiment(name).main([str(a) for a in [
        "--task", task, *data, "--model-name", tiny_model_dir, "--device", "cpu", "--quantization", "none", "--dtype",
        "float32", "--max-steps", "2", "--group-size", "2", "--rollouts-per-step", "2", "--max-length", "8",
        "--eval-interval", "2", "--eval-prompts", "2", "--reasoning-format", "reasoning", "--reward-weights",
        "correctness=2,format=1,reasoning=0.5", "--log-dir", tmp_path / "runs", "--checkpoint-path", tmp_path / "out",
        "--run-name", "task"]])
    scalars = tensorboard_scalars(tmp_path / "runs")
    for term in ("correctness", "format", "reasoning"):
        assert len(scalars[f"rollout/reward_{term}"]) == 2
    assert len(scalars["eval/accuracy"]) == 2  # step 0 and step 2
