"""Input a hostile or careless user may give: each test failed on the code before its fix."""

import logging
import os
import pathlib
import sys

import pytest
import torch

from conftest import ROOT, SINGLE_PROCESS, load_experiment


class RunsCode:
    """Unpickling this object touches a file: what an attacker's training_state.pt would do, less harmlessly."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def test_resume_never_unpickles_code(experiment, tmp_path):
    """--resume read training_state.pt with weights_only=False: any code pickled into it ran."""
    folder = tmp_path / "step_000002"
    folder.mkdir()
    marker = tmp_path / "code_ran"
    torch.save({"step": 2, "payload": RunsCode(marker)}, folder / "training_state.pt")
    with pytest.raises(experiment.InputError, match="not loaded"):
        experiment.load_state_file(folder)
    assert not marker.exists()
    # a real state (plain data, tensors, RNG states) still loads
    import random
    torch.save({"step": 2, "data_position": [0, 8], "args": {"lr": 1e-4, "run_name": "r", "filter": []},
                "rng": {"python": random.getstate(), "torch": torch.get_rng_state()}}, folder / "training_state.pt")
    assert experiment.load_state_file(folder)["step"] == 2


def test_reward_fn_folder_does_not_shadow_installed_packages(experiment, tmp_path, monkeypatch):
    """--reward-fn put the working directory first on sys.path: a tqdm.py or peft.py there replaced the real one."""
    (tmp_path / "my_reward.py").write_text("def reward(completion, answer, metadata):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    function = experiment.load_reward_fn("my_reward:reward")
    assert function("x", "y", {}) == 1.0
    site = min(i for i, p in enumerate(sys.path) if "site-packages" in p)
    assert sys.path.index(str(tmp_path)) > site  # installed packages are found first


def test_search_corpus_skips_links_out_of_the_folder(tmp_path, caplog):
    """A symlink in --corpus-dir to a file outside it (/etc/passwd, say) was served to the model as a passage."""
    search = load_search()
    corpus, secrets = tmp_path / "corpus", tmp_path / "secrets"
    corpus.mkdir()
    secrets.mkdir()
    (corpus / "notes.md").write_text("The lighthouse of Orrin Quade was built in 1893 on the northern cape.\n")
    (secrets / "passwd.txt").write_text("root:x:0:0:root:/root:/bin/bash secret line that must never be read\n")
    os.symlink(secrets / "passwd.txt", corpus / "passwd.txt")
    os.symlink(secrets, corpus / "linked_folder")
    with caplog.at_level(logging.WARNING):
        passages = search.load_passages(corpus)
    assert [p.source for p in passages] == ["notes.md"]
    assert not any("root:x" in p.text for p in passages)
    assert "leads outside the corpus folder" in caplog.text


# ---- non-finite numbers: they ended in nan weights with exit 0 ----

@pytest.mark.parametrize("option", [["--lr", "inf"], ["--kl-weight", "nan"], ["--temperature", "inf"],
                                    ["--reward-weights", "correctness=nan"], ["--lora-dropout", "1.5"]],
                         ids=["lr-inf", "kl-nan", "temperature-inf", "weight-nan", "dropout"])
def test_non_finite_or_out_of_range_options_are_refused(experiment, option, capsys):
    from conftest import fails_with

    said = fails_with(experiment, ["--device", "cpu", *option], capsys)
    assert option[0] in said and ("finite" in said or "[0, 1)" in said)


def test_a_reward_that_is_inf_in_float32_stops_the_run(experiment, tmp_path, monkeypatch):
    """1e308 is a finite float64: it passed the custom reward's check and became inf in the float32 rewards."""
    (tmp_path / "huge_reward.py").write_text("def reward(completion, answer, metadata):\n    return 1e308\n")
    monkeypatch.chdir(tmp_path)
    score = experiment.Scorer(reward_fn="huge_reward:reward")
    with pytest.raises(experiment.RewardError, match="not a finite float32 number"):
        score(["<answer>1</answer>"], ["1"], [{}])




@pytest.mark.parametrize("name", SINGLE_PROCESS)
def test_a_nan_loss_stops_the_run_and_keeps_the_steps_done(name, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """From step 2 on the loss is nan: the run stops before updating with it, says so, and step 1 is saved with
    finite weights (before, every later step trained on nan and the run ended with exit 0)."""
    from conftest import fails_with, seven_reward, write_jsonl
    from safetensors.torch import load_file

    module = load_experiment(name)
    monkeypatch.setattr(module, "reward_terms", seven_reward)
    calls, real = [], module.grpo_loss

    def nan_from_step_two(*args, **kwargs):
        calls.append(1)
        loss, stats = real(*args, **kwargs)
        return (loss * float("nan") if len(calls) > 1 else loss), stats

    monkeypatch.setattr(module, "grpo_loss", nan_from_step_two)
    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"Say {i}", "answer": "7"} for i in range(8)])
    said = fails_with(module, ["--model-name", tiny_model_dir, "--device", "cpu", "--quantization", "none", "--dtype",
                               "float32", "--data-path", data, "--max-steps", "3", "--group-size", "2",
                               "--rollouts-per-step", "2", "--max-length", "4", "--eval-interval", "0",
                               "--log-dir", tmp_path / "runs", "--checkpoint-path", tmp_path / "out", "--run-name", "r",
                               *(["--algorithm", "grpo"] if name == "experiment_drgrpo" else [])], capsys)
    assert "step 2 diverged" in said and "gradient norm is nan" in said
    steps = sorted(p.name for p in (tmp_path / "out" / "r").iterdir())
    assert steps == ["step_000001"]
    weights = load_file(tmp_path / "out" / "r" / "step_000001" / "adapter_model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


# ---- the run folder: every checkpoint in it this run's own ----

def tiny_run(module, model_dir, tmp_path, *extra, steps=1):
    from conftest import seven_reward, write_jsonl

    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"Say {i}", "answer": "7"} for i in range(8)])
    if "multiturn_qa" in module.__file__:  # a corpus of its own, searched by BM25 (no encoder to load)
        (tmp_path / "corpus").mkdir(exist_ok=True)
        (tmp_path / "corpus" / "notes.md").write_text("The answer to every question here is 7, said the keeper.\n")
        extra = ("--corpus-dir", tmp_path / "corpus", "--retriever", "bm25", *extra)
    return ["--model-name", model_dir, "--device", "cpu", "--quantization", "none", "--dtype", "float32",
            "--data-path", data, "--max-steps", str(steps), "--group-size", "2", "--rollouts-per-step", "2",
            "--max-length", "4", "--eval-interval", "0", "--log-dir", tmp_path / "runs",
            "--checkpoint-path", tmp_path / "out", "--run-name", "r", *extra]


def files_of(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", SINGLE_PROCESS + ["experiment_accelerate"])
def test_a_second_run_under_the_same_name_is_refused(name, tiny_model_dir, tmp_path, capsys):
    """A second run under an existing --run-name without --resume kept running, skipped saving (step_N existed) and
    reported "checkpoint in step_N" for weights it had not written."""
    from conftest import fails_with

    module = load_experiment(name)
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path)])
    before = files_of(tmp_path / "out" / "r")
    said = fails_with(module, tiny_run(module, tiny_model_dir, tmp_path), capsys)
    assert "already holds the checkpoints" in said and "--resume" in said
    assert files_of(tmp_path / "out" / "r") == before


@pytest.mark.parametrize("name", SINGLE_PROCESS + ["experiment_accelerate"])
def test_resuming_an_older_step_moves_the_newer_ones_aside(name, tiny_model_dir, tmp_path, capsys):
    """Resuming from step 1 while step 2 exists: step 2 would have been skipped at save time and later taken as the
    newest checkpoint. It is moved aside, and the run's new step 2 is its own."""
    module = load_experiment(name)
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path, "--checkpoint-interval", "1", steps=2)])
    run_dir = tmp_path / "out" / "r"
    old_step_2 = files_of(run_dir / "step_000002")
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path, "--resume", run_dir / "step_000001",
                                          "--seed", "7", steps=2)])
    assert "moved the newer step_000002" in capsys.readouterr().err
    aside = list(run_dir.glob("superseded-*"))
    assert len(aside) == 1 and files_of(aside[0] / "step_000002") == old_step_2
    assert files_of(run_dir / "step_000002") != old_step_2  # written by the resumed run (another seed)


def test_a_run_folder_in_use_is_refused(tiny_model_dir, tmp_path, capsys):
    """Two runs under one name at once interleaved their events and checkpoints: the second is refused."""
    import fcntl

    from conftest import fails_with

    module = load_experiment("experiment_base")
    run_dir = tmp_path / "out" / "r"
    run_dir.mkdir(parents=True)
    held = os.open(run_dir, os.O_RDONLY)  # as another process would hold it
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        said = fails_with(module, tiny_run(module, tiny_model_dir, tmp_path), capsys)
    finally:
        os.close(held)
    assert "another run is writing to this run folder" in said


def test_unwritable_checkpoint_path_is_refused_before_the_model_loads(experiment, tmp_path, capsys):
    """--checkpoint-path naming a file: every step trained, then nothing was saved. Now it stops at once (the model
    named here does not exist: reaching it would be another error)."""
    from conftest import fails_with, write_jsonl

    not_a_folder = tmp_path / "passwd"
    not_a_folder.write_text("root:x:0:0\n")
    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": "Q", "answer": "1"}])
    said = fails_with(experiment, ["--model-name", tmp_path / "no-such-model", "--device", "cpu", "--data-path", data,
                                   "--eval-interval", "0", "--checkpoint-path", not_a_folder, "--run-name", "r",
                                   "--log-dir", tmp_path / "runs", "--rollouts-per-step", "1"], capsys)
    assert "--checkpoint-path: cannot write to" in said


@pytest.mark.parametrize("name", SINGLE_PROCESS)
def test_a_failed_save_keeps_the_earlier_checkpoints(name, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A full disk made torch.save fail with 'unexpected pos' and lost the step: now no half checkpoint is left, the
    earlier ones stay, and the message says what failed."""
    from conftest import fails_with

    module = load_experiment(name)
    saves, real = [], torch.save

    def full_disk_at_the_second_save(obj, path, *args, **kwargs):
        saves.append(path)
        if len(saves) == 2:
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 10880 vs 10772")
        return real(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk_at_the_second_save)
    said = fails_with(module, tiny_run(module, tiny_model_dir, tmp_path, "--checkpoint-interval", "1", steps=3), capsys)
    assert "saving" in said and "step_000002 failed" in said and "unexpected pos" in said
    assert sorted(p.name for p in (tmp_path / "out" / "r").iterdir()) == ["step_000001"]


# ---- parsing, bounded; messages instead of tracebacks ----

def test_huge_numbers_are_no_answer(task_experiment):
    """5,000 digits raised ValueError (Python's int-string limit) inside the reward, with no checkpoint saved."""
    import time

    started = time.perf_counter()
    assert task_experiment.parse_number("1" * 5000) is None
    assert task_experiment.correctness("<answer>" + "9" * 100_000 + "</answer>", "7") == 0.0
    assert task_experiment.parse_number("it is 42") == 42
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("line, says", [("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                                        ('{"question": "What is \\ud800 + 1?", "answer": "2"}', "lone surrogate")],
                         ids=["nested", "surrogate"])
def test_data_lines_that_no_model_can_take_name_file_and_line(experiment, tmp_path, line, says):
    """A line nested 100k deep raised RecursionError; a lone surrogate crashed at the first rollout, after the model
    had loaded."""
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"question": "Q", "answer": "1"}\n' + line + "\n")
    with pytest.raises(experiment.InputError, match=rf"tasks.jsonl:2: .*{says}"):
        experiment.load_tasks(data)


def test_a_missing_local_model_folder_is_named(experiment, tmp_path):
    """It was reported as "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"."""
    with pytest.raises(experiment.InputError, match="no such file or folder"):
        experiment.resolve_model_path(str(tmp_path / "my-model"))


def test_accelerate_train_batch_size_zero_is_a_message(capsys):
    """experiment_accelerate divided by zero at --train-batch-size 0."""
    from conftest import fails_with

    said = fails_with(load_experiment("experiment_accelerate"), ["--device", "cpu", "--train-batch-size", "0"], capsys)
    assert "--train-batch-size: must be an integer in [1, inf), got 0" in said


# ---- the reward service client: every failure a message, every request a deadline ----

def raw_server(reply):
    """A one-connection-at-a-time server on loopback that reads a request and runs reply(connection); returns the
    URL and a function that stops it. At most 20 connections, so it always ends."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve():
        for _ in range(20):
            while not stop.is_set():
                try:
                    connection, _ = listener.accept()
                    break
                except OSError:
                    continue
            else:
                return
            with connection:
                connection.settimeout(5)
                try:
                    connection.recv(65536)
                    reply(connection, stop)
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()

    def close():
        stop.set()
        listener.close()

    return f"http://127.0.0.1:{listener.getsockname()[1]}/score", close


def drip(connection, stop):  # a valid answer, one byte every 0.3 s
    import time

    for byte in b'HTTP/1.1 200 OK\r\nContent-Length: 18\r\n\r\n{"rewards": [1.0]}':
        if stop.is_set():
            return
        connection.sendall(bytes([byte]))
        time.sleep(0.3)


def cut_short(connection, stop):  # promises 500 bytes, sends 10: IncompleteRead
    connection.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{"rewards"')


def not_http(connection, stop):  # BadStatusLine
    connection.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")


@pytest.mark.parametrize("reply, says", [(drip, "TimeoutError"), (cut_short, "IncompleteRead"), (not_http, "BadStatusLine")],
                         ids=["one-byte-a-second", "incomplete-read", "bad-status-line"])
def test_a_broken_reward_service_is_a_reward_error(experiment, reply, says):
    """IncompleteRead and BadStatusLine gave tracebacks (skipping the save-then-report path); a server sending a
    byte at a time never timed out, since --reward-timeout bounded each socket read only."""
    import time

    url, close = raw_server(reply)
    try:
        started = time.perf_counter()
        with pytest.raises(experiment.RewardError, match=says):
            experiment.remote_rewards(url, ["c"], ["a"], [{}], timeout=1.0, retries=2)
        assert time.perf_counter() - started < 6  # two tries of at most a second each, and a second's back-off
    finally:
        close()


def test_a_reward_url_that_is_no_url_is_refused(experiment, capsys):
    from conftest import fails_with

    said = fails_with(experiment, ["--device", "cpu", "--reward-url", "not a url"], capsys)
    assert "argument --reward-url: expected http://HOST[:PORT]/PATH" in said and "'not a url'" in said


# ---- a --reward-fn that hangs or exits ----

@pytest.mark.parametrize("body, says", [("import time\n    time.sleep(30)\n    return 1.0", "TimeoutError: no result within 1.0 s"),
                                        ("import sys\n    sys.exit('bye')", "SystemExit: bye")],
                         ids=["never-returns", "sys-exit"])
@pytest.mark.parametrize("name", SINGLE_PROCESS)
def test_a_reward_fn_that_hangs_or_exits_saves_the_steps_done(name, body, says, tiny_model_dir, tmp_path, monkeypatch,
                                                              capsys):
    """A --reward-fn that never returned hung the run; one that called sys.exit left no checkpoint. From its second
    step on this one does either: step 1 is saved, and the message names the failure."""
    from conftest import fails_with

    reward = f"bad_reward_{tmp_path.name}"  # a module name of this test alone: sys.modules keeps the last one
    (tmp_path / f"{reward}.py").write_text("CALLS = []\n\ndef reward(completion, answer, metadata):\n"
                                           "    CALLS.append(1)\n    if len(CALLS) <= 4:\n        return 0.5\n"
                                           f"    {body}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_reward_fn appends the working directory
    module = load_experiment(name)
    said = fails_with(module, tiny_run(module, tiny_model_dir, tmp_path, "--reward-fn", f"{reward}:reward",
                                       "--reward-fn-timeout", "1", steps=3), capsys)
    assert says in said and "saving step 1" in said
    assert sorted(p.name for p in (tmp_path / "out" / "r").iterdir()) == ["step_000001"]


# ---- the QA search tool ----

def load_search():
    sys.path.insert(0, str(ROOT / "experiment_multiturn_qa"))
    try:
        import search
    finally:
        sys.path.remove(str(ROOT / "experiment_multiturn_qa"))
    return search


def test_a_long_paragraph_without_a_sentence_end_is_split_in_linear_time():
    """split_long copied the rest of the sentence at every cut: an 8 MiB paragraph took 5.7 s."""
    import time

    search = load_search()
    started = time.perf_counter()
    pieces = search.split_long("word " * (8 * 2**20 // 5))
    assert time.perf_counter() - started < 2.0  # about 0.1 s here
    assert len(pieces) > 10_000 and max(map(len, pieces)) <= search.MAX_CHARS


def test_a_file_name_that_is_not_utf8_is_skipped_and_a_damaged_cache_rebuilt(tmp_path, caplog):
    """A non-UTF-8 file name crashed the dense index build (and left a temporary file); a damaged index cache gave a
    traceback instead of a rebuild."""
    search = load_search()
    corpus, cache = tmp_path / "corpus", tmp_path / "cache"
    corpus.mkdir()
    (corpus / "notes.md").write_text("The lighthouse of Orrin Quade was built in 1893 on the northern cape.\n")
    (corpus / os.fsdecode(b"caf\xe9.md")).write_text("A file named in Latin-1 bytes, not UTF-8, says 1901.\n")
    with caplog.at_level(logging.WARNING):
        index = search.SearchIndex(corpus, "dense", cache_dir=cache)
    assert [p.source for p in index.passages] == ["notes.md"] and "not UTF-8" in caplog.text
    assert not list(cache.rglob("*.tmp"))
    for damaged in cache.rglob("index.faiss"):
        damaged.write_bytes(b"\x00" * 10)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = search.SearchIndex(corpus, "dense", cache_dir=cache)
    assert "damaged" in caplog.text and not again.loaded_from_cache
    assert again.search("Who built the lighthouse?", top_k=1)[0].source == "notes.md"
    assert search.SearchIndex(corpus, "dense", cache_dir=cache).loaded_from_cache  # rebuilt and cached again


# ---- damaged or mismatched checkpoints ----

@pytest.fixture
def two_steps(tiny_model_dir, tmp_path):
    """experiment_base trained 2 steps, a checkpoint after each: (module, run folder)."""
    module = load_experiment("experiment_base")
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path, "--checkpoint-interval", "1", steps=2)])
    return module, tmp_path / "out" / "r"


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(two_steps, tiny_model_dir, tmp_path, capsys):
    """A training_state.pt cut short gave a traceback; now the run resumes from the newest complete step, says so,
    and the damaged one is moved aside."""
    module, run_dir = two_steps
    state = run_dir / "step_000002" / "training_state.pt"
    state.write_bytes(state.read_bytes()[:1000])
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path, "--resume", run_dir, steps=3)])
    said = capsys.readouterr()
    assert "step_000002 is damaged (training_state.pt is damaged" in said.err
    assert "resumed from" in said.out and "at step 1" in said.out
    assert sorted(p.name for p in run_dir.glob("step_*")) == ["step_000001", "step_000003"]
    assert [p.name for p in run_dir.glob("superseded-*/step_*")] == ["step_000002"]  # the damaged one, moved aside


@pytest.mark.parametrize("options, says", [
    (["--lora-r", "4"], "--lora-r 16 there, 4 here"),
    (["--no-lora"], "--lora True there, False here"),
], ids=["lora-r", "no-lora"])
def test_resuming_with_other_weights_names_what_differs(two_steps, tiny_model_dir, tmp_path, capsys, options, says):
    """Another --lora-r, or --no-lora against LoRA, gave a traceback deep inside the state-dict loading."""
    from conftest import fails_with

    module, run_dir = two_steps
    said = fails_with(module, tiny_run(module, tiny_model_dir, tmp_path, "--resume", run_dir, *options, steps=3), capsys)
    assert says in said


def test_a_checkpoint_of_another_experiment_is_refused(two_steps, tiny_model_dir, tmp_path, capsys):
    """experiment_drgrpo took experiment_base's checkpoint silently (and experiment_accelerate failed with KeyError)."""
    from conftest import fails_with

    _, run_dir = two_steps
    for name in ("experiment_drgrpo", "experiment_accelerate"):
        module = load_experiment(name)
        said = fails_with(module, tiny_run(module, tiny_model_dir, tmp_path, "--resume", run_dir / "step_000002",
                                           "--run-name", "other", steps=3), capsys)
        assert "a checkpoint of experiment_base" in said


def test_an_empty_adapter_file_is_named(two_steps, tiny_model_dir, tmp_path, capsys):
    from conftest import fails_with

    module, run_dir = two_steps
    (run_dir / "step_000002" / "adapter_model.safetensors").write_bytes(b"")
    said = fails_with(module, tiny_run(module, tiny_model_dir, tmp_path, "--resume", run_dir / "step_000002", steps=3),
                      capsys)
    assert "weights (*.safetensors) are missing or empty" in said


# ---- the data scripts ----

@pytest.mark.parametrize("script", ["make_math_tasks.py", "make_knights_knaves.py", "make_tool_tasks.py",
                                    "make_simple_tasks.py", "make_qa_corpus.py", "prepare_gsm8k.py"])
def test_generators_name_a_file_given_as_out_dir(script, tmp_path):
    """--out-dir naming a file gave a FileExistsError traceback."""
    from conftest import run_script

    not_a_folder = tmp_path / "taken"
    not_a_folder.write_text("")
    result = run_script(ROOT / "data" / script, "--out-dir", not_a_folder)
    assert result.returncode == 2 and "a file, not a folder" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("sizes, says", [(["--people", "2", "--orgs", "1", "--towns", "1", "--regions", "1"], "too short"),
                                         (["--people", "5", "--orgs", "2", "--towns", "2", "--regions", "1"], "holds 79")],
                         ids=["tiny-world", "too-few-questions"])
def test_qa_corpus_too_small_is_a_message(sizes, says, tmp_path):
    """A tiny world raised a bare AssertionError; a small one wrote 0 of the 3,000 training questions asked."""
    from conftest import run_script

    result = run_script(ROOT / "data" / "make_qa_corpus.py", *sizes, "--out-dir", tmp_path / "qa")
    assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("name", SINGLE_PROCESS + ["experiment_accelerate"])
def test_a_prompt_longer_than_the_context_is_refused(name, tiny_model_dir, tmp_path, capsys):
    """A question whose prompt, with the budget, passes the model's context (2,048 for the tiny model) went in
    without a word."""
    from conftest import fails_with, write_jsonl

    module = load_experiment(name)
    long_data = write_jsonl(tmp_path / "long.jsonl", [{"question": "Q", "answer": "7"},
                                                      {"question": "Why " * 600 + "?", "answer": "7"}])
    said = fails_with(module, tiny_run(module, tiny_model_dir, tmp_path, "--data-path", long_data), capsys)
    assert "long.jsonl: the question 'Why Why" in said and "passes the model's context of 2048" in said
