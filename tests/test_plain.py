"""--plain: a run that takes the plain forms each train.py shows (sample's decode loop, sequence_log_probs' plain
pass, pi_old_pass, every row in the update) instead of tiny_grpo's fast forms computes what the default run does."""

import pytest
import torch
from conftest import EXPERIMENTS, ROOT, help_text

import same_run  # benchmarks/same_run.py (conftest puts benchmarks/ on the path)
import tiny_grpo.decode
import tiny_grpo.logprobs
import tiny_grpo.update

# Adam divides each weight's gradient by its own running size: where a gradient is near 0, float32 rounding moves
# the weight by a visible part of lr. A tenth of one update (lr 1e-2 in same_run's options)
WEIGHTS_ATOL = 1e-3
# the fast forms a train.py imports, none of which a --plain run takes
FAST = ((tiny_grpo.decode, "sample_fast"), (tiny_grpo.logprobs, "fast_log_probs"), (tiny_grpo.update, "rows_that_count"))


def fewer_problems(name):
    """same_run's task, math, trains on data/math_tasks.jsonl, whose 50,000 prompts a start renders through the tiny
    model's chat template (3.7 s); these runs set two forms of the same steps side by side, which the held-out
    file's 2,000 problems serve as well. The multi-turn copies have their own data."""
    return ["--data-path", "data/math_tasks_eval.jsonl"] if "--task" in same_run.options_for(name) else []


def counting(monkeypatch, calls):
    """The fast forms a train.py imports (FAST), OldLogProbs' pi_old off the first pass and micro_batches' fast form,
    counting their calls in calls; set before the train.py is loaded, which then imports these."""
    for module, name in FAST:
        real = getattr(module, name)

        def counted(*args, real=real, name=name, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    real_call = tiny_grpo.update.OldLogProbs.__call__

    def pi_old(self, *args):
        calls["pi_old off the first pass"] = calls.get("pi_old off the first pass", 0) + self.first_pass
        return real_call(self, *args)

    monkeypatch.setattr(tiny_grpo.update.OldLogProbs, "__call__", pi_old)
    real_split = tiny_grpo.update.micro_batches

    def micro_batches(rows, size, counted=None):  # the fast form: the rows counted, in the batch's order
        calls["micro-batches of the rows counted"] = calls.get("micro-batches of the rows counted", 0) + (
            counted is not None)
        return real_split(rows, size, counted)

    monkeypatch.setattr(tiny_grpo.update, "micro_batches", micro_batches)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_a_plain_run_is_the_default_run(name, tiny_model_dir, tmp_path, monkeypatch):
    """benchmarks/same_run.py's two steps of the copy's main() (float32, a tiny random Llama, beta 0.01, two updates a
    step but in experiment_accelerate_ddp), once as a run is, once with --plain: the same completions at both steps,
    and the final checkpoint's tensors within WEIGHTS_ATOL. The plain and fast forms' log-probs differ by float32
    rounding only (test_fast_log_probs_equal_the_plain_form holds them within 1e-5), which Adam can scale (above).
    The reward is the completion's length, which no group ties on: with every advantage 0 and pi_theta = pi_ref (the
    first step, LoRA's B at 0) the KL's gradient is exactly 0 in the plain form but rounding in the fast one, whose
    pi_ref and pi_theta passes pack other rows together, and Adam makes that rounding a step of lr.
    The default run takes sample_fast and fast_log_probs; --plain takes neither, nor rows_that_count, nor pi_old off
    the first pass, nor micro-batches sorted to the rows counted (rows.split(size) instead); and --help offers
    --plain."""
    assert "--plain" in help_text(name)
    monkeypatch.chdir(ROOT)  # the tasks' data paths are relative to the repository root
    (tmp_path / "length_reward.py").write_text("def reward(completion, answer, metadata):\n"
                                               "    return len(completion) / 24\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the reward's process finds its module where the run does
    runs, calls = [], []
    for extra in ((), ("--plain",)):
        calls.append({})
        with monkeypatch.context() as patch:
            counting(patch, calls[-1])
            runs.append(same_run.two_steps(ROOT / name, tiny_model_dir, tmp_path / f"run{len(runs)}", *extra,
                                           *fewer_problems(name),
                                           "--reward-fn", "length_reward:reward"))
    (completions, weights), (plain_completions, plain_weights) = runs
    assert plain_completions == completions
    assert [key for key, _ in plain_weights] == [key for key, _ in weights] and weights
    for (key, plain), (_, fast) in zip(plain_weights, weights):
        assert torch.allclose(plain, fast, rtol=0, atol=WEIGHTS_ATOL), (key, (plain - fast).abs().max().item())
    assert calls[0]["sample_fast"] and calls[0]["fast_log_probs"]
    assert not any(calls[1].values()), calls[1]


def test_a_run_resumes_with_or_without_plain(tiny_model_dir, tmp_path, monkeypatch):
    """--plain changes no number: a checkpoint of a default run is resumed with --plain (and the other way round)."""
    module = same_run.load_module(ROOT / "experiment_base" / "train.py", "experiment_base_plain_resume")
    monkeypatch.chdir(ROOT)
    options = [*same_run.options_for("experiment_base"), *fewer_problems("experiment_base"),
               "--model-name", str(tiny_model_dir),
               "--checkpoint-path", str(tmp_path / "out"), "--log-dir", str(tmp_path / "runs"), "--run-name", "r"]
    module.main([*options, "--max-steps", "1"])
    module.main([*options, "--max-steps", "2", "--plain", "--resume", str(tmp_path / "out" / "r")])
    module.main([*options, "--max-steps", "3", "--resume", str(tmp_path / "out" / "r")])
    assert (tmp_path / "out" / "r" / "step_000003").is_dir()


@pytest.mark.parametrize("plain", [False, True])
def test_a_plain_run_trains_in_bfloat16(plain, tiny_model_dir, tmp_path, monkeypatch):
    """--plain's forward runs without autocast, and gradient checkpointing repeats it in the backward pass inside
    uncast_lora_inputs, which must leave peft's cast of the bfloat16 input to the float32 adapter in place there
    (it did not: "expected m1 and m2 to have the same dtype", the default CPU command with --plain on 2026-11-29).
    Two steps of the tiny model in bfloat16, plain or not, with an update that has a gradient."""
    module = same_run.load_module(ROOT / "experiment_base" / "train.py", f"experiment_base_bf16_{plain}")
    monkeypatch.chdir(ROOT)
    module.main([*same_run.options_for("experiment_base"), *fewer_problems("experiment_base"),
                 "--model-name", str(tiny_model_dir), "--dtype", "bfloat16",
                 "--gradient-checkpointing", "--checkpoint-path", str(tmp_path / "out"), "--log-dir", str(tmp_path / "runs"), "--run-name", "r",
                 *(["--plain"] if plain else [])])
    assert (tmp_path / "out" / "r" / "step_000002").is_dir()
