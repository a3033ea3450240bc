"""Learning is tested by learning: GRPO must raise the reward of a task the tiny model can learn."""

import pytest

from conftest import learn_sevens


@pytest.mark.parametrize("quantization", ["4bit", "none"])
def test_grpo_raises_reward(task_experiment, tiny_model_dir, tmp_path, monkeypatch, quantization):
    # each experiment's own KL weight
    rewards = learn_sevens(task_experiment, tiny_model_dir, tmp_path, monkeypatch, 20, "--quantization", quantization)
    start, end = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert start < 0.1 and end > 0.6, f"reward did not rise: {[round(r, 2) for r in rewards]}"
