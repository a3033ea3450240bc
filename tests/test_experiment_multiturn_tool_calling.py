"""experiment_multiturn_tool_calling: the calculator, tool-call parsing, the multi-turn masks, learning, a run."""

import re
import sys
import time
import types

import pytest
import torch

from conftest import (ROOT, load_experiment, load_tiny, on_most_seeds, run_command, run_script, teach,
    tensorboard_scalars, write_jsonl)
import tiny_grpo.decode

NAME = "experiment_multiturn_tool_calling"
SCRIPT = ROOT / NAME / "train.py"


@pytest.fixture(scope="module")
def tool():
    return load_experiment(NAME)


@pytest.fixture(scope="module")
def tiny_tool(tool, tiny_model_dir):
    """(module, model, tokenizer): the tiny model loaded by the experiment's own load_model, in float32."""
    module, model, tokenizer = load_tiny(tool, tiny_model_dir)
    model.eval()
    return module, model, tokenizer


# ----------------------------------------------------------------------------------------------
# The calculator
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, expected", [
    ("12*(3+4)", "84"), ("482 * 317", "152794"), ("95744 / 136", "704"), ("7 // 2", "3"), ("-7 // 2", "-4"),
    ("7 % 3", "1"), ("2 ** 10", "1024"), ("2 ** -1", "0.5"), ("-3 + 5", "2"), ("-(2 + 3) * 4", "-20"),
    ("+5", "5"), ("1 / 3", "0.333333333333"), ("0.1 + 0.2", "0.3"), ("sqrt(144)", "12"), ("sqrt(2)", "1.41421356237"),
    ("abs(-7)", "7"), ("round(2.567, 2)", "2.57"), ("round(7.5)", "8"), ("min(3, 1, 2)", "1"), ("max(3, 9)", "9"),
    ("  3 + 4\n", "7"), ("1e3 + 1", "1001"), ("((((1 + 2))))", "3"), ("123456789 * 987654321", "121932631112635269"),
    ("57 * 803 - 4416 / 48", "45679"),
])
def test_calculator_computes(tool, expression, expected):
    assert tool.calculator(expression) == (expected, True)


HUGE = "1" + "+1" * 50_000  # a 100 kB expression


@pytest.mark.parametrize("expression, message", [
    ("x + 1", "unknown name 'x'"),
    ("pi", "unknown name"),
    ("__import__", "unknown name"),
    ("__import__('os').system('echo hacked')", "not allowed"),
    ("open('/etc/passwd').read()", "not allowed"),
    ("exec('1')", "calling exec is not allowed"),
    ("eval('1+1')", "calling eval is not allowed"),
    ("().__class__.__bases__", "not allowed"),
    ("(1).__class__", "Attribute is not allowed"),
    ("[x for x in range(9)]", "ListComp is not allowed"),
    ("sum(i for i in range(10))", "calling sum is not allowed"),
    ("{1: 2}", "Dict is not allowed"),
    ("lambda: 1", "Lambda is not allowed"),
    ("(lambda: 1)()", "calling that is not allowed"),
    ("'a' * 10", "str values are not allowed"),
    ("f'{1}'", "JoinedStr is not allowed"),
    ("True + 1", "bool values are not allowed"),
    ("1j * 2", "complex values are not allowed"),
    ("1 if 1 else 2", "IfExp is not allowed"),
    ("(a := 1)", "NamedExpr is not allowed"),
    ("2 ^ 3", "operator BitXor is not allowed"),
    ("1 < 2", "Compare is not allowed"),
    ("max(1)", "max takes 2 to 20 numbers"),
    ("sqrt(4, 2)", "sqrt takes 1 number"),
    ("sqrt(x=4)", "sqrt takes 1 number"),
    ("round(5, 10**9)", "round's digits"),
    ("9**9**9", "exponent larger than 100"),
    ("10**100000", "exponent larger than 100"),
    ("2 ** 64 ** 2", "exponent larger than 100"),
    ("10**18 * 10", "number too large"),
    ("1e400", "number too large"),
    ("99999999999999999999", "number too large"),
    ("1e300 ** 2", "number too large"),
    ("(-8) ** 0.5", "not a real number"),
    (HUGE, "longer than 200 characters"),
    ("(" * 50 + "1" + ")" * 50, "nested deeper than 10"),
    ("-" * 150 + "1", None),  # not an error: a long chain of unary minus is fine, and fast
    ("1 / 0", "division by zero"),
    ("5 // 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("sqrt(-1)", "math domain error"),
    ("1 +", "invalid syntax"),
    ("import os", "invalid syntax"),
    ("1; 2", "invalid syntax"),
    ("", "empty expression"),
    ("12 × 3", "invalid syntax"),
])
def test_calculator_refuses_quickly_with_an_error_string(tool, expression, message):
    started = time.perf_counter()
    result, ok = tool.calculator(expression)  # never raises
    assert time.perf_counter() - started < 0.5
    if message is None:
        assert ok and result == "1"
        return
    assert not ok and result.startswith("error: ") and message in result, result
    assert len(result) < 200


# ----------------------------------------------------------------------------------------------
# Tool-call parsing
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("turn, expression, result", [
    ("Let me compute. <calculator>12*(3+4)</calculator>", "12*(3+4)", ("84", True)),
    ("<calculator> 2 * 3 </calculator>", " 2 * 3 ", ("6", True)),
    ("no call at all", None, None),
    ("<calculator>1+2", None, None),  # unclosed: no call
    ("1+2</calculator>", None, None),  # closed but never opened: no call
    ("<calculator>1+1</calculator> and <calculator>2*3</calculator>", "2*3", ("6", True)),  # several: the last runs
    ("<calculator>1+1</calculator> and <calculator>2*3", "1+1", ("2", True)),  # the last complete one
    ("<answer> 5 </answer><calculator>1+2</calculator>", None, None),  # after the answer: the episode has ended
    ("<calculator>1+<calculator>2</calculator>", "1+<calculator>2", ("error: nested <calculator> tags", False)),
    ("<calculator>1/0</calculator>", "1/0", ("error: division by zero", False)),
    ("<calculator></calculator>", "", ("error: empty expression", False)),
])
def test_tool_call_parsing(tool, turn, expression, result):
    assert tool.find_tool_call(turn) == expression
    assert (None if expression is None else tool.run_tool_call(expression)) == result


def test_unclosed_calls_are_parsed_in_linear_time():
    """The call search began again at every <calculator> left unclosed and scanned from it to the end of the turn: n
    openers, n^2 steps (3,000 took 38 s). It stops at the turn's last closing tag now: a million openers, which the
    old parser would scan for a day, take milliseconds. run_command's guard (600 s) is against that hang, not a
    speed test; the subprocess is what lets the guard stop a search that never returns."""
    code = ("import sys; sys.path.insert(0, 'benchmarks'); from common import load_experiment; "
            f"tool = load_experiment({NAME!r}); "
            "print(tool.find_tool_call('<calculator>1+1</calculator>' + '<calculator>' * 1_000_000))")
    result = run_command([sys.executable, "-c", code])
    assert result.returncode == 0 and result.stdout == "1+1\n", result.stderr[-2000:]  # the last complete call


# ----------------------------------------------------------------------------------------------
# Multi-turn rollouts with scripted model tokens: the masks, token by token
# ----------------------------------------------------------------------------------------------


def script_turns(monkeypatch, tool, tokenizer, turns):
    """Make the sampler emit scripted tokens: turns[row] is the list of texts of that row's turns. Each turn ends
    where the real loop ends it (a stop string or the budget), so the k-th sampling loop plays every row's k-th
    turn, for the rows that still have one (the others have dropped out). Returns the log-probability the model
    gave each scripted token, per row in order, to compare with what training computes."""
    ids = [[tokenizer(text, add_special_tokens=False).input_ids for text in row] for row in turns]
    state = {"turn": 0, "step": 0}
    chosen_log_probs = [[] for _ in turns]

    def fake_sample_token(logits, temperature, top_p, uniforms=None):
        k, t = state["turn"], state["step"]
        rows = [row for row in range(len(ids)) if len(ids[row]) > k]
        assert logits.shape[0] == len(rows), "the batch holds exactly the episodes still running"
        tokens = []
        for i, row in enumerate(rows):
            turn = ids[row][k]
            token = turn[t] if t < len(turn) else tokenizer.pad_token_id  # finished rows: masked anyway
            if t < len(turn):
                chosen_log_probs[row].append(torch.log_softmax(logits[i].float(), -1)[token].item())
            tokens.append(token)
        if t == max(len(ids[row][k]) for row in rows) - 1:
            state["turn"], state["step"] = k + 1, 0
        else:
            state["step"] = t + 1
        return torch.tensor(tokens)

    monkeypatch.setattr(tool, "sample_token", fake_sample_token)
    monkeypatch.setattr(tiny_grpo.decode, "ENDED_SHARE", 2.0)  # every row of a turn to its end: the script gives each one a token
    return chosen_log_probs


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


def test_a_decimal_over_a_number_is_an_answer_not_a_crash(tool):
    """'<answer> 1.5/2 </answer>' raised ValueError inside the reward and stopped the run; it is 3/4 now."""
    assert tool.parse_number("1.5/2") == 0.75 and tool.parse_number("98.6/0") is None
    assert tool.correctness("<answer> 1.5/2 </answer>", "0.75") == 1.0


def test_two_call_episode_masks_token_by_token(tiny_tool, monkeypatch):
    tool, model, tokenizer = tiny_tool
    turns = [
        ["I compute. <calculator>12*(3+4)</calculator>", "<calculator>84-4</calculator>", "so <answer>80</answer>"],
        ["<calculator>1/0</calculator>", "<answer>7</answer>"],
    ]
    observations = [["<result>84</result>", "<result>80</result>"], ["<result>error: division by zero</result>"]]
    chosen_log_probs = script_turns(monkeypatch, tool, tokenizer, turns)
    contexts = []
    real_sample = tool.sample

    def recording_sample(model, tokenizer, ids, mask, *args):
        contexts.append([tokenizer.decode(row[m.bool()]) for row, m in zip(ids, mask)])
        return real_sample(model, tokenizer, ids, mask, *args)

    monkeypatch.setattr(tool, "sample", recording_sample)
    prompt = tool.format_prompt(tokenizer, "What is 12*(3+4)-4?")
    result = tool.rollout(model, tokenizer, [{"prompt": prompt, "answer": "80"}], group_size=2, max_length=100, max_turns=4)

    # the model saw each result before its next turn; the episode that finished dropped out of the batch
    assert [len(c) for c in contexts] == [1, 2, 1]  # turn 1: the prompt once (its cache shared by the group)
    assert contexts[1][0].endswith("<calculator>12*(3+4)</calculator><result>84</result>")
    assert contexts[1][1].endswith("<calculator>1/0</calculator><result>error: division by zero</result>")
    assert contexts[2][0].endswith("</calculator><result>84</result><calculator>84-4</calculator><result>80</result>")

    width = result.action_mask.shape[1]
    prompt_width = result.sequence_ids.shape[1] - width
    for row in range(2):
        expected_ids, expected_actions = [], []
        for k, text in enumerate(turns[row]):
            expected_ids += encode(tokenizer, text)
            expected_actions += [1] * len(encode(tokenizer, text))
            if k < len(observations[row]):
                expected_ids += encode(tokenizer, observations[row][k])
                expected_actions += [0] * len(encode(tokenizer, observations[row][k]))
        episode = result.sequence_ids[row, prompt_width:].tolist()
        actions = result.action_mask[row].tolist()
        attention = result.attention_mask[row, prompt_width:].tolist()
        for position in range(width):  # token by token
            if position < len(expected_ids):
                assert episode[position] == expected_ids[position], (row, position)
                assert actions[position] == expected_actions[position], (row, position)
                assert attention[position] == 1, (row, position)
            else:
                assert (episode[position], actions[position], attention[position]) == (tokenizer.pad_token_id, 0, 0)
        assert result.completions[row] == "".join(turns[row])  # the model's own words, results left out
        assert result.transcripts[row] == "".join(t + o for t, o in zip(turns[row], observations[row] + [""]))

    assert result.tool_calls.tolist() == [2, 1] and result.tool_errors.tolist() == [0, 1] and result.turns.tolist() == [3, 2]
    assert result.result_tokens.tolist() == [sum(len(encode(tokenizer, o)) for o in row) for row in observations]
    assert result.terms["correctness"].tolist() == [1.0, 0.0]
    assert result.terms["format"].tolist() == [1.0, 1.0]
    assert result.terms["tool"].tolist() == [1.0, 0.0]  # calls that ran: 2 of 2, 0 of 1

    # Training sees what sampling saw: the log-probs that sequence_log_probs computes at the action positions
    # of the assembled rows (results in the context, left padding, positions) equal the sampler's, token by token,
    # and the tool results never reach the output layer: 0 there, as training calls it (with the action mask).
    log_probs, _ = tool.sequence_log_probs(model, result.sequence_ids, result.attention_mask, width, action_mask=result.action_mask)
    for row in range(2):
        ours = log_probs[row][result.action_mask[row].bool()]
        assert torch.allclose(ours, torch.tensor(chosen_log_probs[row]), atol=1e-4)
    assert (log_probs[~result.action_mask.bool()] == 0).all()


def test_call_limit_and_budget_end_episodes(tiny_tool, monkeypatch):
    """--max-turns 1: a second call is not run. The budget counts the model's tokens only, per row: a row whose
    turn runs past its own budget is cut there, even when the batch samples longer for another row."""
    tool, model, tokenizer = tiny_tool
    call = "<calculator>2*3</calculator>"  # 28 tokens
    short = "<calculator>1</calculator>"  # 26 tokens
    budget = 60
    turns = [[call, "a" * (budget - len(short))], [short, "<calculator>6+1</calculator>"]]
    script_turns(monkeypatch, tool, tokenizer, turns)
    prompt = tool.format_prompt(tokenizer, "What is 2*3?")
    result = tool.rollout(model, tokenizer, [{"prompt": prompt, "answer": "6"}], group_size=2, max_length=budget, max_turns=1)
    assert result.action_mask.sum(1).tolist() == [budget, len(short) + len("<calculator>6+1</calculator>")]
    assert result.tool_calls.tolist() == [1, 1] and result.turns.tolist() == [2, 2]
    assert result.transcripts[0] == call + "<result>6</result>" + "a" * (budget - len(call))
    assert result.transcripts[1].endswith("<result>1</result><calculator>6+1</calculator>")  # not run: no result


def test_no_calculator_with_max_turns_zero(tiny_tool, monkeypatch):
    tool, model, tokenizer = tiny_tool
    script_turns(monkeypatch, tool, tokenizer, [["<calculator>2*3</calculator>"], ["<answer>6</answer>"]])
    result = tool.rollout(model, tokenizer, [{"prompt": tool.format_prompt(tokenizer, "What is 2*3?"), "answer": "6"}],
                          group_size=2, max_length=50, max_turns=0)
    assert result.tool_calls.tolist() == [0, 0] and result.turns.tolist() == [1, 1]
    assert torch.equal(result.attention_mask[:, -result.action_mask.shape[1]:], result.action_mask)
    assert result.terms["format"].tolist() == [0.0, 1.0] and result.rewards[1] > result.rewards[0]


# ----------------------------------------------------------------------------------------------
# Rewards and options
# ----------------------------------------------------------------------------------------------


def test_reward_terms(tool):
    good = "<calculator>482*317</calculator> so <answer> 152794 </answer>"
    record = {"tool_calls": 1, "tool_errors": 0}
    assert tool.reward_terms(good, "152794", record) == {"correctness": 1.0, "format": 1.0, "tool": 1.0}
    assert tool.reward_terms("<answer>152,794</answer>", "152794") == {"correctness": 1.0, "format": 1.0, "tool": 0.0}
    assert tool.reward_terms(good, "1", {"tool_calls": 4, "tool_errors": 1})["tool"] == 0.75
    assert tool.format_score("<answer></answer>") == 0  # empty tags earn nothing
    assert tool.format_score("<answer>1</answer> more") == 0  # the answer ends the episode
    assert tool.format_score("<answer>1</answer><answer>2</answer>") == 0
    assert tool.format_score("<calculator>1+ <answer>1</answer>") == 0  # an unclosed call
    rewards, _ = tool.Scorer()([good], ["152794"], [record])
    assert rewards.tolist() == [pytest.approx(1.2)]  # correctness=1, format=0.1, tool=0.1


def test_a_result_the_model_writes_itself_earns_no_format_credit(tool):
    """A completion that wrote its own <result>...</result> earned full format credit. The completion is the model's
    words with the tool's results left out (rollout), so a result in it is made up: the format term refuses it, as
    the QA copy's refuses a made-up <information>."""
    made_up = "<calculator>482*317</calculator><result>152794</result> <answer> 152794 </answer>"
    assert tool.format_score(made_up) == 0
    assert tool.format_score("<result>6</result> <answer> 6 </answer>") == 0  # without a call
    assert tool.format_score("<calculator>2*3</calculator></result> <answer> 6 </answer>") == 0  # the closing tag alone
    assert tool.format_score(made_up.replace("<result>152794</result>", "")) == 1  # the same words without it


def test_plain_prompt_plays_a_worked_exchange(tool):
    prompt = tool.format_prompt(types.SimpleNamespace(chat_template=None), "What is 2 * 3?")  # no chat template
    assert prompt.startswith(tool.system_prompt()) and prompt.endswith("\nUser: What is 2 * 3?\nAssistant:")
    assert f"Assistant: {tool.EXAMPLE_EPISODE}\nUser:" in prompt
    call = tool.find_tool_call(tool.EXAMPLE_EPISODE.split("<result>")[0])
    assert tool.run_tool_call(call) == ("84", True)  # the example is true
    assert tool.reward_terms(tool.EXAMPLE_EPISODE.replace("<result>84</result>", ""), "84") == {
        "correctness": 1.0, "format": 1.0, "tool": 0.0}


def test_options_and_bad_values(tool, capsys):
    args = tool.parse_args(["--device", "cpu"])
    assert args.max_turns == 4 and args.data_path == "data/tool_tasks.jsonl"
    assert args.eval_data_path == "data/tool_tasks_eval.jsonl"
    if not torch.cuda.is_available():  # --device cuda:N falls back to CPU without CUDA
        assert tool.parse_args(["--device", "cuda:1"]).device == "cpu"
        assert "no CUDA device is available" in capsys.readouterr().err
    for argv, expected in [
        (["--max-turns", "-1"], "argument --max-turns: must be an integer in [0, inf), got -1"),
        (["--reward-weights", "reasoning=1"], "unknown reward term 'reasoning'"),
        (["--task", "math"], "unrecognized arguments: --task math"),
    ]:
        with pytest.raises(SystemExit):
            tool.parse_args(["--device", "cpu", *argv] if "--device" not in argv else argv)
        assert expected in capsys.readouterr().err, argv


def test_the_context_check_counts_the_tool_results(tiny_tool):
    """check_context counted the prompt and --max-length but not the tool results, which come on top of --max-length:
    --max-length 600 --max-turns 100 passed it, and an episode of 1,808 positions then ran against a 1,024-token
    context. Now --max-turns results of the longest a call can append count too (the tiny model's 2,048 positions,
    a prompt of about 520 tokens); the --max-turns the refusal names fits, one more does not. The count per call is
    at least what the calculator appends for any result or error, long numbers and names echoed back included."""
    tool, model, tokenizer = tiny_tool
    tasks = [{"question": "What is 2*3?", "answer": "6", "metadata": {}}]
    args = tool.parse_args(["--device", "cpu", "--max-length", "600", "--max-turns", "100"])
    with pytest.raises(tool.InputError, match="--max-turns 100: ") as refused:
        tool.add_prompts(model, tokenizer, args, tasks, [])
    assert "more than the model's context of 2048" in str(refused.value), refused.value
    fits = int(re.search(r"--max-turns (\d+) fits", str(refused.value)).group(1))
    assert 1 <= fits < 100
    args.max_turns = fits
    tool.check_context(model, tokenizer, args, tasks, [])  # fits: no error
    args.max_turns = fits + 1
    with pytest.raises(tool.InputError, match=f"--max-turns {fits + 1}: "):
        tool.check_context(model, tokenizer, args, tasks, [])

    per_call = tool.result_tokens(tokenizer)
    calls = ["-10**18", "10**18", "-1/7*0.1**99", "2/3", "1" * 201, "(" * 11 + "1" + ")" * 11, "1 +", "", "2 ** 101",
             "min(1)", "round(1, 99)", "1 @ 1", "1 ^ 1", "'a'", "...", "(x for x in y)", "lambda: 1", "[1, 2]",
             "1/0", "10**18 * 10", "sqrt(-1)", "(-8) ** 0.5", "Abcdefghijklmnopqrstuvwxyz(1)", "\u00e9" * 25,
             "\U0001e800" * 25 + "(1)", "1+<calculator>2"]  # names are echoed back cut to 20 characters
    for call in calls:
        text, _ = tool.run_tool_call(call)
        assert len(encode(tokenizer, f"<result>{text}</result>")) <= per_call, (call, text)


# ----------------------------------------------------------------------------------------------
# Learning, and a run as a user starts it
# ----------------------------------------------------------------------------------------------

PAIRS = [(a, b) for a in range(10, 40) for b in range(10, 40)]
def teach_calls(tool, tiny_model_dir, folder, steps):
    """The tiny model after `steps` supervised steps on calls '<calculator>12*34</calculator>', half of them written
    '12x34' instead, which the calculator refuses: it makes calls, and half of them fail. (A random model never
    spells a 28-character call; a pretrained one has seen the format.)"""
    generator = torch.Generator().manual_seed(0)

    def examples(step):
        picks = torch.randint(len(PAIRS), (16,), generator=generator).tolist()
        ops = torch.randint(2, (16,), generator=generator).tolist()
        return [("What is {} * {}?".format(*PAIRS[i]), f"<calculator>{PAIRS[i][0]}{'*x'[op]}{PAIRS[i][1]}</calculator>")
                for i, op in zip(picks, ops)]

    return teach(tool, tiny_model_dir, folder, examples, steps=steps)


@pytest.fixture(scope="module")
def caller_model_dir(tool, tiny_model_dir, tmp_path_factory):
    """Taught 200 steps: it calls in full precision (after 100 steps it spelled the tag there but not once in 4-bit)."""
    return teach_calls(tool, tiny_model_dir, tmp_path_factory.mktemp("tiny-caller"), 200)


@pytest.fixture(scope="module")
def caller_model_dir_4bit(tool, tiny_model_dir, tmp_path_factory):
    """Taught 400 steps for 4-bit. NF4 noise on a hidden-64 model is large: on a Sapphire Rapids Xeon (whose float32
    training rounds otherwise than the AMD EPYCs', where the test passed with the 200-step model) the 200-step model
    never spelled the tag in 4-bit; taught 300 steps it called in 75-88% of the episodes there, 400 steps in all
    (measured 2026-11-25; not yet run on an EPYC)."""
    return teach_calls(tool, tiny_model_dir, tmp_path_factory.mktemp("tiny-caller-4bit"), 400)


def test_grpo_learns_well_formed_calls(tool, caller_model_dir, tmp_path):
    """Reward: the tool term alone (the fraction of calls that ran). GRPO must raise it from about one half:
    only the operator token differs between a good call and a bad one, and its credit comes through the
    multi-turn episode (the result is appended and the model takes a second turn before the episode ends).
    30 steps: on the AMD EPYC with AVX-512 (Zen 4, 2026-11-27) the reward was still 0.53-0.75 at step 16-20 and rose
    to 0.75-1.0 over steps 21-30 (20 had been enough on the Sapphire Rapids and the EPYC without AVX-512)."""
    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"What is {a} * {b}?", "answer": str(a * b)} for a, b in PAIRS[:64]])

    def learn(seed):
        runs = tmp_path / f"runs{seed}"
        tool.main([
            "--model-name", str(caller_model_dir), "--device", "cpu", "--quantization", "none", "--dtype", "float32",
            "--data-path", str(data), "--max-steps", "30", "--group-size", "8", "--rollouts-per-step", "4",
            "--max-length", "40", "--max-turns", "1", "--lr", "3e-3", "--kl-weight", "0.01", "--seed", str(seed),
            "--reward-weights", "correctness=0,format=0,tool=1", "--eval-interval", "0", "--checkpoint-interval", "0",
            "--log-completions-interval", "0", "--log-dir", str(runs), "--checkpoint-path", str(tmp_path / f"out{seed}"),
            "--run-name", "learn",
        ])
        scalars = tensorboard_scalars(runs)
        series = {tag: [value for _, value in sorted(scalars[tag])] for tag in scalars}
        rewards, success = series["rollout/reward_mean"], series["rollout/tool_success_rate"]
        assert len(rewards) == 30
        start, end = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
        if not (start < 0.65 and end > 0.75 and end > start + 0.2):
            return f"reward did not rise: {[round(r, 2) for r in rewards]}"
        if sum(success[-5:]) / 5 <= 0.8:
            return f"calls that ran: {[round(s, 2) for s in success]}"
        if min(series["rollout/tool_calls_per_episode"]) <= 0.5:  # it keeps calling: it learned to call well
            return f"calls per episode: {series['rollout/tool_calls_per_episode']}"
        if sum(series["rollout/turns_per_episode"]) / 30 <= 1.5:  # a result, then another turn
            return f"turns per episode: {series['rollout/turns_per_episode']}"
        return None

    on_most_seeds(learn)


LOGGED = {
    "rollout/reward_mean", "rollout/reward_correctness", "rollout/reward_format", "rollout/reward_tool",
    "rollout/tool_calls_per_episode", "rollout/tool_errors", "rollout/turns_per_episode", "rollout/tool_success_rate",
    "rollout/result_tokens",
    "rollout/accuracy", "rollout/format_rate", "rollout/completion_length", "train/loss", "train/kl", "train/entropy",
    "eval/accuracy", "eval/format_rate", "eval/tool_calls_per_episode", "perf/step_seconds",
}


def test_two_steps_end_to_end(caller_model_dir_4bit, tmp_path):
    """A fresh process as a user starts it, in 4-bit with LoRA: two steps with calls, every tag, a checkpoint."""
    tasks = write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"What is {a} * {b}?", "answer": str(a * b)} for a, b in PAIRS[:64]])
    result = run_script(SCRIPT, "--model-name", caller_model_dir_4bit, "--device", "cpu", "--quantization", "4bit",
                        "--dtype", "float32", "--data-path", tasks, "--eval-data-path", tasks, "--eval-prompts", "4",
                        "--group-size", "4", "--rollouts-per-step", "2", "--max-length", "40", "--max-turns", "2",
                        "--max-steps", "2", "--eval-interval", "1", "--log-completions-interval", "1", "--lr", "1e-3",
                        "--run-name", "e2e", "--log-dir", tmp_path / "runs", "--checkpoint-path", tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    scalars = tensorboard_scalars(tmp_path / "runs" / "e2e")
    assert LOGGED <= set(scalars), f"missing tags: {LOGGED - set(scalars)}"
    assert sorted(step for step, _ in scalars["train/loss"]) == [1, 2]
    assert sorted(step for step, _ in scalars["eval/accuracy"]) == [0, 1, 2]
    assert all(value > 0 for _, value in scalars["rollout/tool_calls_per_episode"])  # calls were run in each step
    assert all(value > 1 for _, value in scalars["rollout/turns_per_episode"])
    checkpoint = tmp_path / "out" / "e2e" / "step_000002"
    assert (checkpoint / "adapter_model.safetensors").is_file() and (checkpoint / "training_state.pt").is_file()


def test_help_lists_the_options(tool, capsys):
    with pytest.raises(SystemExit):
        tool.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ["--run-name", "--log-dir", "--wandb", "--wandb-project", "--seed", "--device", "--model-name",
                   "--checkpoint-path", "--checkpoint-interval", "--data-path", "--max-prompts", "--group-size",
                   "--rollouts-per-step", "--train-batch-size", "--lr", "--temperature", "--max-length",
                   "--log-completions-interval", "--max-turns", "--quantization", "--no-lora", "--lora-r", "--kl-weight",
                   "--clip-eps", "--resume", "--eval-interval", "--eval-prompts", "--reward-weights"]:
        assert option in text, option
    assert "--max-turns MAX_TURNS at most this many calculator calls per episode" in text and "(default: 4)" in text


# ----------------------------------------------------------------------------------------------
# The task files
# ----------------------------------------------------------------------------------------------


def test_tool_tasks_are_reproducible_held_out_and_right(tool, tmp_path):
    result = run_script(ROOT / "data" / "make_tool_tasks.py", "--out-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ("tool_tasks.jsonl", "tool_tasks_eval.jsonl"):  # the committed files are what the script writes
        assert (tmp_path / name).read_bytes() == (ROOT / "data" / name).read_bytes(), name
    args = tool.parse_args(["--device", "cpu"])  # the default data paths of the experiment
    train, held_out = tool.load_tasks(ROOT / args.data_path), tool.load_tasks(ROOT / args.eval_data_path)
    assert len(train) >= 5000 and len(held_out) >= 500
    assert not {t["question"] for t in train} & {t["question"] for t in held_out}
    assert {t["metadata"]["kind"] for t in held_out} == {"mul", "div", "mixed"}
    for task in held_out:  # the calculator, an independent implementation, agrees with every answer
        expression = task["question"].removeprefix("What is ").removesuffix("?")
        assert tool.calculator(expression) == (task["answer"], True), task
        assert task["answer"].lstrip("-").isdigit()  # exact integer answers
    assert sum(abs(int(t["answer"])) >= 1000 for t in held_out) > len(held_out) / 2  # mostly beyond mental arithmetic
