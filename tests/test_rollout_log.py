"""The rollout log (docs/rollout-log.md) and the diagnostics scalars, from real runs of the tiny model (train.py's
main() in the test's process: a fresh interpreter would spend about 10 s a start importing torch, transformers and
peft): what each record holds, that it agrees with TensorBoard and with the GRPO formulas, its bounds, and that a
resumed run drops what a crashed one wrote after its checkpoint."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import run_main, tensorboard_scalars, write_jsonl
from tiny_grpo.rollout_log import RolloutLog


@pytest.fixture
def tasks(tmp_path):
    rows = [{"question": f"What is {i} + 1? <script>alert(1)</script>", "answer": str(i + 1)} for i in range(8)]
    return write_jsonl(tmp_path / "tasks.jsonl", rows)


def train(model_dir, tasks, tmp_path, *extra, experiment="experiment_base"):
    """A start of run r of the tiny model, its folders under tmp_path, from there; it must succeed."""
    argv = ["--model-name", model_dir, "--device", "cpu", "--dtype", "float32", "--data-path", tasks, "--eval-data-path",
            tasks, "--eval-prompts", "3", "--group-size", "4", "--rollouts-per-step", "2", "--max-length", "10", "--lr",
            "1e-2", "--run-name", "r", "--log-dir", tmp_path / "runs", "--checkpoint-path", tmp_path / "out", *extra]
    run_main(experiment, argv, tmp_path)
    return tmp_path / "runs" / "r"


def records(run, kind=None):
    lines = (run / "rollouts.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if kind is None or r["kind"] == kind]


def test_a_step_record_holds_each_group_and_token_as_grpo_computed_it(tiny_model_dir, tasks, tmp_path):
    """Two updates a step and a clip of 0.01, so that the second mini-batch's ratio moves and the clip acts: each
    token's clip side follows from its ratio and its completion's advantage; the scalars are TensorBoard's; the KL is
    there with beta > 0; the evaluations hold their completions."""
    (tmp_path / "length_reward.py").write_text("def reward(completion, answer, metadata):\n    return len(completion) / 12\n")
    run = train(tiny_model_dir, tasks, tmp_path, "--max-steps", "2", "--eval-interval", "1", "--updates-per-step", "2",
                "--clip-eps", "0.01", "--kl-weight", "0.1", "--reward-fn", "length_reward:reward")  # rewards that vary
    header, *rest = records(run)
    assert len(header.pop("start")) == 16  # this start's id (its checkpoints' log_starts name it)
    assert header == {"kind": "run", "experiment": "experiment_base", "run_name": "r", "group_size": 4, "clip_eps": 0.01,
                      "kl_weight": 0.1, "max_length": 10, "temperature": 0.35,
                      "reward_weights": {"correctness": 1.0, "format": 0.1, "reasoning": 0.0, "custom": 1.0},
                      "start_step": 0, "epochs_per_step": 1, "updates_per_step": 2}
    assert [(r["kind"], r["step"]) for r in rest] == [("eval", 0), ("eval", 1), ("step", 1), ("eval", 2), ("step", 2)]
    scalars = tensorboard_scalars(run)
    clipped_sides, moved = set(), []
    for record in records(run, "step"):
        for name, value in record["scalars"].items():
            logged = dict(scalars[name])[record["step"]]
            assert value == pytest.approx(logged, rel=1e-3, abs=1e-6), name
        assert [g["index"] for g in record["groups"]] == [0, 1]
        for group in record["groups"]:
            assert "<script>" in group["question"] and group["prompt"].endswith("<|assistant|>")
            rewards = [c["reward"] for c in group["completions"]]
            assert group["rewards_equal"] == (max(rewards) == min(rewards)) and len(rewards) == 4
            for c in group["completions"]:
                n = len(c["tokens"])
                assert 1 <= n <= 10 and c["action"] == [1] * n  # the base experiment: every token the policy's
                assert c["truncated"] == (n == 10)
                assert all(len(c[name]) == n for name in ("logp_old", "ratio", "clipped", "kl"))
                assert all(lp <= 0 for lp in c["logp_old"]) and all(k >= 0 for k in c["kl"])
                if group is first_ran(record):  # pi_new after the update: one group a step, the first a pass ran
                    assert len(c["logp_new"]) == n and all(lp <= 0 for lp in c["logp_new"])
                    moved += [abs(new - old) for new, old in zip(c["logp_new"], c["logp_old"])]
                else:
                    assert c["logp_new"] is None
                for ratio, side in zip(c["ratio"], c["clipped"]):
                    high, low = ratio > 1.01 and c["advantage"] > 0, ratio < 0.99 and c["advantage"] < 0
                    if abs(abs(ratio - 1) - 0.01) > 1e-3:  # not at the edge, where 4 digits cannot tell
                        assert side == (1 if high else -1 if low else 0)
                    clipped_sides.add(side)
        assert record["logp_new_seconds"] > 0  # the extra pass ran, and its cost is recorded
        train_scalars = record["scalars"]
        assert train_scalars["train/clip_low_fraction"] + train_scalars["train/clip_high_fraction"] == pytest.approx(
            train_scalars["train/clip_fraction"], abs=1e-3)
        assert train_scalars["train/ratio_min"] <= 1 <= train_scalars["train/ratio_max"]  # the first update's is 1
        cut = [c["truncated"] for g in record["groups"] for c in g["completions"]]
        assert sum(v for k, v in train_scalars.items() if k.startswith("rollout/reward_share_")) == pytest.approx(1, abs=1e-3)
        assert train_scalars["rollout/cut_at_budget"] == pytest.approx(sum(cut) / len(cut))
    assert clipped_sides & {1, -1}  # the clip acted
    assert max(moved) > 1e-2  # the updates moved the policy, and log pi_new shows it
    evaluation = records(run, "eval")[-1]
    assert len(evaluation["completions"]) == 3
    assert [c["correct"] for c in evaluation["completions"]].count(True) / 3 == pytest.approx(
        evaluation["metrics"]["eval/accuracy"], abs=1e-3)
    assert (run / "rollouts.html").is_file()  # the page, written at the end


def test_rows_no_pass_ran_have_no_token_values_and_the_bounds_hold(tiny_model_dir, tasks, tmp_path):
    """With beta = 0 a completion whose advantage is 0 is skipped by the update: its per-token values are null, not
    made up; --log-rollouts 2 logs every second step, --log-rollout-groups 1 one group; no KL is logged at beta 0.
    The untrained tiny model answers none right: its groups' rewards are all equal (0), so no row runs."""
    run = train(tiny_model_dir, tasks, tmp_path, "--max-steps", "4", "--eval-interval", "0", "--kl-weight", "0",
                "--log-rollouts", "2", "--log-rollout-groups", "1")
    steps = records(run, "step")
    assert [r["step"] for r in steps] == [2, 4] and all(len(r["groups"]) == 1 for r in steps)
    for record in steps:
        assert record["logp_new_seconds"] is None  # no row ran, so no extra pass either
        for c in record["groups"][0]["completions"]:
            assert "kl" not in c
            assert c["advantage"] == 0 and record["groups"][0]["rewards_equal"]
            assert c["logp_old"] is None and c["ratio"] is None and c["clipped"] is None and c["logp_new"] is None


def first_ran(record):
    return next(g for g in record["groups"] if any(c["logp_old"] is not None for c in g["completions"]))


def test_logp_new_is_the_policy_after_the_update_not_the_one_that_sampled(tiny_model_dir, tasks, tmp_path):
    """log pi_new is one more pass after the step's last update: with a learning rate of 1e-12 the update changes
    nothing that shows, so it is log pi_old to the 4 digits logged (one update a step: pi_old is read off the first pass's
    forward, pi_new from a pass of its own in eval mode, the same weights); the test above has it move."""
    (tmp_path / "length_reward.py").write_text("def reward(completion, answer, metadata):\n    return len(completion) / 12\n")
    run = train(tiny_model_dir, tasks, tmp_path, "--max-steps", "2", "--eval-interval", "0", "--lr", "1e-12",
                "--reward-fn", "length_reward:reward", "--kl-weight", "0.1")
    compared = 0
    for record in records(run, "step"):
        for c in first_ran(record)["completions"]:
            assert c["logp_new"] == pytest.approx(c["logp_old"], abs=2e-3, rel=1e-3)
            compared += len(c["logp_new"])
    assert compared > 10


def test_log_off_writes_nothing(tiny_model_dir, tasks, tmp_path):
    run = train(tiny_model_dir, tasks, tmp_path, "--max-steps", "1", "--eval-interval", "0", "--log-rollouts", "0")
    assert not (run / "rollouts.jsonl").exists() and not (run / "rollouts.html").exists()


def test_a_resumed_run_drops_what_a_crashed_run_wrote_after_its_checkpoint(tiny_model_dir, tasks, tmp_path):
    """As TensorBoard's purge_step: the records after the checkpoint's step (a crash after step 2's checkpoint, say,
    left steps 3 and 4 and half a line) are dropped when the run resumes, then the resumed start's run record and
    steps appended once."""
    run = train(tiny_model_dir, tasks, tmp_path, "--max-steps", "2", "--eval-interval", "0")
    with open(run / "rollouts.jsonl", "a", encoding="utf-8") as log:
        log.write(json.dumps({"kind": "step", "step": 3, "scalars": {}, "groups": []}) + "\n")
        log.write(json.dumps({"kind": "eval", "step": 4, "metrics": {}, "completions": []}) + "\n")
        log.write('{"kind": "step", "step": 4, "sca')  # the crash, mid-line
    train(tiny_model_dir, tasks, tmp_path, "--max-steps", "3", "--eval-interval", "0", "--resume", tmp_path / "out" / "r")
    assert [(r["kind"], r.get("step")) for r in records(run)] == [("run", None), ("step", 1), ("step", 2), ("run", None),
                                                                  ("step", 3)]


def test_context_tokens_are_shown_outside_the_action_mask():
    """A multi-turn episode's tool result sits inside the completion with action 0: its tokens are logged as context
    (action 0), with no per-token values; the model's own tokens keep theirs. Padding is not logged."""
    args = SimpleNamespace(log_rollouts=1, log_rollout_groups=0, device="cpu", log_dir="unused", run_name="r",
                           group_size=1, max_length=10, kl_weight=0.0)
    log = RolloutLog.__new__(RolloutLog)
    log.args, log.tokenizer, log.pieces = args, None, {}
    result = SimpleNamespace(
        sequence_ids=torch.tensor([[7, 8, 11, 12, 13, 14, 0]]), attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1, 0]]),
        action_mask=torch.tensor([[1, 0, 0, 1, 1]]), rewards=torch.tensor([0.5]), completions=["a<result>b</result>c"],
        terms={"correctness": torch.tensor([0.5])})
    values = {"ratio": torch.tensor([1.1, 9.0, 9.0, 0.9, 1.0]), "logp_old": torch.full((5,), -1.0),
              "clipped": torch.tensor([1.0, 0, 0, -1.0, 0])}
    record = log.completion(result, 0, torch.tensor([2.0]), values)
    assert record["tokens"] == ["11", "12", "13", "14"] and record["action"] == [1, 0, 0, 1]
    assert record["ratio"] == [1.1, None, None, 0.9] and record["clipped"] == [1, None, None, -1]
    assert record["advantage"] == 2.0 and record["terms"] == {"correctness": 0.5} and not record["truncated"]
    assert all(isinstance(v, float) and math.isfinite(v) for v in record["logp_old"] if v is not None)


@pytest.mark.parametrize("algorithm", ["cispo", "gspo"])
def test_the_drgrpo_experiment_logs_its_own_ratio_and_clip(algorithm, tiny_model_dir, tasks, tmp_path):
    """experiment_drgrpo's loss is its algorithm's (CISPO's clipped weight, GSPO's one ratio per sequence): its
    rollout log holds that ratio at each token (GSPO's the same along a completion) and the side its clip acted on."""
    (tmp_path / "length_reward.py").write_text("def reward(completion, answer, metadata):\n    return len(completion) / 12\n")
    run = train(tiny_model_dir, tasks, tmp_path, "--max-steps", "1", "--eval-interval", "0", "--algorithm", algorithm,
                "--updates-per-step", "2", "--reward-fn", "length_reward:reward", experiment="experiment_drgrpo")
    completions = [c for g in records(run, "step")[0]["groups"] for c in g["completions"]]
    computed = [c for c in completions if c["ratio"] is not None]
    assert computed and all(len(c["ratio"]) == len(c["tokens"]) == len(c["clipped"]) for c in computed)
    assert all(set(c["clipped"]) <= {-1, 0, 1} for c in computed)
    if algorithm == "gspo":
        assert all(len(set(c["ratio"])) == 1 for c in computed)  # the sequence's ratio, at each of its tokens
    assert any(set(c["ratio"]) != {1.0} for c in computed)  # the second update's rows moved
