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


def test_the_progress_bar_names_the_held_out_accuracy_only_once_there_is_one():
    """A run before its first evaluation (or with --eval-interval 0, or resumed from a checkpoint that keeps no
    curve) drew 'held_out=' with nothing after it."""
    import io

    from tqdm import tqdm

    from tiny_grpo.report import advance_bar

    out = io.StringIO()
    progress = tqdm(total=3, file=out, mininterval=0, ascii=True)
    advance_bar(progress, {"rollout/reward_mean": 0.25}, {"kl": 0.0}, {})
    assert "reward=0.250" in out.getvalue() and "held_out" not in out.getvalue()
    advance_bar(progress, {"rollout/reward_mean": 0.5}, {}, {0: {"eval/accuracy": 0.18}, 10: {"eval/accuracy": 0.36}})
    assert "held_out=18% -> 36%" in out.getvalue().splitlines()[-1].split("\r")[-1]
