"""Shared fixtures: a tiny Llama-architecture model built locally, and every experiment's train.py.

Nothing is downloaded. The tokenizer is character-level (plus the tags as single tokens) and has a
chat template, so prompts are formatted the way an instruct model's would be.
"""

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import load_experiment  # noqa: E402  (one loader for the tests and the benchmarks)
EXPERIMENTS = sorted(p.parent.name for p in ROOT.glob("experiment_*/train.py"))
# The experiments that train on question/answer data with the shared --task and reward options; the
# multi-turn ones have rollouts and rewards of their own and their own test files.
MULTI_TURN = {"experiment_multiturn_tool_calling", "experiment_multiturn_qa"}
TASK_EXPERIMENTS = [name for name in EXPERIMENTS if name not in MULTI_TURN]
# The experiments whose train_step is (model, batch, args, optimizer, scheduler, reference=None): one process.
SINGLE_PROCESS = [name for name in EXPERIMENTS if "accelerate" not in name]
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?+-*/=()<>_'\"\n")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# A chat template that shows the user's turn only: prompts of 30 tokens instead of 500 (the system prompt), for
# the fixtures that teach the tiny model a tool call; it makes their tests about ten times faster.
USER_ONLY_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] != 'system' %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread per process, set before torch is imported (by the test files, after this one) and inherited by each
# subprocess a test starts: the suite runs in two worker processes (pytest.ini), and most of a test is Python and
# imports, which a second thread does not speed up (README, Tests).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def build_tiny_model(folder, seed=0):
    """Save a 2-layer Llama (hidden 64) and its tokenizer to folder; returns folder."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {token: i for i, token in enumerate(special + TAGS)}
    for char in CHARS:
        vocab.setdefault(char, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # one token per character
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        additional_special_tokens=special[3:])
    tokenizer.add_tokens(TAGS)  # ordinary tokens: decoding keeps them
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, initializer_range=0.3)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def swapped(model):
    """The layers whose forward sampling_weights has replaced (an instance attribute over the class's)."""
    return sum("forward" in vars(m) for m in model.modules())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(params=EXPERIMENTS)
def experiment(request):
    """Every experiment's train.py: the contract (advantages, KL, loss, log-probs, sampling) holds in all."""
    return load_experiment(request.param)


@pytest.fixture(params=TASK_EXPERIMENTS)
def task_experiment(request):
    """The experiments that share experiment_base's tasks, rewards, data loading and command line."""
    return load_experiment(request.param)


def load_tiny(module, model_dir):
    """(module, model, tokenizer): the tiny model loaded by the module's own load_model, float32, LoRA rank 8."""
    args = module.parse_args(["--model-name", str(model_dir), "--device", "cpu", "--quantization", "none",
                              "--dtype", "float32", "--lora-r", "8"])
    model, tokenizer = module.load_model(args)
    return module, model, tokenizer


@pytest.fixture
def tiny(experiment, tiny_model_dir):
    """(module, model, tokenizer): the tiny model loaded by the experiment's own load_model, in float32."""
    return load_tiny(experiment, tiny_model_dir)


def earlier_cpu_defaults(module):
    """The options whose CPU default became the learning recipe on 2026-11-27 (temperature 0.8, beta 0, correctness
    alone), at the values the tests here were written and measured against: temperature 1, beta 0.01 where the copy's
    default is by device (experiment_drgrpo's algorithms choose their own), every reward term. Only for the copies
    that train on --task; the multi-turn ones keep their own CPU defaults. (The learning tests give their own lr.)"""
    pinned = {"temperature": "1.0", "kl_weight": "0.01", "reward_weights": ""}
    if module.EXPERIMENT not in TASK_EXPERIMENTS:
        return []
    return [x for name, value in pinned.items() if name in module.DEVICE_DEFAULTS for x in (f"--{name.replace('_', '-')}", value)]


def seven_reward(completion, answer, *args, **kwargs):
    """Reward terms whose correctness is the fraction of the completion's characters that are '7': about 1%
    for the untrained model, a task it can learn within seconds."""
    return {"correctness": completion.count("7") / max(1, len(completion)), "format": 0.0, "reasoning": 0.0}


def learn_sevens(module, model_dir, tmp_path, monkeypatch, steps, *options):
    """Train the tiny model with module.main on seven_reward for `steps` steps; returns the reward of each step.
    The prompt is fixed here, as the step counts and thresholds of these tests were measured with it (the
    instructions with the math example inline, the prompt before 2026-11-23): the tiny random model's first
    samples, and so how soon it finds the sevens, depend on it. format_prompt has tests of its own."""
    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    instructions = module.system_prompt()[:-1] + ", for example <think> 3 + 4 * 2 = 3 + 8 = 11 </think> <answer> 11 </answer>."
    monkeypatch.setattr(module, "reward_terms", seven_reward)
    monkeypatch.setattr(module, "format_prompt", lambda tokenizer, question, *args: tokenizer.apply_chat_template(
        [{"role": "system", "content": instructions}, {"role": "user", "content": question}], tokenize=False,
        add_generation_prompt=True))
    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"Say something {i}", "answer": "7"} for i in range(64)])
    module.main([
        "--model-name", str(model_dir), "--device", "cpu", "--dtype", "float32", "--data-path", str(data),
        "--max-steps", str(steps), "--group-size", "8", "--rollouts-per-step", "4", "--max-length", "8", "--lr", "3e-2",
        "--seed", "1", "--eval-interval", "0", "--checkpoint-interval", "0", "--log-completions-interval", "0",
        "--log-dir", str(tmp_path / "runs"), "--checkpoint-path", str(tmp_path / "out"), "--run-name", "learn",
        *earlier_cpu_defaults(module), *options,
    ])
    rewards = [value for _, value in sorted(tensorboard_scalars(tmp_path / "runs")["rollout/reward_mean"])]
    assert len(rewards) == steps
    return rewards


def on_most_seeds(learn, seeds=(1, 2, 3)):
    """Learning is tested on up to three seeds (or the seeds given), not one: a run is a lottery on a CPU kind whose
    float32 kernels round otherwise (experiment_base's full-precision run of seed 1 plateaued at a reward of 0.38 on a
    Sapphire Rapids Xeon and rose to 0.99 on an AMD EPYC, round five). learn(seed) trains with that seed and returns
    None when it learned, else why not. The first seed passes the test when it learns (one run: the suite's time); if
    it does not, most of the seeds must learn, outvoting it: with three, the next two both."""
    first, *others = seeds
    why = learn(first)
    if not why:
        return
    failures, needed, learned = [f"seed {first}: {why}"], len(seeds) // 2 + 1, 0
    for seed in others:
        if len(failures) > len(seeds) - needed or learned == needed:  # decided
            break
        if w := learn(seed):
            failures.append(f"seed {seed}: {w}")
        else:
            learned += 1
    assert learned >= needed, "; ".join(failures)


# The sevens are learned when the reward ends above 0.3, thirty times the untrained model's 1%: a run that fails
# collapses to empty completions and ends near 0, while one that learns ends at 0.4 to 1.0, sometimes on a plateau
# where every completion of a group is the same mix of sevens (no gradient left): 0.38 for seed 1 of experiment_base's
# full-precision run on a Sapphire Rapids Xeon, 0.49 for seed 2 on an AMD EPYC with AVX512-BF16 (round five)
SEVENS_LEARNED = 0.3


def rose(rewards, start_below=0.1, end_above=0.6, last=5):
    """None when the mean of the first three rewards is below start_below and that of the last `last` above
    end_above; else the rewards, rounded, as the reason."""
    start, end = sum(rewards[:3]) / 3, sum(rewards[-last:]) / last
    return None if start < start_below and end > end_above else f"did not rise: {[round(r, 2) for r in rewards]}"


def teach(module, model_dir, folder, examples, steps, lr=1e-2):
    """Save to folder the model at model_dir after `steps` supervised steps on the (question, target) pairs that
    examples(step) returns: cross-entropy on the target's tokens only, after module.format_prompt's prompt under
    the user-only chat template. It makes a tiny model that writes a tool call, as a pretrained one that has seen
    the format would (a random tiny model never spells one)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tokenizer.chat_template = USER_ONLY_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        questions, targets = zip(*examples(step))
        prompts = tokenizer([module.format_prompt(tokenizer, q) for q in questions], return_tensors="pt", padding=True)
        answers = tokenizer(list(targets), return_tensors="pt", padding=True, padding_side="right")
        ids = torch.cat([prompts.input_ids, answers.input_ids], 1)
        mask = torch.cat([prompts.attention_mask, answers.attention_mask], 1)
        log_probs, _ = module.sequence_log_probs(model, ids, mask, answers.input_ids.shape[1])
        loss = -log_probs.sum() / answers.attention_mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def fails_with(module, argv, capsys):
    """Run module.main(argv), expect it to stop with an error; returns everything it said."""
    import pytest

    with pytest.raises(SystemExit) as stop:
        module.main([str(a) for a in argv])
    code = stop.value.code
    assert code not in (0, None)
    return (code if isinstance(code, str) else "") + capsys.readouterr().err


def run_main(experiment, argv, cwd):
    """experiment's train.py (a folder's name, or a path) main(argv) in this process, from cwd: a start whose files
    are what a test checks (a fresh interpreter would spend about 10 s importing torch, transformers and peft); it
    must succeed."""
    with contextlib.chdir(cwd), sys_path_kept():
        load_experiment(experiment).main([str(a) for a in argv])


@contextlib.contextmanager
def sys_path_kept():
    """sys.path as it was, after a train.py loaded in this process put its checkout first (a copy's folder above)."""
    kept = list(sys.path)
    try:
        yield
    finally:
        sys.path[:] = kept


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# A subprocess's timeout in a test guards against a hang, nothing more: no test waits on the CPU's speed. The slowest
# subprocess test (the GPU kit's dry run) took 28 s on a 2-core AMD EPYC without AVX-512 (float32, 2026-11-24), so
# the default guard is 600 s; a test whose process takes longer passes its own.
HANG_GUARD_SECONDS = 600


def kill_children():
    """SIGKILL every process whose parent is this one (read from /proc): what a timed-out test started."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
            if int(fields[1]) == os.getpid():
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            pass  # gone meanwhile


def pytest_sessionstart(session):
    """Said first, even under -q: with SIGINT ignored (a background job, nohup) the runs the Ctrl-C tests start keep
    it ignored, as a run under nohup must, and those tests fail."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")  # None in xdist's workers
    if reporter is not None and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        reporter.write_line("note: SIGINT is ignored in this shell (a background job, nohup): the Ctrl-C tests will fail "
                            "here; run the suite in the foreground")


@contextlib.contextmanager
def hang_guard(what, timeout):
    """Turn a subprocess timeout inside the block into a failure that says what it is: a guard against a hang."""
    try:
        yield
    except subprocess.TimeoutExpired as e:
        kill_children()  # a run left going would take the CPU from every later test
        output = (e.stderr or b"")[-2000:]
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
        pytest.fail(f"{what} ran past {timeout} s, the guard against a hang (set well above the slowest CPU's time "
                    f"for this test): it hangs, or this machine is far slower than any measured. Its last output:\n{output}",
                    pytrace=False)


def run_command(command, timeout=HANG_GUARD_SECONDS, cwd=ROOT, env=None):
    """Run a command in a fresh process, with env added to the environment; returns the CompletedProcess (stdout
    and stderr captured). timeout is a guard against a hang (hang_guard), not a speed test."""
    command = list(map(str, command))
    with hang_guard(" ".join(command)[:300], timeout):
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})


def run_script(script, *args, timeout=HANG_GUARD_SECONDS, cwd=ROOT, env=None):
    """Run a Python script in a fresh interpreter: run_command on `python script args`."""
    return run_command([sys.executable, script, *args], timeout, cwd, env)


@functools.lru_cache(maxsize=None)
def help_text(experiment):
    """`python EXPERIMENT/train.py --help` on a wide terminal (no option's name wrapped), run once per experiment
    for the whole suite: the tests that read the help share its output instead of each starting an interpreter."""
    result = run_script(ROOT / experiment / "train.py", "--help", env={"COLUMNS": "300"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def tensorboard_scalars(log_dir):
    """{tag: [(step, value), ...]} from every event file under log_dir."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    for events in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0, "tensors": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return scalars


def write_pdf(path, pages):
    """A minimal valid PDF, one page per list of text lines (built-in Helvetica), whose text pypdf extracts."""
    objects = ["<< /Type /Catalog /Pages 2 0 R >>",
               f"<< /Type /Pages /Kids [{' '.join(f'{4 + 2 * i} 0 R' for i in range(len(pages)))}] "
               f"/Count {len(pages)} >>",
               "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    for i, lines in enumerate(pages):  # a page object, then its content stream: one text line after another
        text = " T* ".join("(" + re.sub(r"([\\()])", r"\\\1", line) + ") Tj" for line in lines)
        stream = f"BT /F1 11 Tf 14 TL 72 720 Td {text} ET"
        objects += [f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
                    f"/Contents {5 + 2 * i} 0 R >>", f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream"]
    out, offsets = "%PDF-1.4\n", []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n"
    xref = len(out)  # the cross-reference table: byte offset of every object
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n" + "".join(f"{o:010d} 00000 n \n" for o in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n"
    Path(path).write_bytes(out.encode("latin-1"))


def four_sequences():
    """A rollout batch of 4 completions of 2-5 tokens after 4 prompt tokens (two prompts' groups of 2): (ids,
    attention mask, action mask, advantages), as train_step takes it."""
    import torch

    ids = torch.randint(5, 60, (4, 9), generator=torch.Generator().manual_seed(1))
    action_mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    attention = torch.cat([torch.ones(4, 4, dtype=torch.long), action_mask], dim=1)
    return ids, attention, action_mask, torch.tensor([1.0, -1.0, 0.5, -0.5])


def rows_per_pass(module, ids, train_step, optimizer=None):
    """Run train_step() with module.sequence_log_probs spied on: the rows (indices into ids) each forward pass with
    gradients took, in order, as 3 passes of 4 rows; and, given an accelerate optimizer, how many rows had been seen
    at each of its updates."""
    import functools

    import torch

    seen, updates, real = [], [], module.sequence_log_probs

    def spy(model, input_ids, *rest, **kwargs):
        if torch.is_grad_enabled():
            seen.extend((input_ids[:, None] == ids[None]).all(-1).int().argmax(-1).tolist())
        return real(model, input_ids, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "sequence_log_probs", spy)
        if optimizer is not None:
            real_step = optimizer.optimizer.step

            @functools.wraps(real_step)  # keeps the mark LambdaLR put on it: no warning
            def counted_step(*args, **kwargs):
                updates.append(len(seen))
                return real_step(*args, **kwargs)

            patch.setattr(optimizer.optimizer, "step", counted_step)
        train_step()
    return [tuple(seen[i : i + 4]) for i in range(0, 12, 4)], updates


def assert_seeded_shuffles(first, again, later):
    """The rows of three calls of rows_per_pass (steps 7, 7 and 8): PPO's mini-batches, a new seeded shuffle each pass."""
    assert all(sorted(order) == [0, 1, 2, 3] for order in first + later)  # every sequence once a pass
    assert first == again  # the same step, the same mini-batches: a resume stays exact
    assert len(set(first + later)) > 1 and first != later  # a new shuffle per pass and per step
    groups = [{row // 2 for row in order[:2]} for order in first + later]  # the first update's rows, by prompt
    assert any(len(g) == 2 for g in groups)  # an update sees both prompts' groups
