"""Learning is tested by learning: GRPO must raise the reward of a task the tiny model can learn."""

import pytest

from conftest import tensorboard_scalars, write_jsonl


def seven_reward(completion, answer, *args, **kwargs):
    """Reward terms whose correctness is the fraction of the completion's characters that are '7': about 1%
    for the untrained model."""
    return {"correctness": completion.count("7") / max(1, len(completion)), "format": 0.0, "reasoning": 0.0}


@pytest.mark.parametrize("quantization", ["4bit", "none"])
def test_grpo_raises_reward(task_experiment, tiny_model_dir, tmp_path, monkeypatch, quantization):
    monkeypatch.setattr(task_experiment, "reward_terms", seven_reward)
    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"Say something {i}", "answer": "7"} for i in range(64)])
    task_experiment.main([
        "--model-name", str(tiny_model_dir), "--device", "cpu", "--quantization", quantization, "--dtype", "float32",
        "--data-path", str(data), "--max-steps", "20", "--group-size", "8", "--rollouts-per-step", "4",
        "--max-length", "8", "--lr", "3e-2", "--seed", "1", "--eval-interval", "0",  # each experiment's own KL weight
        "--checkpoint-interval", "0", "--log-completions-interval", "0",
        "--log-dir", str(tmp_path / "runs"), "--checkpoint-path", str(tmp_path / "out"), "--run-name", "learn",
    ])
    rewards = [value for _, value in sorted(tensorboard_scalars(tmp_path / "runs")["rollout/reward_mean"])]
    assert len(rewards) == 20
    start, end = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert start < 0.1 and end > 0.6, f"reward did not rise: {[round(r, 2) for r in rewards]}"
