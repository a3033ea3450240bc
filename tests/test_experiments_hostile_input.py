"""Input a hostile or careless user may give: each test failed on the code before its fix."""

import logging
import os
import pathlib
import re
import sys

import pytest
import torch

from conftest import EXPERIMENTS, ROOT, SINGLE_PROCESS, hang_guard, load_experiment
import tiny_grpo.checkpoints
import tiny_grpo.errors
import tiny_grpo.urls
import tiny_grpo.rewards
import tiny_grpo.stopping


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
        tiny_grpo.checkpoints.load_state_file(folder)
    assert not marker.exists()
    # a real state (plain data, tensors, RNG states) still loads
    import random
    torch.save({"step": 2, "data_position": [0, 8], "args": {"lr": 1e-4, "run_name": "r", "filter": []},
                "rng": {"python": random.getstate(), "torch": torch.get_rng_state()}}, folder / "training_state.pt")
    assert tiny_grpo.checkpoints.load_state_file(folder)["step"] == 2


def test_reward_fn_folder_does_not_shadow_installed_packages(experiment, tmp_path, monkeypatch):
    """--reward-fn put the working directory first on sys.path: a tqdm.py or peft.py there replaced the real one."""
    (tmp_path / "my_reward.py").write_text("def reward(completion, answer, metadata):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    function = tiny_grpo.rewards.load_reward_fn("my_reward:reward")
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
    with pytest.raises(tiny_grpo.errors.RewardError, match="must be a finite float32 number"):
        score(["<answer>1</answer>"], ["1"], [{}])


def test_rewards_whose_spread_overflows_are_refused(experiment):
    """Rewards of +-3e38 are finite float32 numbers, but their group's standard deviation overflows to inf, and
    GRPO's advantages were silently 0. Every Scorer checks its rewards with check_finite."""
    rewards = torch.tensor([3e38, -3e38])
    assert torch.isinf(rewards.std())  # what GRPO's advantages would have divided by
    with pytest.raises(tiny_grpo.errors.RewardError, match="within \\+-1e\\+18"):
        experiment.check_finite(rewards, {"custom": rewards}, ["<answer>1</answer>", "<answer>2</answer>"], ["1", "1"])




@pytest.mark.parametrize("name", SINGLE_PROCESS)
def test_a_nan_loss_stops_the_run_and_keeps_the_steps_done(name, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """From step 2 on the loss is nan: the run stops before updating with it, says so, and step 1 is saved with
    finite weights (before, every later step trained on nan and the run ended with exit 0)."""
    from conftest import earlier_cpu_defaults, fails_with, seven_reward, write_jsonl
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
                               *earlier_cpu_defaults(module), *(["--algorithm", "grpo"] if name == "experiment_drgrpo" else [])],
                      capsys)
    assert "step 2 diverged" in said and "gradient norm is nan" in said
    steps = sorted(p.name for p in (tmp_path / "out" / "r").iterdir())
    assert steps == ["step_000001"]
    weights = load_file(tmp_path / "out" / "r" / "step_000001" / "adapter_model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


# ---- the run folder: every checkpoint in it this run's own ----

def tiny_run(module, model_dir, tmp_path, *extra, steps=1):
    from conftest import earlier_cpu_defaults, write_jsonl

    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"Say {i}", "answer": "7"} for i in range(8)])
    if "multiturn_qa" in module.__file__:  # a corpus of its own, searched by BM25 (no encoder to load)
        (tmp_path / "corpus").mkdir(exist_ok=True)
        (tmp_path / "corpus" / "notes.md").write_text("The answer to every question here is 7, said the keeper.\n")
        extra = ("--corpus-dir", tmp_path / "corpus", "--retriever", "bm25", *extra)
    return ["--model-name", model_dir, "--device", "cpu", "--quantization", "none", "--dtype", "float32",
            "--data-path", data, "--max-steps", str(steps), "--group-size", "2", "--rollouts-per-step", "2",
            "--max-length", "4", "--eval-interval", "0", "--log-dir", tmp_path / "runs",
            "--checkpoint-path", tmp_path / "out", "--run-name", "r", *earlier_cpu_defaults(module), *extra]


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
                                          "--lr", "5e-2", steps=2)])
    assert "moved the newer step_000002" in capsys.readouterr().err
    aside = list(run_dir.glob("superseded-*"))
    assert len(aside) == 1 and files_of(aside[0] / "step_000002") == old_step_2
    assert files_of(run_dir / "step_000002") != old_step_2  # written by the resumed run (another learning rate)


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
    assert "another run is writing to this folder now" in said


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


def test_a_decimal_over_a_number_is_a_number_not_a_crash(task_experiment):
    """A completion answering '1.5/2' raised ValueError inside the reward (Fraction takes no decimal numerator over a
    denominator): one such sample stopped the run. It is 3/4 now; a/0 is still no number, and the number before it
    counts."""
    assert task_experiment.parse_number("1.5/2") == task_experiment.parse_number("0.75") == 0.75
    assert task_experiment.correctness("<think> x </think> <answer> 1.5/2 </answer>", "3/4") == 1.0
    assert task_experiment.parse_number("98.6/0") is None and task_experiment.parse_number("7 then 2.5/00") == 7
    assert task_experiment.parse_number("-1.5/3") == -0.5


@pytest.mark.parametrize("line, says", [("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                                        ('{"question": "What is \\ud800 + 1?", "answer": "2"}', "lone surrogate"),
                                        ('{"question": "Q", "answer": "1", "id": ' + "7" * 5000 + "}", "4300 digits"),
                                        ('{"question": "Q", "answer": NaN}', "nan, which no completion can match"),
                                        ('{"question": "Q", "answer": Infinity}', "inf, which no completion can match"),
                                        ('{"question": "Q", "answer": 1e400}', "inf, which no completion can match"),
                                        ('{"question": "Q", "answer": " "}', "field 'answer' is empty"),
                                        ('{"question": "", "answer": "1"}', "field 'question' is empty")],
                         ids=["nested", "surrogate", "5000-digits", "nan", "infinity", "1e400", "blank-answer", "empty-question"])
def test_data_lines_that_no_model_can_take_name_file_and_line(experiment, tmp_path, line, says):
    """A line nested 100k deep raised RecursionError; a lone surrogate crashed at the first rollout, after the model
    had loaded; a number of 5,000 digits raised a ValueError traceback; NaN, Infinity, 1e400 and empty answers or
    questions were taken, though no completion can ever match them."""
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"question": "Q", "answer": "1"}\n' + line + "\n")
    with pytest.raises(experiment.InputError, match=rf"tasks.jsonl:2: .*{says}"):
        experiment.load_tasks(data)


def test_data_with_a_bom_or_a_line_separator_inside_a_string_is_read(experiment, tmp_path):
    """A UTF-8 byte-order mark was refused as invalid JSON on line 1, and a raw U+2028 inside a JSON string (legal
    JSON) split its line in two ("Unterminated string")."""
    data = tmp_path / "tasks.jsonl"
    data.write_text('\ufeff{"question": "Q1", "answer": "1"}\n{"question": "Two\u2028lines", "answer": "2"}\n', encoding="utf-8")
    tasks = experiment.load_tasks(data)
    assert [(t["question"], t["answer"]) for t in tasks] == [("Q1", "1"), ("Two\u2028lines", "2")]


@pytest.mark.parametrize("kind", ["fifo", "device", "empty folder"])
def test_a_data_path_that_is_not_a_regular_file_is_refused(experiment, tmp_path, kind):
    """A FIFO as --data-path hung the run; /dev/zero read until memory ran out. A folder is a dataset folder now:
    one without data files is refused by datasets' reason, in one line."""
    path = {"fifo": tmp_path / "pipe", "device": pathlib.Path("/dev/zero"), "empty folder": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    said = "doesn't contain any data files" if kind == "empty folder" else "not a regular file"
    with pytest.raises(experiment.InputError, match=said):
        experiment.load_tasks(path)


@pytest.mark.parametrize("option", [["--seed", "99999999999999999999"], ["--temperature", "1e-300"],
                                    ["--seed", "-1"], ["--temperature", "1e300"]],
                         ids=["seed-huge", "temperature-tiny", "seed-negative", "temperature-huge"])
def test_options_the_code_cannot_run_are_refused(experiment, option, capsys):
    """Inside their old ranges, these crashed: a seed past 2^64 in torch.manual_seed, a temperature of 1e-300 in
    the sampler (logits / T overflow)."""
    from conftest import fails_with

    said = fails_with(experiment, ["--device", "cpu", *option], capsys)
    assert option[0] in said and ("[0, 4294967295]" in said or "[0.001, 1000]" in said)


def test_a_nucleus_smaller_than_float32_keeps_the_most_likely_token(experiment):
    """--top-p 1e-300 is 0 in float32: the nucleus kept no token and the sampler raised IndexError."""
    torch.manual_seed(0)
    logits = torch.randn(4, 1000) * 5
    assert torch.equal(experiment.sample_token(logits, 1.0, 1e-300), logits.argmax(-1))


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
                    read_request(connection)
                    reply(connection, stop)
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()

    def close():
        stop.set()
        listener.close()

    return f"http://127.0.0.1:{listener.getsockname()[1]}/score", close


def read_request(connection):
    """Read the whole request, headers and body: a socket closed with unread bytes sends a reset, and the client
    would then see ConnectionResetError, not the reply under test (one recv can end after the headers)."""
    data = b""
    while b"\r\n\r\n" not in data and (chunk := connection.recv(65536)):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    while length and len(body) < int(length[1]) and (chunk := connection.recv(65536)):
        body += chunk


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
        with pytest.raises(tiny_grpo.errors.RewardError, match=says):
            tiny_grpo.rewards.remote_rewards(url, ["c"], ["a"], [{}], timeout=1.0, retries=2)
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
                                    "make_simple_tasks.py", "make_qa_corpus.py"])
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


# ---- round two: a second Ctrl-C, a wild reward reply, a run name that escapes its folder ----

@pytest.fixture
def signal_handlers():
    """The test's process gets the run's Ctrl-C handling; the handlers pytest had are put back after."""
    import signal

    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


class Closes:
    def close(self):
        pass


def test_a_second_ctrl_c_neither_raises_nor_cuts_the_save_short(signal_handlers, tmp_path):
    """Ctrl-C pressed again while an interrupted run saved raised KeyboardInterrupt inside the save: a traceback,
    and only step_N.partial left. Now the first signal stops the run, later ones are let pass, and the save completes.
    (experiment_accelerate_ddp's handler only takes note, all processes stopping together: it never raised.)"""
    import signal

    module = tiny_grpo.stopping  # every experiment's but experiment_accelerate_ddp's
    interrupts = module.Interrupts()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    for _ in range(3):  # the run is stopping: these must not raise on the way to stopped()
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
    assert interrupts.stopping

    def save():  # signals keep coming while the checkpoint is written
        for _ in range(20):
            os.kill(os.getpid(), signal.SIGINT)
        (tmp_path / "step_000003").mkdir()

    with pytest.raises(SystemExit) as stop:
        module.stopped(KeyboardInterrupt("SIGINT"), 3, tmp_path, save, Closes(), Closes(), interrupts)
    assert stop.value.code == 130 and (tmp_path / "step_000003").is_dir()


def test_a_storm_of_ctrl_c_keeps_the_steps_done(tiny_model_dir, tmp_path):
    """The hostile try, for real: SIGINT every 5 ms from the second step on, for two seconds. It was a traceback
    and every step since the last checkpoint lost; now one checkpoint of the steps done, complete, and exit 130."""
    import signal
    import subprocess
    import time

    from conftest import hang_guard, tensorboard_scalars

    argv = tiny_run(load_experiment("experiment_base"), tiny_model_dir, tmp_path, "--checkpoint-interval", "0", steps=100000)
    process = subprocess.Popen([sys.executable, str(ROOT / "experiment_base" / "train.py"), *map(str, argv)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(tensorboard_scalars(tmp_path / "runs").get("train/loss", [])) < 2:
        time.sleep(0.2)
    storm_ends = time.time() + 2
    while time.time() < storm_ends and process.poll() is None:
        process.send_signal(signal.SIGINT)
        time.sleep(0.005)
    with hang_guard("the interrupted run", 120):
        _, stderr = process.communicate(timeout=120)
    # 130, or killed by a SIGINT of the storm that came after the save, once Python's exit had put back the default
    # handler: either way stopped by Ctrl-C (a shell shows both as 130), with the steps done saved
    assert process.returncode in (130, -signal.SIGINT) and "Traceback" not in stderr, stderr[-3000:]
    steps = list((tmp_path / "out" / "r").iterdir())
    assert len(steps) == 1 and re_step(steps[0].name) >= 2 and (steps[0] / "training_state.pt").is_file()


def re_step(name):
    import re

    match = re.fullmatch(r"step_(\d+)", name)
    assert match, name  # no step_N.partial
    return int(match[1])


def answer(connection, status, body, headers=b""):
    """Send a whole HTTP answer, then read what is left of the request before closing: closing a socket with unread
    data sends a reset, which can cut a large answer short on the client's side (the raw server reads the request
    with one recv, and urllib sends the headers and the body apart)."""
    import socket

    connection.sendall(b"HTTP/1.1 %s\r\n%sContent-Length: %d\r\n\r\n%s" % (status, headers, len(body), body))
    connection.shutdown(socket.SHUT_WR)
    try:
        while connection.recv(65536):
            pass
    except OSError:
        pass


def huge_number(connection, stop):  # an integer too large for a float
    answer(connection, b"200 OK", b'{"rewards": [1' + b"0" * 400 + b"]}")


def nested_deep(connection, stop):  # JSON nested 100,000 deep: a RecursionError in the parser
    answer(connection, b"200 OK", b'{"rewards": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")


def redirect(connection, stop):  # urllib would follow it with a GET, dropping the body
    answer(connection, b"302 Found", b"", b"Location: http://user:hunter2@127.0.0.1:9/elsewhere\r\n")


def server_error(connection, stop):  # the service's own error, which the message must carry
    answer(connection, b"500 Internal Server Error", b"KeyError: 'answers' in score()")


def too_large(connection, stop):  # more than the client reads (MAX_REPLY_BYTES is set to 1,000 below)
    answer(connection, b"200 OK", b'{"rewards": [' + b"1.0, " * 1000 + b"1.0]}")


@pytest.mark.parametrize("reply, says", [(huge_number, "expected 1 finite numbers"), (nested_deep, "RecursionError"),
                                         (redirect, "HTTP 302, a redirect to http://***@127.0.0.1:9/elsewhere"),
                                         (server_error, "HTTP 500: KeyError: 'answers' in score()"),
                                         (too_large, "larger than 1,000 bytes")],
                         ids=["int-too-large-for-a-float", "nested-100000-deep", "redirect", "server-error", "too-large"])
def test_a_wild_reward_reply_is_a_reward_error(experiment, reply, says, monkeypatch):
    """An integer too large for a float, or JSON nested 100,000 deep, gave an OverflowError or RecursionError
    traceback (no save); a 302 turned the POST into a GET; a 500 said "is the service running?" without the service's
    own error; a reply of any size was read whole. Each is now a RewardError, which saves the steps done."""
    if reply is too_large:
        monkeypatch.setattr(tiny_grpo.rewards, "MAX_REPLY_BYTES", 1000)
    url, close = raw_server(reply)
    try:
        with pytest.raises(tiny_grpo.errors.RewardError) as error:
            tiny_grpo.rewards.remote_rewards(url, ["c"], ["a"], [{}], timeout=5.0, retries=1)
        assert says in str(error.value) and "hunter2" not in str(error.value)
    finally:
        close()


def test_credentials_in_the_reward_url_are_never_printed_nor_stored(experiment, capsys):
    """A --reward-url with user:password@ echoed the password in its error and was stored whole in every
    checkpoint's options and in W&B's config."""
    from conftest import fails_with

    url = "http://trainer:hunter2@127.0.0.1:9/reward"  # port 9: nothing listens
    with pytest.raises(tiny_grpo.errors.RewardError) as error:
        tiny_grpo.rewards.remote_rewards(url, [], [], [], timeout=1.0, retries=1)
    assert "hunter2" not in str(error.value) and "http://***@127.0.0.1:9/reward" in str(error.value)
    args = experiment.parse_args(["--device", "cpu", "--reward-url", url, "--run-name", "r"])
    assert args.reward_url == url  # the run itself uses it
    args.data_fingerprint = {}  # claim_run takes it, when the data has been read
    recorded = experiment.training_state(args, 1, (0, 0))["args"]
    assert "hunter2" not in str(recorded) and recorded["reward_url"] == "http://***@127.0.0.1:9/reward"
    assert "hunter2" not in fails_with(experiment, ["--device", "cpu", "--reward-url", "http://u:hunter2@ bad"], capsys)


def test_credentials_in_the_reward_url_are_sent_as_basic_authentication(experiment):
    """urllib took the user:password@ of a --reward-url for part of the host name: every try failed to resolve it."""
    import base64
    import http.server
    import threading

    seen = []

    class Service(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(self.headers.get("Authorization"))
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "18")
            self.end_headers()
            self.wfile.write(b'{"rewards": [0.5]}')

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://trainer:hunter2@127.0.0.1:{server.server_address[1]}/reward"
        assert tiny_grpo.rewards.remote_rewards(url, ["c"], ["a"], [{}], timeout=5.0, retries=1) == [0.5]
    finally:
        server.shutdown()
        server.server_close()
    assert seen == ["Basic " + base64.b64encode(b"trainer:hunter2").decode()]


@pytest.mark.parametrize("run_name", ["../../x", "ABSOLUTE", ".", "..", "a/b"])
def test_a_run_name_is_one_plain_folder_name(experiment, run_name, tmp_path, capsys):
    """--run-name ../../x or an absolute one put checkpoints and events outside --checkpoint-path and --log-dir,
    and '.' straight into their roots. (The roots and the missing model keep the old code's escape inside tmp_path.)"""
    from conftest import fails_with

    run_name = str(tmp_path / "elsewhere") if run_name == "ABSOLUTE" else run_name
    roots = ["--checkpoint-path", tmp_path / "a" / "b" / "out", "--log-dir", tmp_path / "a" / "b" / "runs"]
    said = fails_with(experiment, ["--device", "cpu", "--model-name", tmp_path / "no-model", *roots, "--run-name",
                                   run_name], capsys)
    assert "--run-name" in said and "one plain folder name" in said
    assert not (tmp_path / "a").exists() and not (tmp_path / "elsewhere").exists()  # nothing written anywhere


@pytest.mark.parametrize("name", SINGLE_PROCESS)
def test_keep_checkpoints_keeps_the_newest_past_step_999999(name, tmp_path):
    """Names sort as text: step_1000000 came before step_999999, and --keep-checkpoints 1 deleted the newest."""
    module = load_experiment(name)
    (tmp_path / "step_999999").mkdir()
    (tmp_path / "step_999999" / "adapter_model.safetensors").write_bytes(b"old")
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0)

    class Model:
        def save_pretrained(self, folder):
            pathlib.Path(folder).mkdir(parents=True)
            (pathlib.Path(folder) / "adapter_model.safetensors").write_bytes(b"new")

    module.save_checkpoint(tmp_path / "step_1000000", Model(), optimizer, scheduler, {"step": 1000000}, keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step_1000000"]
    assert [p.name for p in tiny_grpo.checkpoints.checkpoints_in(tmp_path)] == ["step_1000000"]


def test_checkpoints_are_ordered_by_step_number(experiment, tmp_path):
    for step in (2, 1000000, 999999, 10):
        (tmp_path / f"step_{step:06d}").mkdir()
    (tmp_path / "step_000003.partial").mkdir()
    assert [p.name for p in tiny_grpo.checkpoints.checkpoints_in(tmp_path)] == ["step_000002", "step_000010", "step_999999",
                                                                    "step_1000000"]


def test_a_reward_fn_of_the_wrong_shape_is_refused_before_the_model_loads(experiment, tmp_path, monkeypatch, capsys):
    """A --reward-fn taking two arguments failed at the first reward, after the model had loaded, leaving a
    step_000000 that blocked the run name; a --reward-fn-timeout too large for the clock failed the same way."""
    from conftest import fails_with

    (tmp_path / "two_args.py").write_text("def reward(completion, answer):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(experiment.InputError, match=r"reward\(completion, answer\) cannot be called as "
                                                    r"reward\(completion, answer, metadata\)"):
        tiny_grpo.rewards.load_reward_fn("two_args:reward")
    for option in (["--reward-fn-timeout", "1e300"], ["--reward-timeout", "1e300"]):
        said = fails_with(experiment, ["--device", "cpu", *option], capsys)
        assert option[0] in said and "(0, 1e6]" in said


@pytest.mark.parametrize("value", ['"0.5"', "True", "[1.0]"], ids=["string", "boolean", "list"])
def test_a_reward_fn_returning_no_number_is_refused(experiment, tmp_path, monkeypatch, value):
    """A --reward-fn returning the string "0.5" or True was taken as 0.5 or 1.0."""
    (tmp_path / "not_a_number.py").write_text(f"def reward(completion, answer, metadata):\n    return {value}\n")
    monkeypatch.chdir(tmp_path)
    function = tiny_grpo.rewards.load_reward_fn("not_a_number:reward")
    with pytest.raises(tiny_grpo.errors.RewardError, match="not a finite number"):
        function("c", "a", {})
    (tmp_path / "numpy_number.py").write_text("import numpy\ndef reward(completion, answer, metadata):\n"
                                              "    return numpy.float32(0.25)\n")
    assert tiny_grpo.rewards.load_reward_fn("numpy_number:reward")("c", "a", {}) == 0.25  # any kind of number still counts


@pytest.mark.parametrize("name", SINGLE_PROCESS + ["experiment_accelerate"])
def test_two_runs_under_one_name_never_share_a_tensorboard_folder(name, tiny_model_dir, tmp_path, capsys):
    """The same --run-name under another --checkpoint-path wrote into the first run's TensorBoard folder: two runs
    in one curve. The log folder is claimed as the run folder is."""
    from conftest import fails_with, tensorboard_scalars

    module = load_experiment(name)
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path)])
    said = fails_with(module, [*tiny_run(module, tiny_model_dir, tmp_path), "--checkpoint-path", tmp_path / "other"], capsys)
    assert "holds the TensorBoard events of another run" in said and str(tmp_path / "out" / "r") in said
    assert [step for step, _ in tensorboard_scalars(tmp_path / "runs" / "r")["train/loss"]] == [1]


def test_resume_applies_a_new_learning_rate_and_refuses_other_data(two_steps, tiny_model_dir, tmp_path, capsys):
    """--resume with another --lr exited 0 with the old rate silently kept (restored with the optimizer) while the
    checkpoint recorded the new one. Now the new rate is the one in force and recorded; a resume with other data
    options (whose position the checkpoint holds) is refused naming both values."""
    from conftest import fails_with

    module, run_dir = two_steps
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path, "--resume", run_dir, "--lr", "3e-3", steps=3)])
    assert "--lr 0.003 from here on (the checkpoint's run had 5e-05)" in capsys.readouterr().out
    state = tiny_grpo.checkpoints.load_state_file(run_dir / "step_000003")
    assert state["args"]["lr"] == 3e-3 and state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(3e-3)
    assert state["scheduler"]["base_lrs"] == [3e-3]
    for option, says in ((["--seed", "7"], "--seed 42 there, 7 here"), (["--max-prompts", "4"], "--max-prompts None there, 4 here")):
        said = fails_with(module, tiny_run(module, tiny_model_dir, tmp_path, "--resume", run_dir, *option, steps=4), capsys)
        assert says in said and "start a new run" in said


@pytest.mark.parametrize("name", SINGLE_PROCESS)
def test_a_save_over_the_file_size_limit_names_the_cause(name, tmp_path):
    """Under a file-size limit (ulimit -f) a save said only "unexpected pos 153344 vs 153232". It now names the
    limit, and that the earlier checkpoints were not touched."""
    import resource

    module = load_experiment(name)
    (tmp_path / "step_000001").mkdir()
    weight = torch.nn.Parameter(torch.zeros(100_000))
    optimizer = torch.optim.AdamW([weight])
    weight.grad = torch.ones_like(weight)
    optimizer.step()  # two moments of 100,000 floats: 800 KB to save
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0)

    class Model:
        def save_pretrained(self, folder):
            pathlib.Path(folder).mkdir(parents=True)

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        with pytest.raises(module.InputError) as error:
            module.save_checkpoint(tmp_path / "step_000002", Model(), optimizer, scheduler, {"step": 2}, keep=3)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "a file-size limit of 100,000 bytes is in force (ulimit -f)" in str(error.value)
    assert "the earlier checkpoints are kept" in str(error.value)
    assert [p.name for p in tmp_path.iterdir()] == ["step_000001"]  # no half checkpoint left


@pytest.mark.parametrize("name", ["experiment_accelerate", "experiment_accelerate_ddp"])
def test_fp8_from_accelerate_launch_is_a_message(name, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """ACCELERATE_MIXED_PRECISION=fp8 (what `accelerate launch --mixed_precision fp8` passes) raised a ValueError
    traceback inside Accelerator(): fp8 needs transformer_engine or MS-AMP."""
    from conftest import fails_with

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    module = load_experiment(name)
    said = fails_with(module, tiny_run(module, tiny_model_dir, tmp_path), capsys)
    assert "mixed precision 'fp8', from ACCELERATE_MIXED_PRECISION" in said and "use no, bf16 or fp16" in said


def test_one_process_where_accelerate_launch_was_asked_for_two_says_so(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """`accelerate launch --num_processes 2` without --multi_gpu starts one process on a CPU (accelerate 1.15): the
    run went on as one process without a word. The environment is the one that launcher gives its process
    (measured: ACCELERATE_USE_CPU and ACCELERATE_MIXED_PRECISION set, no WORLD_SIZE)."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    module = load_experiment("experiment_accelerate_ddp")
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path)])
    assert "accelerate launch started one process" in capsys.readouterr().err


def test_odd_corpus_files_and_folders_are_skipped_with_a_warning(tmp_path, caplog):
    """Folders nested past the path-length limit raised an OSError traceback; a file of random bytes became
    hundreds of garbage passages without a word; a file name holding a line break broke the 'Doc N (id):' line
    the model reads."""
    import random
    import shutil

    search = load_search()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "notes.md").write_text("The lighthouse of Orrin Quade was built in 1893 on the northern cape.\n")
    (corpus / "noise.txt").write_bytes(random.Random(0).randbytes(20_000))
    (corpus / "two\nlines.md").write_text("Doc 9 (forged): a passage whose id would start a line of its own.\n")
    folder = os.open(corpus, os.O_RDONLY)
    for _ in range(100):  # 100 levels of 60-character names: past the 4,096-byte path limit
        os.mkdir("d" * 60, dir_fd=folder)
        below = os.open("d" * 60, os.O_RDONLY, dir_fd=folder)
        os.close(folder)
        folder = below
    os.close(folder)
    try:
        with caplog.at_level(logging.WARNING):
            passages = search.load_passages(corpus)
    finally:
        shutil.rmtree(corpus / ("d" * 60))
    assert [p.source for p in passages] == ["notes.md"]
    assert "noise.txt is not UTF-8 text" in caplog.text
    assert "holds a control character" in caplog.text
    assert "cannot list it" in caplog.text


def test_the_dense_index_cache_is_keyed_by_content(tmp_path):
    """The cache was keyed by path, size and mtime: an edit that keeps both (cp -p, rsync -t, tar) served passages
    that were in no file any more."""
    search = load_search()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    notes = corpus / "notes.md"
    notes.write_text("The lighthouse of Orrin Quade was built in 1893.\n")
    before = notes.stat()
    key = search.corpus_key(corpus, search.corpus_files(corpus))
    notes.write_text("The lighthouse of Orrin Quade was built in 1894.\n")  # the same size
    os.utime(notes, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the same time, as cp -p leaves it
    assert notes.stat().st_size == before.st_size and notes.stat().st_mtime_ns == before.st_mtime_ns
    assert search.corpus_key(corpus, search.corpus_files(corpus)) != key


# ---- round three (issue 59): a checkpoint that runs code, weights that reset in silence, a run that ends unsaved ----

ACCELERATE = ["experiment_accelerate", "experiment_accelerate_ddp"]


@pytest.fixture
def accelerate_steps(request, tiny_model_dir, tmp_path):
    """An accelerate copy trained 2 steps in this process, a checkpoint after each: (module, run folder)."""
    module = load_experiment(request.param)
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path, "--checkpoint-interval", "1", steps=2)])
    return module, tmp_path / "out" / "r"


@pytest.mark.parametrize("accelerate_steps", ACCELERATE, indirect=True)
def test_accelerate_resume_never_unpickles_code(accelerate_steps, tiny_model_dir, tmp_path, capsys):
    """accelerator.register_for_checkpointing(scheduler) made save_state write accelerate_state/custom_checkpoint_0.pkl
    and load_state read it with weights_only=False: a pickle put there ran on --resume. The schedule is now plain data
    in training_state.pt, and load_state is shown only the files checked to hold tensors and plain data."""
    module, run_dir = accelerate_steps
    state_dir = run_dir / "step_000002" / "accelerate_state"
    assert not list(state_dir.glob("custom_checkpoint_*"))  # nothing pickled is written
    marker = tmp_path / "code_ran"
    torch.save({"payload": RunsCode(marker)}, state_dir / "custom_checkpoint_0.pkl")
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path, "--resume", run_dir, steps=3)])
    assert not marker.exists()
    assert "resumed from" in capsys.readouterr().out and (run_dir / "step_000003").is_dir()
    # a pickled object anywhere that load_state reads: the step is passed over, nothing runs
    torch.save({"state": {}, "param_groups": [], "payload": RunsCode(marker)}, run_dir / "step_000003" / "accelerate_state" / "optimizer.bin")
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path, "--resume", run_dir, steps=4)])
    assert not marker.exists()
    said = capsys.readouterr()
    assert "step_000003 is damaged (accelerate_state/optimizer.bin holds more than tensors" in said.err
    assert "at step 2" in said.out


@pytest.mark.parametrize("accelerate_steps", ["experiment_accelerate"], indirect=True)
def test_an_accelerate_checkpoint_of_the_old_layout_resumes_its_schedule(accelerate_steps, tiny_model_dir, tmp_path, capsys):
    """Checkpoints written before the fix hold the schedule in custom_checkpoint_0.pkl, as plain data: it is read
    without pickle's code (weights_only), and the run goes on where it was."""
    module, run_dir = accelerate_steps
    folder = run_dir / "step_000002"
    state = torch.load(folder / "training_state.pt", weights_only=True)
    schedule = state.pop("scheduler")
    schedule["base_lrs"] = [5e-5] * len(schedule["base_lrs"])  # a mark that only the old file carries
    torch.save(schedule, folder / "accelerate_state" / "custom_checkpoint_0.pkl")
    torch.save(state, folder / "training_state.pt")
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path, "--resume", run_dir, steps=3)])
    assert "at step 2" in capsys.readouterr().out
    resumed = torch.load(run_dir / "step_000003" / "training_state.pt", weights_only=True)["scheduler"]
    assert resumed["last_epoch"] == schedule["last_epoch"] + 1  # the old schedule, one update on


def cut_to_one_tensor(file):
    from safetensors.torch import load_file, save_file

    weights = load_file(file)
    first = sorted(weights)[0]
    save_file({first: weights[first]}, file, metadata={"format": "pt"})
    return len(weights)


@pytest.mark.parametrize("name", SINGLE_PROCESS)
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "no-lora"])
def test_weights_missing_tensors_are_refused_not_reset(name, lora, tiny_model_dir, tmp_path, capsys):
    """An adapter_model.safetensors (or, with --no-lora, model.safetensors) cut down to one tensor resumed with exit
    0, the missing weights left as a fresh LoRA's (or the base model's): training silently restarted."""
    from conftest import fails_with

    module = load_experiment(name)
    options = [] if lora else ["--no-lora"]
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path, *options)])
    file = tmp_path / "out" / "r" / "step_000001" / ("adapter_model.safetensors" if lora else "model.safetensors")
    count = cut_to_one_tensor(file)
    said = fails_with(module, tiny_run(module, tiny_model_dir, tmp_path, "--resume", file.parent, *options, steps=2), capsys)
    assert f"its weights do not match this model: {count - 1} missing" in said and "Traceback" not in said
    assert not (tmp_path / "out" / "r" / "step_000002").exists()


def truncated(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def state_as_list(file):
    torch.save([1, 2, 3], file)


def state_without_optimizer(file):
    state = torch.load(file, weights_only=True)
    del state["optimizer"]
    torch.save(state, file)


@pytest.mark.parametrize("damage, file, says", [
    (truncated, "adapter_model.safetensors", "adapter_model.safetensors is damaged (Error while deserializing header"),
    (state_as_list, "training_state.pt", "training_state.pt holds a list, not the training state"),
    (state_without_optimizer, "training_state.pt", "training_state.pt lacks optimizer (dict)"),
], ids=["safetensors-cut-short", "state-a-list", "state-without-optimizer"])
def test_a_damaged_newest_checkpoint_of_any_kind_is_passed_over(two_steps, tiny_model_dir, tmp_path, capsys, damage,
                                                                file, says):
    """Each of these gave a traceback after the model had loaded; the README promises that a damaged newest
    checkpoint is passed over for the step before."""
    module, run_dir = two_steps
    damage(run_dir / "step_000002" / file)
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path, "--resume", run_dir, steps=3)])
    said = capsys.readouterr()
    assert f"step_000002 is damaged ({says}" in said.err
    assert "at step 1" in said.out and (run_dir / "step_000003").is_dir()


@pytest.mark.parametrize("accelerate_steps", ACCELERATE, indirect=True)
def test_a_cut_short_accelerate_optimizer_is_passed_over(accelerate_steps, tiny_model_dir, tmp_path, capsys):
    module, run_dir = accelerate_steps
    truncated(run_dir / "step_000002" / "accelerate_state" / "optimizer.bin")
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path, "--resume", run_dir, steps=3)])
    said = capsys.readouterr()
    assert "step_000002 is damaged (accelerate_state/optimizer.bin is damaged" in said.err
    assert "at step 1" in said.out


@pytest.mark.parametrize("name", SINGLE_PROCESS + ["experiment_accelerate"])
def test_keep_checkpoints_passes_over_a_step_that_is_a_link_or_a_file(name, tiny_model_dir, tmp_path, capsys):
    """--keep-checkpoints crashed removing a step_N that was a symbolic link (rmtree refuses links) or a file: after the
    save, or at a mid-run save, which stopped the run. They are no checkpoints of the run: kept, and said once."""
    module = load_experiment(name)
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path)])
    run_dir, elsewhere = tmp_path / "out" / "r", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not the run's")
    (run_dir / "step_000000").symlink_to(elsewhere)
    (run_dir / "step_0000001").write_text("a file")
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path, "--resume", run_dir, "--checkpoint-interval",
                                          "1", "--keep-checkpoints", "1", steps=3)])
    said = capsys.readouterr().err
    assert "step_000000: not a folder of its own" in said and "step_0000001: not a folder of its own" in said
    assert sorted(p.name for p in run_dir.iterdir()) == ["step_000000", "step_0000001", "step_000003"]
    assert (elsewhere / "keep.txt").read_text() == "not the run's"


INTERRUPT = """
import os, signal, sys
sys.path.insert(0, {benchmarks!r})
from common import load_experiment
module = load_experiment({name!r})
{body}
"""


def test_a_closed_terminal_stops_the_run_as_sigterm_does():
    """SIGHUP (a closed terminal or ssh session) killed the run, the steps since the last checkpoint lost (every
    experiment's Interrupts but experiment_accelerate_ddp's, which the next test holds)."""
    from conftest import run_command

    # SIGHUP at its default first, as in a terminal: the suite itself may run under nohup, which ignores it
    body = ("signal.signal(signal.SIGHUP, signal.SIG_DFL)\nfrom tiny_grpo.stopping import Interrupts\n"
            "interrupts = Interrupts()\ntry:\n"
            "    os.kill(os.getpid(), signal.SIGHUP)\nexcept KeyboardInterrupt as e:\n    print('stopping on', e)")
    result = run_command([sys.executable, "-c", INTERRUPT.format(benchmarks=str(ROOT / "benchmarks"),
                                                                 name="experiment_base", body=body)])
    assert result.returncode == 0 and "stopping on SIGHUP" in result.stdout, result.stderr[-2000:]


def test_sighup_in_data_parallel_runs_takes_note_as_sigterm_does():
    from conftest import run_command

    body = ("signal.signal(signal.SIGHUP, signal.SIG_DFL)\ninterrupts = module.Interrupts()\n"
            "os.kill(os.getpid(), signal.SIGHUP)\n"
            "print('noted', signal.Signals(interrupts.pending).name)")
    result = run_command([sys.executable, "-c", INTERRUPT.format(benchmarks=str(ROOT / "benchmarks"),
                                                                 name="experiment_accelerate_ddp", body=body)])
    assert result.returncode == 0 and "noted SIGHUP" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_ctrl_c_while_starting_is_one_line(name, tiny_model_dir, tmp_path):
    """Ctrl-C before the first step (here: while the model loads) printed a traceback."""
    from conftest import run_command

    argv = [str(a) for a in tiny_run(load_experiment(name), tiny_model_dir, tmp_path)]
    body = f"def load_model(args):\n    raise KeyboardInterrupt\nmodule.load_model = load_model\nmodule.main({argv!r})"
    result = run_command([sys.executable, "-c", INTERRUPT.format(benchmarks=str(ROOT / "benchmarks"), name=name, body=body)])
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == "interrupted while starting: no step was run, nothing to save"


@pytest.mark.parametrize("name", SINGLE_PROCESS + ["experiment_accelerate"])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the disk this test fills, as
# TensorBoard's writer thread meets it: the run is what must carry on, and the thread's exception is the fault itself
def test_a_full_disk_under_the_log_dir_loses_no_step(name, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """TensorBoard's OSError (no space left on device) ended the run with a traceback, every step since the last
    checkpoint lost. The event files' writes fail here as on a full disk, from the second write on."""
    import errno

    from tensorboard.summary.writer import record_writer

    writes = []

    def write(self, data):
        writes.append(len(data))
        if len(writes) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    module = load_experiment(name)
    module.main([str(a) for a in tiny_run(module, tiny_model_dir, tmp_path, "--checkpoint-interval", "0", steps=3)])
    said = capsys.readouterr()
    assert said.err.count("logging to TensorBoard failed ([Errno 28] No space left on device)") == 1
    assert "done: 3 steps" in said.out and (tmp_path / "out" / "r" / "step_000003" / "training_state.pt").is_file()


def test_data_edited_between_a_run_and_its_resume_is_refused(two_steps, tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A data file edited between a run and its --resume was accepted: the run carried its data position into other
    rows. The same file spelled another way, or the same --filter values in another order, were refused."""
    from conftest import fails_with

    module, run_dir = two_steps
    monkeypatch.chdir(tmp_path)
    argv = tiny_run(module, tiny_model_dir, tmp_path, "--resume", run_dir / "step_000001", "--run-name", "again", steps=2)
    argv[argv.index("--data-path") + 1] = "./tasks.jsonl"  # the same file, spelled from here
    module.main([str(a) for a in argv])
    assert "at step 1" in capsys.readouterr().out
    argv = tiny_run(module, tiny_model_dir, tmp_path, "--resume", run_dir, steps=3)  # (tiny_run writes the data)
    data = tmp_path / "tasks.jsonl"
    data.write_text(data.read_text().replace('"Say 3"', '"Say 33"'))  # one row changed, the same count of rows
    said = fails_with(module, argv, capsys)
    assert "--data-path" in said and "its files changed since the checkpoint was written" in said


def test_filters_in_another_order_resume(tiny_model_dir, tmp_path, capsys):
    from conftest import write_jsonl

    module = load_experiment("experiment_base")

    def run(*options, steps):
        argv = tiny_run(module, tiny_model_dir, tmp_path, *options, steps=steps)
        argv[argv.index("--data-path") + 1] = tmp_path / "kinds.jsonl"
        module.main([str(a) for a in argv])

    write_jsonl(tmp_path / "kinds.jsonl", [{"question": f"Say {i}", "answer": "7", "kind": f"k{i % 3}", "size": i % 2}
                                           for i in range(12)])
    run("--filter", "kind=k0,k1", "--filter", "size=0,1", steps=1)
    run("--filter", "size=1,0", "--filter", "kind=k1,k0", "--resume", tmp_path / "out" / "r", steps=2)
    assert "at step 1" in capsys.readouterr().out


@pytest.mark.parametrize("option", ["--run-name", "--checkpoint-path", "--log-dir"])
def test_a_name_that_is_not_utf8_is_refused_before_any_folder_is_made(experiment, option, tmp_path, capsys, monkeypatch):
    """A --run-name or --checkpoint-path that is not valid UTF-8 (bytes a shell passes as they are) gave a
    UnicodeEncodeError and left two locked, empty folders."""
    import os as os_module

    from conftest import fails_with

    monkeypatch.chdir(tmp_path)
    name = os_module.fsdecode(b"run-\xff")  # how Python receives such bytes in sys.argv
    said = fails_with(experiment, ["--device", "cpu", "--model-name", tmp_path / "no-model", option, name], capsys)
    assert option in said and "must be valid UTF-8" in said
    assert list(tmp_path.iterdir()) == []


# ---- round four (issue 71): secrets, and files where they do not belong ----

@pytest.mark.parametrize("url, auth", [
    ("http://trainer:hun/ter2@127.0.0.1:9/reward", "trainer:hun/ter2"),  # '/': redact stopped at it
    ("http://trainer:hun@ter2@127.0.0.1:9/reward", "trainer:hun@ter2"),  # '@': split at the first, 'ter2@' shown
    ("http://trainer:hun%40t%C3%A9r2@127.0.0.1:9/reward", "trainer:hun@tér2"),  # percent-encoded: sent encoded
    ("http://127.0.0.1:9/reward?token=hunter2", None),  # a query: printed in errors, stored in checkpoints
])
def test_every_kind_of_reward_url_secret_is_hidden_and_sent_decoded(experiment, url, auth):
    """redact stopped at the first '/', so a password holding '/' was printed whole, one holding '@' in part (and the
    wrong one sent); a percent-encoded password was sent still encoded; a ?token= was printed and stored."""
    secret = "hunter2" if auth is None else auth.split(":", 1)[1]
    assert tiny_grpo.urls.credentials(url)[1] == auth
    assert tiny_grpo.urls.redact(url) == ("http://***@127.0.0.1:9/reward" if auth else "http://127.0.0.1:9/reward?***")
    with pytest.raises(tiny_grpo.errors.RewardError) as error:
        tiny_grpo.rewards.remote_rewards(url, ["c"], ["a"], [{}], timeout=1.0, retries=1)
    assert "ter2" not in str(error.value) and "%40" not in str(error.value), str(error.value)
    args = experiment.parse_args(["--device", "cpu", "--reward-url", url])
    args.data_fingerprint = {}
    assert secret not in str(experiment.training_state(args, 1, (0, 0))["args"])


@pytest.mark.parametrize("url", ["http://u:hunter2@127.0.0.1:99999/reward", "http://u:hunter2@[::1/reward"])
def test_a_reward_url_urllib3_cannot_parse_is_refused_at_the_start_without_its_password(experiment, url, capsys):
    """A port out of range or an unclosed '[' passed the check, then urllib3's LocationParseError quoted the whole URL
    (password included) at every try."""
    from conftest import fails_with

    said = fails_with(experiment, ["--device", "cpu", "--reward-url", url], capsys)
    assert "--reward-url" in said and "hunter2" not in said and "http://***@" in said


def test_wandb_keeps_no_password_and_writes_only_under_the_run(tiny_model_dir, tmp_path, monkeypatch):
    """W&B stored the command line, --reward-url's password included, in its offline run file (which `wandb sync`
    uploads), and wrote core-debug-*.log and symon-debug-*.log under ~/.cache/wandb, outside the run's folders."""
    import subprocess

    from conftest import run_script

    server = subprocess.Popen([sys.executable, str(ROOT / "tools" / "reward_server.py"), "--port", "0", "--quiet"],
                              stdout=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().split()[-1]
        url = address.replace("http://", "http://trainer:hunter2@") + "?token=tok3n"
        home = tmp_path / "home"
        home.mkdir()
        module = load_experiment("experiment_base")
        argv = tiny_run(module, tiny_model_dir, tmp_path, "--wandb", "--reward-url", url)
        result = run_script(ROOT / "experiment_base" / "train.py", *argv, cwd=tmp_path,
                            env={"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "WANDB_MODE": "offline"})
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert result.returncode == 0, result.stderr[-3000:]
    written = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_relative_to(tmp_path / "home")]
    assert any(p.name.startswith("core-debug-") for p in written)  # kept under the run's own log folder
    assert all(p.is_relative_to(tmp_path / "runs" / "r") or p.is_relative_to(tmp_path / "out" / "r") or
               p.name == "tasks.jsonl" for p in written), written
    assert list(home.rglob("*")) == []
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and (b"hunter2" in p.read_bytes() or b"tok3n" in p.read_bytes())]
    assert leaked == [] and "hunter2" not in result.stdout + result.stderr


@pytest.mark.parametrize("name", SINGLE_PROCESS)
def test_a_reward_fn_that_changes_the_working_directory_moves_no_checkpoint(name, tiny_model_dir, tmp_path,
                                                                           monkeypatch, capsys):
    """Reward code that runs generated code often chdirs into a temporary folder: every later checkpoint went under
    it (the run said it was in out/r), the run's own locked folder stayed empty, and TensorBoard's thread died."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    reward = f"chdir_reward_{tmp_path.name}"
    (tmp_path / f"{reward}.py").write_text(f"import os\n\ndef reward(completion, answer, metadata):\n"
                                           f"    os.chdir({str(elsewhere)!r})\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    module = load_experiment(name)
    argv = tiny_run(module, tiny_model_dir, pathlib.Path("."), "--reward-fn", f"{reward}:reward", steps=2)
    argv[argv.index("--data-path") + 1] = tmp_path / "tasks.jsonl"
    from conftest import write_jsonl
    write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"Say {i}", "answer": "7"} for i in range(8)])
    module.main([str(a) for a in argv])
    assert list(elsewhere.iterdir()) == []
    assert sorted(p.name for p in (tmp_path / "out" / "r").iterdir()) == ["step_000002"]
    assert list((tmp_path / "runs" / "r").glob("events.out.tfevents.*"))
    assert str(tmp_path / "out" / "r" / "step_000002") in capsys.readouterr().out


@pytest.mark.parametrize("change", ["deleted", "edited"])
def test_the_data_recorded_is_the_data_read(change, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The data's fingerprint was taken at every save: data deleted during a run turned the save after SIGTERM into a
    traceback (the steps done lost), and data edited during a run was recorded as if trained on."""
    module = load_experiment("experiment_base")
    argv = tiny_run(module, tiny_model_dir, tmp_path, steps=2)
    data = tmp_path / "tasks.jsonl"
    original = module.rollout

    def rollout(*args, **kwargs):  # the data changes while the first step samples
        if data.exists():
            data.unlink() if change == "deleted" else data.write_text('{"question": "Other", "answer": "1"}\n')
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "rollout", rollout)
    module.main([str(a) for a in argv])
    state = tiny_grpo.checkpoints.load_state_file(tmp_path / "out" / "r" / "step_000002")
    from conftest import write_jsonl
    write_jsonl(tmp_path / "again.jsonl", [{"question": f"Say {i}", "answer": "7"} for i in range(8)])
    assert state["data"]["sha256"] == tiny_grpo.checkpoints.data_fingerprint(tmp_path / "again.jsonl")["sha256"]


def test_run_folders_inside_a_data_folder_are_refused(tiny_model_dir, tmp_path, capsys):
    """--data-path of a folder that also held the run's checkpoints hashed them into the data's fingerprint at each
    save, and datasets read their .json files as data at the next start: refused, by name, before the model loads.
    A folder's fingerprint is taken of the files datasets reads, once."""
    from conftest import fails_with, write_jsonl

    module = load_experiment("experiment_base")
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "tasks.jsonl", [{"question": f"Say {i}", "answer": "7"} for i in range(8)])
    argv = tiny_run(module, tiny_model_dir, tmp_path)
    argv[argv.index("--data-path") + 1] = tmp_path / "data"
    argv[argv.index("--checkpoint-path") + 1] = tmp_path / "data" / "out"
    said = fails_with(module, argv, capsys)
    assert "--checkpoint-path" in said and "inside --data-path" in said and not (tmp_path / "data" / "out").exists()
    before = tiny_grpo.checkpoints.data_fingerprint(str(tmp_path / "data"))
    (tmp_path / "data" / "notes.txt").write_text("not data")
    (tmp_path / "data" / ".cache").mkdir()
    (tmp_path / "data" / ".cache" / "x.json").write_text("{}")
    assert tiny_grpo.checkpoints.data_fingerprint(str(tmp_path / "data")) == before


def started(argv, cwd, **popen):
    """A run in a process of its own, once its progress bar is up: its signal handlers are in place."""
    import subprocess

    process = subprocess.Popen([sys.executable, str(ROOT / "experiment_base" / "train.py"), *map(str, argv)], cwd=cwd,
                               stderr=subprocess.PIPE, **popen)
    seen, bar = b"", argv[argv.index("--run-name") + 1].encode() + b":"
    while bar not in seen and process.poll() is None:
        seen += process.stderr.read1(1000)
    return process


def test_a_closed_output_pipe_loses_no_step(tiny_model_dir, tmp_path):
    """`train.py 2>&1 | head`, or `| less` then q: the progress bar's BrokenPipeError was not caught, and every
    step since the last checkpoint was lost. The bar is dropped, the run trains on and saves."""
    module = load_experiment("experiment_base")
    process = started(tiny_run(module, tiny_model_dir, tmp_path, steps=3), tmp_path)
    process.stderr.close()  # the reader of the run's output goes away
    with hang_guard("a run whose output pipe closed", 600):
        process.wait(timeout=600)
    assert sorted(p.name for p in (tmp_path / "out" / "r").iterdir()) == ["step_000003"]


def test_a_hangup_ignored_at_the_start_stays_ignored(tiny_model_dir, tmp_path):
    """`nohup train.py &`: the run replaced nohup's ignored SIGHUP with its own handler, and stopped when the
    terminal closed. A signal ignored at the start stays ignored; one that was not still saves and stops."""
    import signal
    import subprocess

    module = load_experiment("experiment_base")
    argv = tiny_run(module, tiny_model_dir, tmp_path, steps=3)
    process = started(argv, tmp_path, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    process.send_signal(signal.SIGHUP)
    with hang_guard("a run under nohup", 600):
        _, said = process.communicate(timeout=600)
    assert process.returncode == 0, said.decode()[-2000:]
    assert sorted(p.name for p in (tmp_path / "out" / "r").iterdir()) == ["step_000003"]
    argv[argv.index("--run-name") + 1] = "again"
    process = started(argv, tmp_path, stdout=subprocess.DEVNULL,  # the suite itself may run under nohup
                      preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    process.send_signal(signal.SIGHUP)  # not ignored at the start: handled as Ctrl-C is
    with hang_guard("a run hung up", 600):
        _, said = process.communicate(timeout=600)
    assert process.returncode == 130 and b"interrupted" in said


# ---- round four, item 6: a --reward-fn busy in C or changing SIGUSR1; a SIGUSR1 from outside ----

@pytest.mark.parametrize("body", ['re.match(r"(a+)+$", "a" * 40 + "b")',
                                  "signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n    while True:\n        time.sleep(1)",
                                  "signal.signal(signal.SIGUSR1, signal.SIG_DFL)\n    while True:\n        time.sleep(1)"],
                         ids=["busy-in-c", "ignores-sigusr1", "sigusr1-to-default"])
def test_a_reward_fn_that_no_signal_can_stop_is_stopped_at_its_deadline(body, tiny_model_dir, tmp_path):
    """--reward-fn-timeout was a timer thread's SIGUSR1: a backtracking regex, busy in C, holds the GIL, and hung the
    run until a SIGTERM came; a function that set SIGUSR1 to be ignored ran on past its deadline, and one that set it
    to the default was killed with the run, unsaved. Now the function's process is killed at the deadline: from the
    second step on, the run saves step 1 and stops, naming the timeout."""
    from conftest import run_command

    (tmp_path / "stuck_reward.py").write_text("import re, signal, time\n\nCALLS = []\n\n"
                                              "def reward(completion, answer, metadata):\n    CALLS.append(1)\n"
                                              f"    if len(CALLS) <= 4:\n        return 0.5\n    {body}\n    return 1.0\n")
    argv = tiny_run(load_experiment("experiment_base"), tiny_model_dir, tmp_path, "--reward-fn", "stuck_reward:reward",
                    "--reward-fn-timeout", "1", steps=3)
    result = run_command([sys.executable, ROOT / "experiment_base" / "train.py", *argv], cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "stuck_reward:reward failed on completion" in result.stderr and "TimeoutError: no result within 1.0 s" in result.stderr
    assert "saving step 1" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in (tmp_path / "out" / "r").iterdir()) == ["step_000001"]


def test_sigusr1_saves_and_stops_the_run_as_sigterm_does(tiny_model_dir, tmp_path):
    """SLURM's --signal=USR1@90 warns a job before pre-empting it: SIGUSR1's default action ended the run unsaved."""
    import signal
    import subprocess
    import time

    from conftest import tensorboard_scalars

    argv = tiny_run(load_experiment("experiment_base"), tiny_model_dir, tmp_path, "--checkpoint-interval", "0",
                    steps=100000)
    process = subprocess.Popen([sys.executable, str(ROOT / "experiment_base" / "train.py"), *map(str, argv)], cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600  # a guard against a hang
    while time.time() < deadline and process.poll() is None and not tensorboard_scalars(tmp_path / "runs").get("train/loss"):
        time.sleep(0.2)
    process.send_signal(signal.SIGUSR1)
    with hang_guard("a run sent SIGUSR1", 600):
        _, said = process.communicate(timeout=600)
    assert process.returncode == 130 and "interrupted: saving step" in said and "Traceback" not in said, said[-3000:]
    steps = list((tmp_path / "out" / "r").iterdir())
    assert len(steps) == 1 and re_step(steps[0].name) >= 1 and (steps[0] / "training_state.pt").is_file()


def test_sigusr1_during_a_reward_call_is_no_reward_timeout(tiny_model_dir, tmp_path):
    """A SIGUSR1 from outside while --reward-fn ran was taken for the deadline's: "the reward failed: TimeoutError"
    and exit 1. It stops the run as SIGTERM does, the reward's process killed: step 1 saved, exit 130."""
    import signal
    import subprocess
    import time

    marker = tmp_path / "second_step_scoring"
    (tmp_path / "slow_reward.py").write_text(f"import pathlib, time\n\nCALLS = []\n\n"
                                             f"def reward(completion, answer, metadata):\n    CALLS.append(1)\n"
                                             f"    if len(CALLS) > 4:\n        pathlib.Path({str(marker)!r}).touch()\n"
                                             f"        time.sleep(3600)\n    return 0.5\n")
    argv = tiny_run(load_experiment("experiment_base"), tiny_model_dir, tmp_path, "--reward-fn", "slow_reward:reward",
                    "--reward-fn-timeout", "7200", steps=3)
    process = subprocess.Popen([sys.executable, str(ROOT / "experiment_base" / "train.py"), *map(str, argv)], cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600  # a guard against a hang
    while time.time() < deadline and process.poll() is None and not marker.exists():
        time.sleep(0.1)
    process.send_signal(signal.SIGUSR1)
    with hang_guard("a run sent SIGUSR1 while its reward ran", 600):
        _, said = process.communicate(timeout=600)
    assert process.returncode == 130 and "interrupted: saving step 1" in said, said[-3000:]
    assert "reward failed" not in said and "Traceback" not in said
    assert sorted(p.name for p in (tmp_path / "out" / "r").iterdir()) == ["step_000001"]


@pytest.mark.parametrize("name", ["tiny_grpo.stopping", "experiment_accelerate_ddp"])
def test_every_copy_takes_sigusr1_as_sigterm(name):
    """The package's Interrupts (every copy's but experiment_accelerate_ddp's) stops the run on SIGUSR1;
    experiment_accelerate_ddp's own takes note of it, as of SIGTERM (all its processes then stop together)."""
    from conftest import run_command

    if name == "experiment_accelerate_ddp":
        body = ("interrupts = module.Interrupts()\nos.kill(os.getpid(), signal.SIGUSR1)\n"
                "print('stopping on', signal.Signals(interrupts.pending).name)")
        script = INTERRUPT.format(benchmarks=str(ROOT / "benchmarks"), name=name, body=body)
    else:
        script = ("import os, signal\nfrom tiny_grpo.stopping import Interrupts\ninterrupts = Interrupts()\ntry:\n"
                  "    os.kill(os.getpid(), signal.SIGUSR1)\nexcept KeyboardInterrupt as e:\n    print('stopping on', e)")
    result = run_command([sys.executable, "-c", script])
    assert result.returncode == 0 and "stopping on SIGUSR1" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("options, env, says", [
    (["--run-name", "run:1#?"], {"WANDB_MODE": "offline"}, "--run-name 'run:1#?': W&B takes no # : ?"),
    (["--wandb-project", "team/project"], {"WANDB_MODE": "offline"}, "--wandb-project 'team/project': W&B takes no /"),
    ([], {"WANDB_MODE": "online"}, "--wandb: no W&B API key"),
    ([], {"WANDB_MODE": "offline", "import": "fails"}, "--wandb: W&B cannot be imported"),
], ids=["run-name", "project", "no-api-key", "no-import"])
def test_what_wandb_would_refuse_is_refused_before_the_model_loads(options, env, says, tmp_path, monkeypatch, capsys):
    """A run name W&B refuses as an id, a project holding '/', no API key in online mode or a W&B that fails to
    import surfaced as tracebacks after the model had loaded (a minute or more): each is one line now, before it."""
    from conftest import fails_with

    module = load_experiment("experiment_base")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no W&B settings
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", env["WANDB_MODE"])
    if env.get("import") == "fails":
        monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    argv = tiny_run(module, tmp_path / "no-model-here", tmp_path, "--wandb", *options)
    said = fails_with(module, argv, capsys)
    assert says in said and "Traceback" not in said and "no-model-here" not in said  # before the model was looked for
    assert not (tmp_path / "home").exists()  # nothing written to the user's home


def test_a_stop_during_the_held_out_evaluation_leaves_no_hole_in_its_curve(tiny_model_dir, tmp_path):
    """A SIGTERM while step 1's held-out evaluation runs: step 1 is saved (its update was made), and the evaluation it
    cut short is owed. The resumed run makes it first, so the eval curve has a point at every step: 0, 1, 2, 3. Before,
    the resumed run went on to step 2 and the curve had no point at step 1. The evaluation's reward (a --reward-fn,
    its answers 999 alone) sends the SIGTERM on the first call of the second evaluation."""
    from conftest import run_main, run_script, tensorboard_scalars, write_jsonl

    module = load_experiment("experiment_base")
    held_out = write_jsonl(tmp_path / "held_out.jsonl", [{"question": f"Say {i}", "answer": "999"} for i in range(2)])
    (tmp_path / "stop_in_eval.py").write_text(
        "import os, signal\nfrom pathlib import Path\n"
        "def reward(completion, answer, metadata):\n"
        "    if answer == '999':\n"
        "        with open(Path(__file__).with_name('eval_calls'), 'a') as seen:  # one byte a call, appended\n"
        "            seen.write('x')\n"
        "        calls = Path(__file__).with_name('eval_calls').stat().st_size\n"
        "        if calls == 3 and not Path(__file__).with_name('stopped').exists():\n"
        "            Path(__file__).with_name('stopped').write_text('')\n"
        "            os.kill(os.getppid(), signal.SIGTERM)\n"
        "    return 0.0\n")
    argv = tiny_run(module, tiny_model_dir, tmp_path, "--eval-interval", "1", "--eval-data-path", held_out,
                    "--eval-prompts", "2", "--reward-fn", "stop_in_eval:reward", steps=3)
    script = ROOT / "experiment_base" / "train.py"
    first = run_script(script, *argv, cwd=tmp_path)
    assert first.returncode == 130 and "saving step 1" in first.stderr, first.stderr[-2000:]
    assert tensorboard_scalars(tmp_path / "runs")["eval/accuracy"] and (tmp_path / "out" / "r" / "step_000001").is_dir()
    argv[argv.index("--run-name"):argv.index("--run-name") + 2] = ["--resume", tmp_path / "out" / "r"]
    run_main("experiment_base", argv, tmp_path)  # the resume in this process: a fresh start costs 10 s of imports
    steps = sorted(step for step, _ in tensorboard_scalars(tmp_path / "runs")["eval/accuracy"])
    assert steps == [0, 1, 2, 3]
