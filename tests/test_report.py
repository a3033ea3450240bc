"""What a step logs (tiny_grpo/report.py's step_metrics): the learning signal, counted by hand."""

from types import SimpleNamespace

import torch

from tiny_grpo.report import step_metrics


def test_the_learning_signal_counts_the_completions_and_tokens_of_groups_whose_rewards_differ():
    # two groups of 3: the first all equal (no gradient), the second with one right answer
    rewards = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    lengths = [4, 2, 2, 3, 1, 2]  # action tokens per completion; the second group's hold 6 of the 14
    mask = torch.tensor([[1] * n + [0] * (4 - n) for n in lengths])
    result = SimpleNamespace(action_mask=mask, completions=["x"] * 6,
                             terms={"format": torch.ones(6), "correctness": rewards.flatten()})
    memory = SimpleNamespace(metrics=lambda: {})
    metrics = step_metrics(result, rewards, {"loss": 0.5, "tokens": []}, 1.0, 2.0, memory)
    assert metrics["rollout/zero_spread_groups"] == 0.5
    assert metrics["rollout/completions_with_signal"] == 0.5
    assert metrics["rollout/tokens_with_signal"] == 6 / 14
    assert metrics["train/loss"] == 0.5 and "train/tokens" not in metrics
    everything = step_metrics(result, torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 1.0]]), {}, 1.0, 2.0, memory)
    assert everything["rollout/completions_with_signal"] == everything["rollout/tokens_with_signal"] == 1.0
