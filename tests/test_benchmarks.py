"""The benchmarks cannot rot: each runs once with the tiny model and tiny settings (CI does not run
them for real; their figures are in README.md)."""

import json

from conftest import ROOT, run_script, write_jsonl


def run_benchmark(tmp_path, script, *args):
    """Run benchmarks/SCRIPT with args and --json; it must succeed. Returns its output and the JSON it wrote."""
    out = tmp_path / f"{script}.json"
    result = run_script(ROOT / "benchmarks" / script, *args, "--json", out)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, json.loads(out.read_text())


def test_step_time_benchmark_runs(tiny_model_dir, tmp_path):
    stdout, table = run_benchmark(tmp_path, "step_time.py", "--model-name", tiny_model_dir, "--steps", "2",
                                  "--max-new-tokens", "8", "--dtype", "float32")
    assert "| seconds per step (median)" in stdout
    for side in ("project", "trl"):
        assert table[side]["step_seconds"] > 0 and table[side]["peak_rss_gb"] > 0
        assert len(table[side]["steps"]) == 2 and all(step["tokens"] > 0 for step in table[side]["steps"])
    assert table["ratios"]["step_seconds"] == table["project"]["step_seconds"] / table["trl"]["step_seconds"]


def test_learning_benchmark_runs(tiny_model_dir, tmp_path):
    result = run_script(ROOT / "benchmarks" / "learning.py", "--model-name", tiny_model_dir, "--steps", "2",
                        "--eval-prompts", "3", "--eval-interval", "1", "--samples", "2", "--out", tmp_path,
                        "--run-name", "smoke", "--", "--max-length", "8", "--dtype", "float32", "--group-size", "2",
                        "--rollouts-per-step", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads((tmp_path / "learning.json").read_text())
    assert figures["task"] == "sequence" and figures["steps"] == 2  # the default, as experiment_base's on CPU and figures["minutes"] > 0
    assert [step for step, _ in figures["curves"]["eval/accuracy"]] == [0, 1, 2]
    assert figures["before"]["accuracy"] == figures["curves"]["eval/accuracy"][0][1]
    assert figures["after"]["format_rate"] == figures["curves"]["eval/format_rate"][-1][1]
    held_out = (ROOT / "data" / "sequence_eval.jsonl").read_text().splitlines()[:2]
    assert [s["question"] for s in figures["samples"]] == [json.loads(line)["question"] for line in held_out]
    assert all(isinstance(s["completion"], str) and isinstance(s["correct"], bool) for s in figures["samples"])
    assert (tmp_path / "learning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_levers_benchmark_runs(tiny_model_dir, tmp_path):
    _, table = run_benchmark(tmp_path, "levers.py", "--model-name", tiny_model_dir, "--steps", "2",
                             "--max-new-tokens", "8", "--dtype", "float32", "--configs", "default", "full_logits")
    assert list(table) == ["default", "full_logits"]
    assert all(r["sampling_seconds"] > 0 and r["training_seconds"] > 0 for r in table.values())


def test_evaluate_benchmark_runs(tiny_model_dir, tmp_path):
    stdout, table = run_benchmark(tmp_path, "evaluate.py", "--model-name", tiny_model_dir, "--eval-prompts", "3",
                                  "--max-length", "8", "--dtype", "float32", "--tasks", "math", "gsm8k")
    assert table["math"]["problems"] == 3 and 0 <= table["math"]["eval/accuracy"] <= 1
    if not (ROOT / "data" / "gsm8k_test.jsonl").exists():
        assert "missing" in table["gsm8k"] and "not run" in stdout


def test_evaluate_samples_filter_and_data(tiny_model_dir, tmp_path):
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1), "kind": "easy" if i % 3 else "hard"} for i in range(9)]
    data = write_jsonl(tmp_path / "held_out.jsonl", rows)
    stdout, table = run_benchmark(tmp_path, "evaluate.py", "--model-name", tiny_model_dir, "--tasks", "gsm8k",
                                  "--data", f"gsm8k={data}", "--filter", "kind=easy", "--samples", "3", "--max-length", "6",
                                  "--dtype", "float32")
    gsm8k = table["gsm8k"]
    assert gsm8k["problems"] == 6  # the 'easy' rows of the file given with --data, not data/gsm8k_test.jsonl
    assert 0 <= gsm8k["sample_accuracy"] <= gsm8k["pass@3"] <= 1
    assert "| sampled accuracy | pass@3 |" in stdout
    bad = run_script(ROOT / "benchmarks" / "evaluate.py", "--data", "poetry=x.jsonl")
    assert bad.returncode != 0 and "unknown task" in bad.stderr


def test_retrieval_benchmark_runs(tmp_path):
    stdout, table = run_benchmark(tmp_path, "retrieval.py", "--retrievers", "bm25", "--max-questions", "80")
    bm25 = table["recall"]["bm25"]
    assert bm25["single_hop_cited"] >= 0.9 and bm25["single_hop_answer"] >= 0.9  # one search finds a single hop
    assert bm25["two_hop_answer"] < bm25["two_hop_first_cited"]  # but not, as a rule, the second hop's answer
    assert "| bm25 |" in stdout


def test_memory_estimate_runs(tmp_path):
    _, table = run_benchmark(tmp_path, "memory_estimate.py", "--tiny", "--measure-tokens", "32")
    parts = table["parts"]
    # bfloat16 KV cache of 2 layers x (K, V) x 8 heads x 64 dims: 4 KiB per token
    assert parts["kv_per_token"] == 2 * 2 * 8 * 64 * 2
    assert 0 < parts["checkpoint_per_token"] < parts["layer_recompute_per_token"]


def test_plot_runs_compares_runs(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    for run, slope in (("flat", 0.0), ("rising", 0.1)):
        with SummaryWriter(tmp_path / run) as writer:
            for step in range(1, 11):
                writer.add_scalar("rollout/reward_mean", slope * step, step)
    png = tmp_path / "runs.png"
    stdout, table = run_benchmark(tmp_path, "plot_runs.py", tmp_path / "flat", tmp_path / "rising", "--tags",
                                  "rollout/reward_mean", "--window", "2", "--out", png)
    table = table["table"]
    assert table["flat"]["rollout/reward_mean"] == [0.0, 0.0]
    first, last = table["rising"]["rollout/reward_mean"]
    assert abs(first - 0.15) < 1e-6 and abs(last - 0.95) < 1e-6  # steps 1-2 and 9-10
    assert "| rising | 10 | 0.15 -> 0.95 |" in stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = run_script(ROOT / "benchmarks" / "plot_runs.py", tmp_path / "flat", "--tags", "train/kl")
    assert missing.returncode != 0 and "train/kl" in missing.stderr


def test_gpu_run_dry_run(tmp_path):
    """The GPU kit's code path on the CPU: experiment_base's steps on a 2-layer Llama-3.2-1B of random weights, which
    never stops early (the worst case), then TRL's GRPOTrainer on the same steps, and batch sizes that fit each cap,
    fewer for a smaller one."""
    stdout, table = run_benchmark(tmp_path, "gpu_run.py", "--dry-run", "--steps", "2")
    assert [step["tokens"] for step in table["steps"]] == [2 * 2 * 8] * 2  # 2 prompts x 2 completions x 8 tokens
    # the same steps through TRL's GRPOTrainer (4-bit model, same sizes), side by side
    assert [step["tokens"] for step in table["trl"]["steps"]] == [2 * 2 * 8] * 2
    assert "| seconds per step (median) |" in stdout and table["trl"]["side_by_side"]["TRL"]["tokens_per_second"] > 0
    assert table["estimate_gb"]["sampling"] > 1 and table["estimate_gb"]["training"] > 1  # 256 x 1024 tokens, 16 trained
    sizes = [table["recommendation"][cap] for cap in ("24", "16", "12", "8")]
    for larger, smaller in zip(sizes, sizes[1:]):
        assert larger["generation_batch_size"] >= smaller["generation_batch_size"] >= 1
        assert larger["train_batch_size"] >= smaller["train_batch_size"] >= 1
    assert sizes[0]["generation_batch_size"] > sizes[-1]["generation_batch_size"]
    assert "| 8 |" in stdout
    import torch

    if not torch.cuda.is_available():
        refused = run_script(ROOT / "benchmarks" / "gpu_run.py", "--steps", "1")
        assert refused.returncode != 0 and "no CUDA device here; --dry-run" in refused.stderr
