"""Nothing lost, round five (issue 75), items 1, 4, 5 and 15: the rollout log (docs/rollout-log.md) across the starts
of a run. Each test failed on the code before its fix; each start runs train.py's main() on the tiny model in the
test's process, one after another, as a user's starts follow one another (the files they leave are what is tested;
a fresh interpreter would spend about 10 s importing torch, transformers and peft at each of the 12 starts)."""

import json

import pytest
import torch

from conftest import run_main, write_jsonl
from tiny_grpo.view import write_page


@pytest.fixture
def tasks(tmp_path):
    return write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)])


def train(model_dir, tasks, tmp_path, *extra):
    """A start of run r of the tiny model (no evaluation), its folders under tmp_path, from there; it must succeed."""
    argv = ["--model-name", model_dir, "--device", "cpu", "--dtype", "float32", "--data-path", tasks, "--eval-interval",
            "0", "--group-size", "2", "--rollouts-per-step", "2", "--max-length", "4", "--run-name", "r", "--log-dir",
            tmp_path / "runs", "--checkpoint-path", tmp_path / "out", *extra]
    run_main("experiment_base", argv, tmp_path)
    return tmp_path / "runs" / "r"


def records(log):
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]


def starts_and_steps(log):
    """The log as (kind, the run record's temperature and start_step, or the step's number) pairs."""
    return [("run", r["temperature"], r.get("start_step")) if r["kind"] == "run" else (r["kind"], r["step"])
            for r in records(log)]


# ---- item 1: a left-over symbolic link leads the log's writes out of the run folder ----

def test_item_1_symbolic_links_left_in_the_log_folder_lead_no_write_out_of_it(tiny_model_dir, tasks, tmp_path):
    """A rollouts.jsonl.partial linked to a file outside: the run wrote its log through it, renamed the link into
    place and appended every step there. A dangling .run linked outside: claim_log_folder created its target. Now
    both are written through new files of their own in the folder, renamed over the names."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "log.jsonl").write_text("not the run's\n")
    folder = tmp_path / "runs" / "r"
    folder.mkdir(parents=True)
    (folder / "rollouts.jsonl.partial").symlink_to(outside / "log.jsonl")
    (folder / ".run").symlink_to(outside / "owner")  # dangling: nothing there yet
    run = train(tiny_model_dir, tasks, tmp_path, "--max-steps", "2")
    assert (outside / "log.jsonl").read_text() == "not the run's\n"
    assert sorted(p.name for p in outside.iterdir()) == ["log.jsonl"]
    log = run / "rollouts.jsonl"
    assert not log.is_symlink() and [r["kind"] for r in records(log)] == ["run", "step", "step"]
    assert not (run / ".run").is_symlink() and (run / ".run").read_text() == str((tmp_path / "out" / "r").resolve())


# ---- item 4: a fresh start under the name of a start that saved no checkpoint ----

def test_item_4_a_fresh_start_sets_the_dead_starts_log_and_page_aside(tiny_model_dir, tasks, tmp_path):
    """A start killed before its first checkpoint (here: its checkpoints removed) left its events, log and page.
    The fresh start under its name moved the events aside but kept the dead start's run record (its temperature)
    and deleted its steps. Now the log and the page go aside with the events, whole; the fresh start writes its own
    run record."""
    run = train(tiny_model_dir, tasks, tmp_path, "--max-steps", "2", "--temperature", "0.5")
    for step in (tmp_path / "out" / "r").glob("step_*"):
        for file in step.iterdir():
            file.unlink()
        step.rmdir()
    dead = (run / "rollouts.jsonl").read_text(encoding="utf-8")
    train(tiny_model_dir, tasks, tmp_path, "--max-steps", "1", "--temperature", "0.9")
    assert starts_and_steps(run / "rollouts.jsonl") == [("run", 0.9, 0), ("step", 1)]
    [aside] = run.glob("superseded-*")
    assert (aside / "rollouts.jsonl").read_text(encoding="utf-8") == dead  # the dead start's steps, whole
    assert (aside / "rollouts.html").is_file() and list(aside.glob("events.out.tfevents.*"))


# ---- item 5: the purge of a resumed run's log ----

def test_item_5_a_resume_with_the_log_off_still_drops_the_crashed_steps_from_the_log_and_page(tiny_model_dir, tasks,
                                                                                               tmp_path):
    """--resume with --log-rollouts 0 skipped the purge: the log and the page kept the steps a crashed start wrote
    after its checkpoint. Now the log is purged whatever the interval, and the page drawn again from it."""
    run = train(tiny_model_dir, tasks, tmp_path, "--max-steps", "2")
    crashed = {"kind": "step", "step": 3, "scalars": {}, "groups": [{"index": 0, "question": "CRASHEDBRANCH",
                                                                      "prompt": "p", "answer": "a", "completions": []}]}
    with open(run / "rollouts.jsonl", "a", encoding="utf-8") as log:
        log.write(json.dumps(crashed) + "\n")
    write_page(run)
    assert "CRASHEDBRANCH" in (run / "rollouts.html").read_text(encoding="utf-8")
    train(tiny_model_dir, tasks, tmp_path, "--max-steps", "3", "--log-rollouts", "0", "--resume", tmp_path / "out" / "r")
    assert [r.get("step") for r in records(run / "rollouts.jsonl")] == [None, 1, 2]
    assert "CRASHEDBRANCH" not in (run / "rollouts.html").read_text(encoding="utf-8")


def test_item_5_resuming_a_set_aside_checkpoint_drops_the_newer_branchs_steps(tiny_model_dir, tasks, tmp_path):
    """A (steps 1-4, checkpoints 2 and 4); B resumed A's step 2 (A's step 4 set aside) and logged steps 3-4; C
    resumes A's step 4 from where it was set aside. The purge went by step number: it kept B's run record and steps
    3-4 as if they were A's. Now it keeps A's branch alone (its steps 3-4 went with B's purge), then C's record."""
    run = train(tiny_model_dir, tasks, tmp_path, "--max-steps", "4", "--checkpoint-interval", "2", "--temperature", "0.5")
    out = tmp_path / "out" / "r"
    train(tiny_model_dir, tasks, tmp_path, "--max-steps", "4", "--temperature", "0.6", "--resume", out / "step_000002")
    assert starts_and_steps(run / "rollouts.jsonl") == [("run", 0.5, 0), ("step", 1), ("step", 2), ("run", 0.6, 2),
                                                        ("step", 3), ("step", 4)]
    [aside] = out.glob("superseded-*")
    train(tiny_model_dir, tasks, tmp_path, "--max-steps", "5", "--temperature", "0.7", "--resume", aside / "step_000004")
    assert starts_and_steps(run / "rollouts.jsonl") == [("run", 0.5, 0), ("step", 1), ("step", 2), ("run", 0.7, 4),
                                                        ("step", 5)]


def test_item_5_a_checkpoint_from_before_the_change_resumes_with_the_purge_by_step(tiny_model_dir, tasks, tmp_path):
    """A checkpoint whose training state records no branch of the log (written before it did) still resumes: the
    purge then goes by step number, as before."""
    run = train(tiny_model_dir, tasks, tmp_path, "--max-steps", "2")
    checkpoint = tmp_path / "out" / "r" / "step_000002"
    state = torch.load(checkpoint / "training_state.pt", weights_only=True)
    state.pop("log_starts", None)
    torch.save(state, checkpoint / "training_state.pt")
    with open(run / "rollouts.jsonl", "a", encoding="utf-8") as log:
        log.write(json.dumps({"kind": "step", "step": 3, "scalars": {}, "groups": []}) + "\n")
    train(tiny_model_dir, tasks, tmp_path, "--max-steps", "3", "--resume", checkpoint)
    assert [(r["kind"], r.get("step")) for r in records(run / "rollouts.jsonl")] == [
        ("run", None), ("step", 1), ("step", 2), ("run", None), ("step", 3)]


# ---- item 15: a resume that changes the sampling or the loss ----

def test_item_15_each_start_has_its_own_run_record_with_its_options_and_first_step(tiny_model_dir, tasks, tmp_path):
    """A resume with another --temperature, --kl-weight, --clip-eps and reward weights logged its steps under the
    first start's run record (the page's header showed those). Now each start appends its own, with start_step."""
    run = train(tiny_model_dir, tasks, tmp_path, "--max-steps", "2", "--temperature", "0.5")
    train(tiny_model_dir, tasks, tmp_path, "--max-steps", "3", "--temperature", "0.9", "--kl-weight", "0.05",
          "--clip-eps", "0.3", "--reward-weights", "correctness=1,format=0.5", "--resume", tmp_path / "out" / "r")
    first, one, two, second, three = records(run / "rollouts.jsonl")
    assert [first["kind"], one["step"], two["step"], second["kind"], three["step"]] == ["run", 1, 2, "run", 3]
    assert (first["temperature"], first["start_step"], second["start_step"]) == (0.5, 0, 2)
    assert (second["temperature"], second["kl_weight"], second["clip_eps"]) == (0.9, 0.05, 0.3)
    assert second["reward_weights"]["format"] == 0.5 and first["reward_weights"]["format"] != 0.5
