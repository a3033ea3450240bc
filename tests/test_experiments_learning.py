"""Learning is tested by learning: GRPO must raise the reward of a task the tiny model can learn."""

import pytest

from conftest import TASK_EXPERIMENTS, learn_sevens, load_experiment


# Every copy learns on its 4-bit model, the real thing; full-precision weights in experiment_base (the copies' loading
# code is the same, and experiment_drgrpo's seven algorithms learn in full precision in their own tests).
RUNS = [(name, "4bit") for name in TASK_EXPERIMENTS] + [("experiment_base", "none")]


@pytest.mark.parametrize("name, quantization", RUNS)
def test_grpo_raises_reward(name, tiny_model_dir, tmp_path, monkeypatch, quantization):
    task_experiment = load_experiment(name)  # each experiment's own KL weight
    rewards = learn_sevens(task_experiment, tiny_model_dir, tmp_path, monkeypatch, 20, "--quantization", quantization)
    start, end = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert start < 0.1 and end > 0.6, f"reward did not rise: {[round(r, 2) for r in rewards]}"
