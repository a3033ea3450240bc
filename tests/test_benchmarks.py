"""The benchmarks cannot rot: each runs once with the tiny model and tiny settings (CI does not run
them for real; their figures are in README.md)."""

import importlib
import json
import re
import os
from pathlib import Path

import pytest
from conftest import EXPERIMENTS, ROOT, load_experiment, run_script, sys_path_kept, write_jsonl
import tiny_grpo.checkpoints
import tiny_grpo.logprobs


def run_benchmark(tmp_path, script, *args, dtype=None, capsys=None):
    """Run benchmarks/SCRIPT with args and --json; it must succeed. Returns its output and the JSON it wrote. A
    benchmark that measures (given the dtype it must report) names the machine in both: a figure means little
    without the CPU it was taken on. Given capsys, its main() runs in this process instead, for a benchmark whose own
    process is not what the test checks: a fresh one spends about 10 s importing torch, transformers and peft (the
    processes the benchmark starts itself still start)."""
    out = tmp_path / f"{script}.json"
    if capsys is None:
        result = run_script(ROOT / "benchmarks" / script, *args, "--json", out)
        assert result.returncode == 0, result.stderr[-3000:]
        stdout = result.stdout
    else:
        with sys_path_kept():  # (gpu_run.py's --experiment copy puts its checkout first)
            importlib.import_module(Path(script).stem).main([*map(str, args), "--json", str(out)])
        stdout = capsys.readouterr().out
    table = json.loads(out.read_text())
    if dtype:
        assert_names_machine(stdout, table["machine"], dtype)
    return stdout, table


def assert_names_machine(stdout, where, dtype):
    """The output's machine line and the JSON's "machine": this CPU's model, cores and AVX512-BF16, and the dtype."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), None)
    flags = next((line.split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    assert where["cpu"] == cpu and where["cores"] == os.cpu_count() and where["avx512_bf16"] == ("avx512_bf16" in flags)
    assert where["dtype"].startswith(dtype)
    assert f"machine: {cpu}, {os.cpu_count()} cores, AVX512-BF16 {'yes' if where['avx512_bf16'] else 'no'}" in stdout
    import torch

    assert where["kernels"] == torch.backends.cpu.get_cpu_capability() and f"kernels {where['kernels']}" in stdout


def test_the_machine_line_names_the_kernels_and_their_caps():
    """A float32 figure taken on an AVX-512 CPU with its kernels capped (as a CPU without AVX-512 runs them) says so
    in its machine line and in the "machine" its JSON gets; without caps it names none."""
    import subprocess
    import sys

    from common import ISA_CAPS

    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); from common import machine; "
            "print('RESULT ' + json.dumps(machine('float32')))")

    def machine_in(env):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        return out, json.loads(out.rsplit("RESULT ", 1)[1])

    env = {name: value for name, value in os.environ.items() if name not in ISA_CAPS}
    plain, plain_info = machine_in(env)
    capped, capped_info = machine_in({**env, "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert "kernels DEFAULT, ATEN_CPU_CAPABILITY=default, ONEDNN_MAX_CPU_ISA=AVX2; dtype float32" in capped
    assert capped_info["kernels"] == "DEFAULT"
    assert capped_info["isa_caps"] == {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert plain_info["kernels"] != "DEFAULT" and "isa_caps" not in plain_info and "=" not in plain.split(";")[0]


def test_step_time_benchmark_runs(tiny_model_dir, tmp_path, capsys):
    stdout, table = run_benchmark(tmp_path, "step_time.py", "--model-name", tiny_model_dir, "--steps", "2",
                                  "--max-new-tokens", "8", "--dtype", "float32", "--profile", "--patience", "0",
                                  dtype="float32", capsys=capsys)  # the roofline's figures once: the other worker is busy
    assert "| seconds per step (median)" in stdout and "| training GFLOP/s" in stdout
    peak = table["matmul_peak"]["flops_per_second"]
    for side in ("project", "trl"):
        assert table[side]["step_seconds"] > 0 and table[side]["peak_rss_gb"] > 0
        assert len(table[side]["steps"]) == 2 and all(step["tokens"] > 0 for step in table[side]["steps"])
        measured = table[side]["steps"][1]  # the FLOP/s of the step after the warm-up, over its seconds not sampling
        flops = measured["training_flops"] / (measured["seconds"] - measured["sampling_seconds"])
        assert table[side]["training_flops_per_second"] == pytest.approx(flops)
        assert table[side]["share_of_peak"] == pytest.approx(flops / peak)
    assert table["ratios"]["step_seconds"] == table["project"]["step_seconds"] / table["trl"]["step_seconds"]
    for step in table["project"]["steps"]:  # beta 0: the FLOPs of the completions that ran, none where none ran
        assert 0 <= step["trained"] <= step["completions"] == 16 and (step["training_flops"] == 0) == (step["trained"] == 0)
    profile = table["project"]["profile"]
    assert "aten::" in profile["table"] and "Self CPU" in stdout  # the profiler's table, by operator
    assert 0 <= profile["matmul_seconds"] < profile["operator_seconds"]
    assert profile["matmul_share"] == profile["matmul_seconds"] / profile["operator_seconds"]
    if profile["training_flops"]:  # the step trained a row (beta 0 trains none of a group of equal rewards)
        rate = profile["training_flops"] / profile["matmul_seconds"]
        assert profile["matmul_seconds"] > 0 and profile["matmul_share_of_peak"] == pytest.approx(rate / peak)
    assert_roofline(table, table["project"]["steps"], stdout)  # the project's, measured after both sides


def test_sampling_benchmark_times_the_same_tokens_both_ways(tiny_model_dir, tmp_path):
    stdout, table = run_benchmark(tmp_path, "sampling.py", "--model-name", tiny_model_dir, "--max-new-tokens", "12",
                                  "--repeats", "1", "--dtype", "float32", dtype="float32")
    assert "| dropped |" in stdout and "| kept |" in stdout
    assert table["dropped"]["ratio_to_kept"] == table["dropped"]["seconds"] / table["kept"]["seconds"]
    assert len(table["completion_lengths"]) == 16 and table["tokens"] == sum(table["completion_lengths"])
    assert table["dropped"]["completions_unlike_kept"] == table["kept"]["completions_unlike_kept"] == 0  # float32
    assert table["dropped"]["tokens"] == table["tokens"]


def test_sampling_benchmark_switches_the_packed_weights(tiny_model_dir, tmp_path):
    """--lever packed: the plain products against the weights packed for oneDNN, both timed on the same tokens
    where the products are the same bits (test_onednn.py); bfloat16, the only dtype packed."""
    stdout, table = run_benchmark(tmp_path, "sampling.py", "--model-name", tiny_model_dir, "--max-new-tokens", "12",
                                  "--repeats", "1", "--dtype", "bfloat16", "--lever", "packed", dtype="bfloat16")
    assert "| products |" in stdout and "| plain |" in stdout and "| packed |" in stdout and "| kept |" not in stdout
    assert table["packed"]["ratio_to_plain"] == table["packed"]["seconds"] / table["plain"]["seconds"]
    assert table["plain"]["completions_unlike_plain"] == 0 and 0 <= table["packed"]["completions_unlike_plain"] <= 16


def test_learning_benchmark_runs(tiny_model_dir, tmp_path):
    """Two seeds through experiment_drgrpo (experiment_base, the default, differs only in the path and the recipe's
    beta, tested below), its algorithm given after --."""
    result = run_script(ROOT / "benchmarks" / "learning.py", "--model-name", tiny_model_dir, "--steps", "1",
                        "--eval-prompts", "3", "--eval-interval", "1", "--samples", "2", "--out", tmp_path, "--seeds", "2",
                        "--run-name", "smoke", "--experiment", "experiment_drgrpo", "--", "--algorithm", "gspo",
                        "--max-length", "8", "--dtype", "float32", "--group-size", "2", "--rollouts-per-step", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads((tmp_path / "learning.json").read_text())
    assert figures["task"] == "sequence" and figures["steps"] == 1  # the default, as experiment_base's on CPU
    assert figures["experiment"] == "experiment_drgrpo"
    runs = figures["runs"]
    assert [run["seed"] for run in runs] == [42, 43] and all(run["minutes"] > 0 for run in runs)
    for run in runs:  # each seed's own curve, from its own TensorBoard folder
        assert run["command"][1] == str(ROOT / "experiment_drgrpo" / "train.py") and "--algorithm" in run["command"]
        assert "train/clip_high_fraction" in run["curves"]  # the drgrpo copy's own metrics
        assert [step for step, _ in run["curves"]["eval/accuracy"]] == [0, 1]
        assert run["before"]["accuracy"] == run["curves"]["eval/accuracy"][0][1]
        assert run["after"]["format_rate"] == run["curves"]["eval/format_rate"][-1][1]
        assert run["gain"] == run["after"]["accuracy"] - run["before"]["accuracy"]
        assert "--seed" in run["command"] and run["command"][run["command"].index("--seed") + 1] == str(run["seed"])
        held_out = (ROOT / "data" / "sequence_eval.jsonl").read_text().splitlines()[:2]
        assert [s["question"] for s in run["samples"]] == [json.loads(line)["question"] for line in held_out]
        assert all(isinstance(s["completion"], str) and isinstance(s["correct"], bool) for s in run["samples"])
        assert run["reasoning"]["right"] == sum(s["correct"] for s in run["samples"])
    gains = sorted(run["gain"] for run in runs)
    assert figures["summary"]["gain"] == {"min": gains[0], "median": sum(gains) / 2, "max": gains[1]}
    assert "| seed | accuracy before |" in result.stdout and "gain over 2 seed(s)" in result.stdout
    assert (tmp_path / "learning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_names_machine(result.stdout, figures["machine"], "float32")  # the --dtype given after --


def algorithm_run(algorithm, steps, kl, lengths):
    """A learning.json as learning.py writes it for one experiment_drgrpo run, its curves made up."""
    command = ["python", "experiment_drgrpo/train.py", "--max-steps", str(steps), "--eval-interval", "5", "--eval-prompts",
               "100", "--seed", "42", "--rollouts-per-step", "8", "--group-size", "8", "--algorithm", algorithm, "--log-kl"]
    curves = {"eval/accuracy": [(0, 0.02), (5, 0.3), (10, 0.5)], "rollout/reward_mean": [(1, 0.0), (10, 0.4)],
              "perf/step_seconds": [(1, 30.0), (10, 50.0)], "train/kl": [(1, 0.0), (10, kl)],
              "train/clip_fraction": [(1, 0.0), (10, 0.02)], "train/clip_low_fraction": [(1, 0.0), (10, 0.004)],
              "train/clip_high_fraction": [(1, 0.0), (10, 0.016)], "rollout/completion_length": list(enumerate(lengths, 1)),
              "rollout/zero_spread_groups": [(1, 1.0), (10, 0.5)]}
    run = {"seed": 42, "before": {"accuracy": 0.02}, "after": {"accuracy": 0.5}, "gain": 0.48, "minutes": 9.5,
           "samples": [{"correct": True}, {"correct": False}, {"correct": True}], "curves": curves, "command": command}
    return {"experiment": "experiment_drgrpo", "machine": {"cpu": "a CPU", "cores": 2, "dtype": "bfloat16"}, "runs": [run]}


def test_algorithms_benchmark_tables_the_runs_it_finds(tmp_path, capsys):
    """benchmarks/algorithms.py reads each algorithm's learning.json instead of running it again, and tables what the
    issue asks of the comparison; a learning.json from other settings stops it rather than being mixed in. In this
    process (main(), not a fresh one), for the suite's time."""
    from common import load_module

    algorithms = load_module(ROOT / "benchmarks" / "algorithms.py")
    for algorithm, kl, lengths in (("grpo", 0.0123, [60.0, 50.0, 41.0]), ("dapo", 0.5, [58.0, 80.0])):
        (tmp_path / algorithm).mkdir()
        (tmp_path / algorithm / "learning.json").write_text(json.dumps(algorithm_run(algorithm, 10, kl, lengths)))
    algorithms.main(["--algorithms", "grpo", "dapo", "--out", str(tmp_path)])
    table = json.loads((tmp_path / "algorithms.json").read_text())
    grpo, dapo = table["rows"]
    assert grpo["kl_at_end"] == 0.0123 and dapo["completion_length"] == [58.0, 80.0]
    assert grpo["step_seconds"] == 40.0 and grpo["clip_high_fraction"] == 0.008 and grpo["equal_reward_groups"] == 0.75
    assert "| grpo | 2% | 50% | +48% | 9.5 | 40 | 0.0123 | 0.010 (0.002 / 0.008) | 60 -> 41 | 75% | 2 of 3 |" in capsys.readouterr().out
    assert (tmp_path / "algorithms.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "dapo" / "learning.json").write_text(json.dumps(algorithm_run("dapo", 20, 0.5, [58.0])))
    with pytest.raises(SystemExit, match="dapo.*--max-steps 20, not 10"):
        algorithms.main(["--algorithms", "grpo", "dapo", "--out", str(tmp_path)])
    command = algorithms.learning_command(algorithms.parse_args(["--out", str(tmp_path), "--", "--dtype", "float32"]), "cispo")
    assert command[1].endswith("learning.py") and command[command.index("--") + 1:] == ["--algorithm", "cispo", "--log-kl",
                                                                                       "--dtype", "float32"]


def test_the_learning_recipe_comes_before_the_users_options():
    """The demo's recipe on sequence is train.py's CPU defaults (issue 61: the main command learns): 8 prompts x 8
    completions at T 0.35 (experiment_drgrpo's algorithms, measured at 0.8, keep it), correctness and format at 0.1
    (experiment_drgrpo: correctness alone), beta 0 in experiment_base only (experiment_drgrpo's algorithms choose their
    own); learning.py adds nothing on sequence, and anything after -- wins."""
    from common import load_module

    learning = load_module(ROOT / "benchmarks" / "learning.py")
    assert learning.parse_args([]).experiment == "experiment_base" and learning.parse_args([]).steps == 30
    assert learning.parse_args(["--experiment", "experiment_drgrpo"]).steps == 20  # each train.py's own CPU default
    assert learning.recipe("sequence", "experiment_base") == [] == learning.recipe("sequence", "experiment_drgrpo")
    base, drgrpo = load_experiment(), load_experiment("experiment_drgrpo")
    options = base.parse_args(["--device", "cpu"])
    assert (options.task, options.group_size, options.rollouts_per_step, options.max_steps) == ("sequence", 8, 8, 30)
    assert options.kl_weight == 0 and options.temperature == 0.35 and options.lr == 5e-5 and options.eval_prompts == 100
    assert base.Scorer("sequence", weights=options.reward_weights).weights == {"correctness": 1, "format": 0.1, "reasoning": 0}
    options = base.parse_args(["--device", "cpu", "--group-size", "3", "--kl-weight", "0.1", "--rollouts-per-step", "4",
                               "--temperature", "1"])
    assert options.group_size == 3 and options.kl_weight == 0.1 and options.rollouts_per_step == 4 and options.temperature == 1
    for algorithm, beta in [("grpo", 0.01), ("reinforce_pp", 0.01), ("dapo", 0.0)]:
        options = drgrpo.parse_args(["--device", "cpu", "--algorithm", algorithm])
        assert options.kl_weight == beta and options.group_size == 8 and options.rollouts_per_step == 8 and options.temperature == 0.8
        assert drgrpo.Scorer("sequence", weights=options.reward_weights).weights == {"correctness": 1, "format": 0, "reasoning": 0}
    assert "--filter" in learning.recipe("math", "experiment_drgrpo") and learning.recipe("count_words", "experiment_base") == []


@pytest.mark.parametrize("completion, faithful", [
    ("each number is 4 more than the one before; the last is 32, and 32 + 4 = 36 </think> <answer>36</answer>", True),
    ("each number is 4 more than the one before; the last is 32, and 4 + 32 = 36 </think> <answer>36</answer>", True),
    ("each number is 20 more than the one before; the last is 32, and 32 + 20 = 36 </think> <answer>36</answer>", False),
    ("each number is 4 more than the one before; the last is 28, and 28 + 4 = 32 </think> <answer>36</answer>", False),
    ("each number is 4 more than the one before; the last is 32, and 32 + 4 = 38 </think> <answer>36</answer>", False),
    ("the next is 36 </think> <answer>36</answer>", False),
], ids=["true", "sum-reversed", "first-term-as-step", "wrong-last-term", "false-sum", "no-reasoning"])
def test_the_reasoning_checker_wants_the_true_step_and_a_true_last_sum(completion, faithful):
    from common import load_module

    learning = load_module(ROOT / "benchmarks" / "learning.py")
    assert learning.faithful("What number comes next: 20, 24, 28, 32, ...?", completion) is faithful


def test_levers_benchmark_runs(tiny_model_dir, tmp_path, capsys):
    """Two configurations, each in a process of its own (a third would only cost another start)."""
    _, table = run_benchmark(tmp_path, "levers.py", "--model-name", tiny_model_dir, "--steps", "2",
                             "--max-new-tokens", "8", "--dtype", "float32", "--configs", "default", "autograd_head",
                             dtype="float32", capsys=capsys)
    configs = {name: figures for name, figures in table.items() if name != "machine"}
    assert list(configs) == ["default", "autograd_head"]
    assert all(r["sampling_seconds"] > 0 and r["training_seconds"] > 0 for r in configs.values())


def test_evaluate_benchmark_runs(tiny_model_dir, tmp_path, capsys):
    stdout, table = run_benchmark(tmp_path, "evaluate.py", "--model-name", tiny_model_dir, "--eval-prompts", "3",
                                  "--max-length", "8", "--dtype", "float32", "--tasks", "math", "gsm8k", dtype="float32",
                                  capsys=capsys)
    assert table["math"]["problems"] == 3 and 0 <= table["math"]["eval/accuracy"] <= 1
    assert "cannot reach the Hugging Face hub" in table["gsm8k"]["missing"] and "not run" in stdout  # offline: said, the rest run


def test_evaluate_samples_filter_and_data(tiny_model_dir, tmp_path, capsys):
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1), "kind": "easy" if i % 3 else "hard"} for i in range(9)]
    data = write_jsonl(tmp_path / "held_out.jsonl", rows)
    stdout, table = run_benchmark(tmp_path, "evaluate.py", "--model-name", tiny_model_dir, "--tasks", "gsm8k",
                                  "--data", f"gsm8k={data}", "--filter", "kind=easy", "--samples", "3", "--max-length", "6",
                                  "--dtype", "float32", capsys=capsys)
    gsm8k = table["gsm8k"]
    assert gsm8k["problems"] == 6  # the 'easy' rows of the file given with --data, not openai/gsm8k's test split
    assert 0 <= gsm8k["sample_accuracy"] <= gsm8k["pass@3"] <= 1
    assert "| sampled accuracy | pass@3 |" in stdout
    import evaluate

    with pytest.raises(SystemExit) as stopped:
        evaluate.main(["--data", "poetry=x.jsonl"])
    assert stopped.value.code != 0 and "unknown task" in capsys.readouterr().err


def test_retrieval_benchmark_runs(tmp_path):
    stdout, table = run_benchmark(tmp_path, "retrieval.py", "--retrievers", "bm25", "--max-questions", "80",
                                  dtype="float32")
    bm25 = table["recall"]["bm25"]
    assert bm25["single_hop_cited"] >= 0.9 and bm25["single_hop_answer"] >= 0.9  # one search finds a single hop
    assert bm25["two_hop_answer"] < bm25["two_hop_first_cited"]  # but not, as a rule, the second hop's answer
    assert "| bm25 |" in stdout


def test_memory_estimate_runs(tmp_path, capsys):
    _, table = run_benchmark(tmp_path, "memory_estimate.py", "--tiny", "--measure-tokens", "32", dtype="bfloat16",
                             capsys=capsys)
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


def test_gpu_run_dry_run(tmp_path, capsys):
    """The GPU kit's code path on the CPU, in this process (a fresh one spends about 10 s importing): experiment_base's
    step on a 2-layer Llama of small widths and random weights, which never stops early (the worst case), and batch
    sizes that fit each cap, fewer for a smaller one (estimated from Llama-3.2-1B's own shapes). For a lease's
    before/after in one command, --experiment runs an older copy of train.py placed in a folder (here one that leaves
    a mark as it loads), --evaluate times its step-0 held-out evaluation first (greedy, one completion per problem),
    and each step's figures are printed as it ends, so that a command stopped by the lease's time limit keeps them.
    TRL's GRPOTrainer on the same steps, side by side: gpu_check.sh's dry run runs it (tests/test_gpu_check.py)."""
    import gpu_run
    import torch

    copy = tmp_path / "older"
    copy.mkdir()
    source = (ROOT / "experiment_base" / "train.py").read_text()
    marked = source.replace("@torch.no_grad()\ndef rollout(", "print('the older copy runs')\n\n@torch.no_grad()\ndef rollout(", 1)
    assert marked != source
    (copy / "train.py").write_text(marked)
    stdout, table = run_benchmark(tmp_path, "gpu_run.py", "--dry-run", "--steps", "1", "--skip-trl", "--evaluate",
                                  "--experiment", copy, dtype="bfloat16", capsys=capsys)
    assert "the older copy runs" in stdout and [step["tokens"] for step in table["steps"]] == [2 * 2 * 8]  # 2 x 2 x 8 tokens
    assert re.search(r"^step 1: \{.*\"tokens\": 32", stdout, re.M) and "the step-0 evaluation: 2 held-out problems" in stdout
    evaluation = table["steps"][0]["evaluation"]
    assert evaluation["rows"] == 2 and evaluation["tokens"] == 2 * 8 and evaluation["seconds"] > 0  # 2 problems x 8 tokens
    assert "eval/accuracy" in evaluation and table["trl"] is None
    assert table["estimate_gb"]["sampling"] > 1 and table["estimate_gb"]["training"] > 1  # 256 x 512 tokens, 16 trained
    sizes = [table["recommendation"][cap] for cap in ("24", "16", "12", "8")]
    for larger, smaller in zip(sizes, sizes[1:]):
        assert larger["generation_batch_size"] >= smaller["generation_batch_size"] >= 1
        assert larger["train_batch_size"] >= smaller["train_batch_size"] >= 1
    assert sizes[0]["generation_batch_size"] > sizes[-1]["generation_batch_size"]
    assert "| 8 |" in stdout
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device here; --dry-run"):
            gpu_run.main(["--steps", "1"])


def test_evaluate_takes_the_checkpoints_own_adapter_shape(tiny_model_dir, tmp_path, capsys):
    """--checkpoint of a missing folder failed after the model had loaded; a checkpoint trained with another
    --lora-r or --lora-alpha was loaded into an r=16, alpha=32 adapter (a size mismatch, or silently the wrong scale).
    Now a missing one is refused first, a run folder gives its newest step, and the adapter is built as saved."""
    from common import load_module
    from conftest import write_jsonl

    missing = run_script(ROOT / "benchmarks" / "evaluate.py", "--checkpoint", tmp_path / "nowhere", timeout=60)
    assert missing.returncode == 2 and "--checkpoint" in missing.stderr and "no such folder" in missing.stderr
    data = write_jsonl(tmp_path / "tasks.jsonl", [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)])
    base = load_experiment()
    base.main(["--model-name", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--data-path", str(data),
               "--max-steps", "1", "--group-size", "2", "--rollouts-per-step", "2", "--max-length", "4",
               "--eval-interval", "0", "--lora-r", "4", "--lora-alpha", "64", "--log-dir", str(tmp_path / "runs"),
               "--checkpoint-path", str(tmp_path / "out"), "--run-name", "alpha64"])
    evaluate = load_module(ROOT / "benchmarks" / "evaluate.py")
    args = evaluate.parse_args(["--checkpoint", str(tmp_path / "out" / "alpha64")])
    assert args.checkpoint.name == "step_000001" and args.lora_options == ["--lora-r", "4", "--lora-alpha", "64"]
    capsys.readouterr()
    evaluate.main(["--model-name", str(tiny_model_dir), "--checkpoint", str(tmp_path / "out" / "alpha64"), "--tasks", "gsm8k",
                   "--data", f"gsm8k={data}", "--max-length", "4", "--dtype", "float32", "--json", str(tmp_path / "e.json")])
    table = json.loads((tmp_path / "e.json").read_text())
    assert table["gsm8k"]["problems"] == 4 and "newest checkpoint of that run, step_000001" in capsys.readouterr().out

    # issue 59: an adapter cut short, or missing tensors, gave a traceback after the model loaded, or evaluated a
    # fresh LoRA in silence; now a message, before the model loads where the file says so
    from safetensors.torch import load_file, save_file

    file = tmp_path / "out" / "alpha64" / "step_000001" / "adapter_model.safetensors"
    whole = file.read_bytes()
    file.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(SystemExit):
        evaluate.parse_args(["--checkpoint", str(file.parent)])
    assert "adapter_model.safetensors is damaged" in capsys.readouterr().err
    file.write_bytes(whole)
    weights = load_file(file)
    save_file({name: weights[name] for name in sorted(weights)[:1]}, file)
    with pytest.raises(SystemExit) as stop:
        evaluate.main(["--model-name", str(tiny_model_dir), "--checkpoint", str(file.parent), "--tasks", "gsm8k",
                       "--data", f"gsm8k={data}", "--max-length", "4", "--dtype", "float32"])
    assert f"its weights do not match this model: {len(weights) - 1} missing" in str(stop.value.code)


@pytest.mark.parametrize("shared", [False, True])
def test_training_flops_count_what_a_forward_pass_multiplies(tiny_model_dir, shared):
    """common.forward_flops (the unit of step_time's training FLOP/s) against PyTorch's FLOP counter on a real
    forward pass of sequence_log_probs: every matrix multiply of the body's linear layers, LoRA's two factors and the
    output layer on the action tokens alone, exactly (attention's products are counted apart, causal). Three rows of
    one prompt (shared) are one packed sequence: the prompt's tokens are multiplied once, and counted once. A
    training pass counts the output layer twice (its forward pass forms the gradient; measured here too), the rest
    three times (forward, recomputation, input gradients) and LoRA once more (its weight gradients)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from common import forward_flops, spied_packing, training_flops
    from conftest import load_tiny

    base, model, _ = load_tiny(load_experiment(), tiny_model_dir)
    ids = torch.randint(5, 60, (3, 12), generator=torch.Generator().manual_seed(0))
    if shared:
        ids[1:, :7] = ids[0, :7]
    passes = []
    with torch.no_grad(), FlopCounterMode(display=False) as counter, spied_packing(base, passes):
        base.sequence_log_probs(model, ids, torch.ones(3, 12, dtype=torch.long), 5)  # 7 prompt and 5 action tokens each
    measured = counter.get_flop_counts()["Global"]
    assert {str(op) for op in measured} == {"aten.mm"}  # SDPA's products are not in the counter on the CPU
    repeated = [False, shared, shared]
    assert passes == [([7] * 3, [5] * 3, repeated, False)]
    r = model.peft_config["default"].r
    body, head, adapter = forward_flops(model.config, r, [7] * 3, [5] * 3, repeated)
    c = model.config
    pairs = 3 * (12 * 13 // 2) - (2 * (7 * 8 // 2) if shared else 0)  # the prompt attends to itself once
    attention = 4 * c.num_hidden_layers * c.hidden_size * pairs  # heads x head_dim = hidden here
    assert body - attention + head + adapter == sum(measured.values())
    assert training_flops(model.config, r, [7] * 3, [5] * 3, repeated=repeated) == 3 * body + 2 * head + 4 * adapter
    # the output layer in a training pass under LoRA: its product and d log pi / dh's in the forward, none after
    hidden = torch.randn(15, c.hidden_size, requires_grad=True)
    weight = tiny_grpo.logprobs.output_layer(model)[0].weight
    with FlopCounterMode(display=False) as counter:
        log_probs, _ = tiny_grpo.logprobs.ActionLogProb.apply(hidden, weight, None, torch.arange(15), None, 1.0,
                                                tiny_grpo.logprobs.output_workspace(15, weight))
        forward = sum(counter.get_flop_counts()["Global"].values())
        log_probs.sum().backward()
    assert forward == sum(counter.get_flop_counts()["Global"].values()) == 2 * head


# -- Nothing lost, round three (issue 59)

# (module, option, what it names: a file or a folder) for every benchmark option that says where to write
OUTPUTS = [("step_time", "--json", "file"), ("levers", "--json", "file"), ("sampling", "--json", "file"),
           ("evaluate", "--json", "file"), ("gpu_run", "--json", "file"), ("memory_estimate", "--json", "file"),
           ("retrieval", "--json", "file"), ("plot_runs", "--json", "file"), ("plot_runs", "--out", "file"),
           ("learning", "--figure", "file"), ("learning", "--out", "folder"), ("algorithms", "--out", "folder")]


@pytest.mark.parametrize("script, option, kind", OUTPUTS, ids=[f"{s}{o}" for s, o, _ in OUTPUTS])
def test_an_output_path_that_cannot_be_written_is_refused_first(script, option, kind, tmp_path, capsys):
    """A folder given as --json's file, a path through a file, a place nobody may write: each was found only when the
    results were written, after the work, with a traceback. Now the options refuse them, in one line naming them."""
    import importlib

    module = importlib.import_module(script)
    (tmp_path / "notes.txt").write_text("a file")
    bad = [(tmp_path / "notes.txt" / "x.json", "is a file, not a folder"), (Path("/proc/tiny-grpo/x"), "cannot create")]
    bad += [(tmp_path, "is a folder")] if kind == "file" else [(tmp_path / "notes.txt", "is a file, not a folder")]
    runs = [str(tmp_path)] if script == "plot_runs" else []  # its positional run folders
    for path, message in bad:
        with pytest.raises(SystemExit) as stop:
            module.parse_args([*runs, option, str(path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and f"error: argument {option}: " in err[-1] and message in err[-1], (path, err)
    assert module.parse_args([*runs, option, str(tmp_path / "new" / "folder" / "x.json")])  # made when written


def test_evaluate_refuses_a_bad_value_with_its_own_usage(capsys):
    """evaluate.py handed --eval-prompts, --max-length, --dtype and --generation-batch-size on to train.py's parser,
    which refused a bad one with train.py's usage (--rollouts-per-step, --lr, ...) under evaluate.py's name."""
    result = run_script(ROOT / "benchmarks" / "evaluate.py", "--eval-prompts", "0", timeout=120)
    assert result.returncode == 2 and "usage: evaluate.py" in result.stderr and "--rollouts-per-step" not in result.stderr
    assert "argument --eval-prompts: must be an integer in [1, inf), got 0" in result.stderr
    import evaluate

    for option, value in ("--max-length", "-1"), ("--dtype", "float8"), ("--generation-batch-size", "0"):
        with pytest.raises(SystemExit):
            evaluate.parse_args([option, value])
        assert f"error: argument {option}: " in capsys.readouterr().err


def test_plot_runs_names_an_event_file_cut_short(tmp_path, capsys):
    """An event file cut short (a copy stopped half-way, a disk full) was read silently up to the cut: a cut in the
    first records gave 'no run logged rollout/reward_mean', blaming --tags; a cut in the last one lost its steps
    without a word. Now the file is named, cut short or damaged, and where."""
    import plot_runs
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(tmp_path / "whole") as writer:
        for step in range(1, 11):
            writer.add_scalar("rollout/reward_mean", step / 10, step)
    events = next((tmp_path / "whole").glob("events.out.tfevents.*"))
    data = events.read_bytes()
    for name, cut in ("early", 60), ("late", len(data) - 5):
        (tmp_path / name).mkdir()
        (tmp_path / name / events.name).write_bytes(data[:cut])
    with pytest.raises(SystemExit) as stop:
        plot_runs.main([str(tmp_path / "early"), "--tags", "rollout/reward_mean"])
    assert str(tmp_path / "early" / events.name) in str(stop.value.code) and "cut short" in str(stop.value.code)
    capsys.readouterr()
    plot_runs.main([str(tmp_path / "late"), "--tags", "rollout/reward_mean", "--json", str(tmp_path / "new" / "t.json")])
    out, err = capsys.readouterr()
    assert f"warning: {tmp_path / 'late' / events.name} is cut short or damaged" in err and "| late | 9 |" in out
    assert json.loads((tmp_path / "new" / "t.json").read_text())["table"]["late"]  # a new folder for --json: made


def test_sampling_refuses_shares_it_cannot_compare(capsys):
    """--shares nan -5 was taken: nan never drops a row (a comparison with nan is false) and -5 drops at every token,
    both reported as 'dropped at ...'. A share is the part of the batch that has ended: from 0 to 1."""
    import sampling

    for value in "nan", "-5", "inf", "1.5":
        with pytest.raises(SystemExit):
            sampling.parse_args(["--shares", "0.25", value])
        assert "error: argument --shares: " in capsys.readouterr().err
    assert sampling.parse_args(["--shares", "0", "0.5", "1"]).shares == [0, 0.5, 1]


@pytest.mark.parametrize("experiment_name", EXPERIMENTS)
def test_sampling_weights_4bit_needs_4bit_weights(experiment_name, capsys):
    """Every train.py: --sampling-weights 4bit with --quantization none was taken without a word (there are no 4-bit
    weights to sample from), while --sampling-weights dequantized was refused. Both are refused the same way."""
    module = load_experiment(experiment_name)
    with pytest.raises(SystemExit):
        module.parse_args(["--device", "cpu", "--sampling-weights", "4bit", "--quantization", "none"])
    assert "--sampling-weights 4bit needs --quantization 4bit (it is none)" in capsys.readouterr().err


def test_same_run_tells_a_changed_computation_from_a_moved_one(tmp_path):
    """benchmarks/same_run.py, the restructures' equality check, fingerprints two steps of a copy: a copy whose code
    only moved (a function defined elsewhere, a comment changed) gives the original's fingerprints, one whose loss
    changed by one part in 10,000 gives other weights."""
    source = (ROOT / "experiment_base" / "train.py").read_text()
    moved, changed = (tmp_path / kind / "experiment_base" for kind in ("moved", "changed"))
    for folder in (moved, changed):
        folder.mkdir(parents=True)
    masked_mean = source[source.index("def masked_mean("):source.index("def sequence_log_probs(")]
    relocated = source.replace(masked_mean, "").replace('\nif __name__ == "__main__":', f"\n{masked_mean}\nif __name__ == \"__main__\":")
    assert relocated != source and relocated.count("def masked_mean(") == 1
    comment = "# [B, 1]: one advantage for every token of a completion"
    assert relocated.count(comment) == 1
    (moved / "train.py").write_text(relocated.replace(comment, "# [B, 1]: a completion's advantage, at each token"))
    ratio = "ratio = (log_probs - old_log_probs).exp()"
    assert source.count(ratio) == 1
    (changed / "train.py").write_text(source.replace(ratio, ratio + " * 1.0001"))
    result = run_script(ROOT / "benchmarks" / "same_run.py", ROOT / "experiment_base", moved, changed)
    assert result.returncode == 0, result.stderr[-3000:]
    found = re.findall(r": completions (\w{16})  weights (\w{16})$", result.stdout, re.MULTILINE)
    assert len(found) == 3
    assert found[0] == found[1] and found[2][1] != found[0][1]


# -- Nothing lost, round four (issue 71)

def write_events(folder, start, steps, value, purge_step=None):
    """rollout/reward_mean = value at each of steps, written by SummaryWriter (with purge_step, as train.py's Logger
    writes a resumed run's) into an event file of folder named as a start at time `start` is (TensorBoard reads a
    folder's files in the order of their names, which begin with the time)."""
    from torch.utils.tensorboard import SummaryWriter

    staging = folder.parent / f".staging-{start}"
    with SummaryWriter(staging, purge_step=purge_step) as writer:
        for step in steps:
            writer.add_scalar("rollout/reward_mean", value, step)
    folder.mkdir(parents=True, exist_ok=True)
    (events,) = staging.iterdir()
    events.rename(folder / f"events.out.tfevents.{start}.host.1.0")
    staging.rmdir()


def test_curves_are_the_run_as_tensorboard_loads_it(tmp_path, capsys):
    """Item 8: common.scalars read every event file under a run folder on its own: an earlier start's events, moved
    aside to superseded-*/, and the steps after the checkpoint that a resume purged (train.py's Logger: purge_step)
    were taken for the run's, and plot_runs.py and learning.py reported them. Now a folder is one run, loaded as
    TensorBoard loads it: its own event files in order, purge_step applied; a subfolder is no part of it."""
    import plot_runs
    from common import scalars

    run = tmp_path / "runs" / "run"
    write_events(run / "superseded-20260101-000000", 1000000000, range(1, 13), 9.0)  # a start that saved nothing
    write_events(run, 1000000100, range(1, 11), 1.0)  # steps 1-10, the last checkpoint at 5, then a crash
    write_events(run, 1000000200, range(6, 9), 2.0, purge_step=6)  # --resume from step 5: steps 6-8 again
    assert scalars(run) == {"rollout/reward_mean": [(s, 1.0) for s in range(1, 6)] + [(s, 2.0) for s in range(6, 9)]}
    plot_runs.main([str(run), "--tags", "rollout/reward_mean", "--window", "1"])
    assert "| run | 8 | 1.00 -> 2.00 |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:  # the log root: its runs are in subfolders, each a run of its own
        plot_runs.main([str(tmp_path / "runs"), "--tags", "rollout/reward_mean"])
    assert f"no TensorBoard event files in {tmp_path / 'runs'}" in str(stop.value.code)


def test_learning_refuses_the_options_it_sets_itself(capsys):
    """Item 14: `learning.py -- --max-steps 2` trained, and then found no step_000020 to sample from: no results
    written. Each train.py option that learning.py sets itself is refused after --, in any spelling train.py's parser
    takes (OPTION=VALUE, a prefix), in one line naming it, before any training."""
    from common import load_module

    learning = load_module(ROOT / "benchmarks" / "learning.py")
    for given, option in [("--max-steps", "--max-steps"), ("--max-steps=2", "--max-steps"), ("--max-st", "--max-steps"),
                          ("--eval-interval", "--eval-interval"), ("--run-name", "--run-name"), ("--seed", "--seed"),
                          ("--checkpoint-path", "--checkpoint-path"), ("--log-dir=x", "--log-dir"),
                          ("--keep-checkpoints", "--keep-checkpoints"), ("--eval-prompts", "--eval-prompts"),
                          ("--model-name", "--model-name"), ("--task", "--task")]:
        with pytest.raises(SystemExit) as stop:
            learning.parse_args(["--", given, "2"])
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and f"error: {given} after --: " in err[-1] and f"{option} itself" in err[-1], err
    assert learning.parse_args(["--", "--max-length", "8", "--checkpoint-interval", "5"]).train_args[0] == "--max-length"


def test_same_run_refuses_a_folder_without_train_py_first(tmp_path):
    """Item 14: benchmarks/same_run.py on a folder holding no train.py built the tiny model, then gave a traceback.
    Now one line names the folder, before the model is built."""
    result = run_script(ROOT / "benchmarks" / "same_run.py", ROOT / "experiment_base", tmp_path / "experiment_base",
                        timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].endswith(f"{tmp_path / 'experiment_base'}: no train.py in it")
    assert "completions" not in result.stdout  # not even the first folder was run


TRAINED = ["--device", "cpu", "--dtype", "float32", "--max-steps", "1", "--group-size", "2", "--rollouts-per-step",
           "2", "--max-length", "4", "--eval-interval", "0", "--lora-r", "4"]


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, tmp_path_factory):
    """(experiment_base's run folder holding step_000001, one step of the tiny model; its options): copy it to change it."""
    tmp = tmp_path_factory.mktemp("trained")
    data = write_jsonl(tmp / "tasks.jsonl", [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)])
    options = ["--model-name", str(tiny_model_dir), "--data-path", str(data), *TRAINED]
    load_experiment().main([*options, "--log-dir", str(tmp / "runs"), "--checkpoint-path", str(tmp / "out"),
                            "--run-name", "run"])
    return tmp / "out" / "run", options


def test_evaluate_passes_over_a_damaged_newest_step_as_resume_does(trained_run, tmp_path, capsys):
    """Poor: evaluate.py --checkpoint RUN stopped at a newest step whose adapter was cut short, and evaluated one whose
    training state was, where --resume RUN passes over both to the step before. Now it takes the step --resume takes,
    and says why."""
    import shutil

    import evaluate

    run = shutil.copytree(trained_run[0], tmp_path / "run")
    shutil.copytree(run / "step_000001", run / "step_000002")
    base = load_experiment()
    for damaged in "adapter_model.safetensors", "training_state.pt":
        file = run / "step_000002" / damaged
        whole = file.read_bytes()
        file.write_bytes(whole[: len(whole) // 2])
        args = evaluate.parse_args(["--checkpoint", str(run)])
        assert args.checkpoint == run / "step_000001" == tiny_grpo.checkpoints.find_checkpoint(
            run, base.parse_args(trained_run[1]))
        assert "step_000002 is damaged" in capsys.readouterr().err
        file.write_bytes(whole)


def test_evaluate_refuses_a_checkpoint_of_a_multi_turn_experiment(trained_run, tmp_path, capsys):
    """Poor: a tool-calling checkpoint was evaluated with experiment_base's single-turn prompts, without a word. Its
    training_state.pt records the experiment (train.py's training_state): a multi-turn one, or a name that is no
    experiment here, is refused in one line, before the model loads; one of experiment_base's copies that share its
    prompts and rewards (experiment_drgrpo) is evaluated."""
    import shutil

    import evaluate
    import torch

    step = shutil.copytree(trained_run[0] / "step_000001", tmp_path / "step_000001")
    state = torch.load(step / "training_state.pt", weights_only=True)
    for experiment, refused in [("experiment_multiturn_tool_calling", True), ("experiment_multiturn_qa", True),
                                ("../experiment_base", True), ("experiment_drgrpo", False)]:
        torch.save({**state, "experiment": experiment}, step / "training_state.pt")
        if not refused:
            assert evaluate.parse_args(["--checkpoint", str(step)]).checkpoint == step
            continue
        with pytest.raises(SystemExit) as stop:
            evaluate.parse_args(["--checkpoint", str(step), "--tasks", "math"])
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and f"a checkpoint of {experiment!r}" in err[-1], err


def test_evaluate_stops_at_a_data_file_it_cannot_read(tiny_model_dir, tmp_path, capsys):
    """Poor: a --data file that did not exist was reported as 'not run' with exit 0, as if the task's default data
    were out of reach. A file the user names is an error, in one line, before the model loads."""
    import evaluate

    with pytest.raises(SystemExit) as stop:
        evaluate.main(["--model-name", str(tiny_model_dir), "--tasks", "math", "gsm8k", "--data",
                       f"gsm8k={tmp_path / 'nowhere.jsonl'}", "--eval-prompts", "1", "--max-length", "2", "--dtype", "float32"])
    assert stop.value.code not in (0, None) and "nowhere.jsonl: no such file" in str(stop.value.code)
    assert str(stop.value.code).startswith("evaluate.py: error: --data gsm8k: ")
    assert "math:" not in capsys.readouterr().out  # no task was evaluated first


# -- The roofline (issue 76): each phase of the step against what this machine allows

def tiny_config(tied=True):
    """Two layers of 8 wide, 2 heads of 4 sharing one KV head, an MLP of 16, 32 words: small enough to count by hand."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=4, vocab_size=32, tie_word_embeddings=tied)


# One prompt of 3 tokens, two completions of 3 and 2 tokens, bfloat16 (2 bytes), LoRA rank 2 in float32. By hand:
# a layer's linear weights q 8x8, k 8x4, v 8x4, o 8x8, gate, up and down 8x16: 576, 1,152 in two layers; the output
# layer 32 x 8 = 256: 1,408 weights, 2,816 bytes. LoRA: 2 x (in + out) a layer = 2 x 128 = 256, 512 in two, 2,048
# bytes. A pass reads 4,864 bytes of weights. A position's keys and values: 2 x 2 layers x 1 head x 4 = 16 numbers,
# 32 bytes.
# - prefill, 3 tokens: 4,864 + 3 x 32 = 4,960 bytes written and read; FLOPs 2 x 1,408 x 3 less the output layer on
#   two positions (2 x 256 x 2 = 1,024) = 7,424, LoRA 2 x 512 x 3 = 3,072, attention 4 x 2 layers x 2 x 4 x 6 pairs
#   = 384: 10,880.
# - decode step 1, both rows, each 5 positions in its cache (3, 1 drawn, 1 new): 4,864 + 2 x 5 x 32 = 5,184 bytes;
#   FLOPs a row 2 x 1,408 + 2 x 512 + 4 x 2 x 2 x 4 x 5 = 2,816 + 1,024 + 320 = 4,160, two rows 8,320.
# - decode step 2, the first row alone (the second has its 2 tokens), 6 positions: 4,864 + 192 = 5,056 bytes; FLOPs
#   2,816 + 1,024 + 384 = 4,224.
BY_HAND = [(4960, 10880), (5184, 8320), (5056, 4224)]


@pytest.mark.parametrize("tied", [True, False])
def test_the_roofline_counts_a_samplings_bytes_and_flops_as_by_hand(tied):
    """roofline.sampling_passes against the count by hand above: the weights read once a pass whatever the rows, the
    KV cache of the rows still running, the FLOPs of each row. Untied, the input embedding is a lookup, not read whole:
    the same bytes."""
    from roofline import linear_weights, sampling_passes

    assert linear_weights(tiny_config(tied), 2) == (1408, 512)
    assert sampling_passes(tiny_config(tied), 2, 2, [3], [3, 2]) == BY_HAND


def test_the_roofline_shares_are_the_limit_over_the_measured_time():
    """From given figures (1,000 bytes/s, 1,000 FLOP/s): each pass takes the larger of its bytes and its FLOPs over
    them, the prefill 10.88 s (FLOPs), decode step 1 8.32 s (FLOPs), step 2 5.056 s (bytes): 24.256 s, of which 5.056
    bound by the bandwidth. The warm-up step is not counted."""
    from roofline import print_roofline, roofline

    figures = {"bandwidth": {"best": 1000.0}, "matmul": {"best": 1000.0}}
    step = {"seconds": 100.0, "sampling_seconds": 48.512, "tokens": 5, "training_flops": 12_872.0,
            "prompt_tokens": [3], "completion_tokens": [3, 2]}
    warm_up = {**step, "seconds": 1e6, "sampling_seconds": 1.0, "training_flops": 1.0}
    phases = roofline([warm_up, step, step], tiny_config(), 2, 2, figures)
    sampling, training = phases["sampling"], phases["training"]
    assert sampling["limit_seconds"] == pytest.approx(2 * 24.256) and sampling["share"] == pytest.approx(0.5)
    assert sampling["bandwidth_share"] == pytest.approx(5.056 / 24.256) and sampling["bound"] == "matmul peak"
    assert (sampling["bytes"], sampling["flops"], sampling["prefills"], sampling["decode_steps"]) == (2 * 15_200, 2 * 23_424, 2, 4)
    assert sampling["tokens_per_second"] == pytest.approx(10 / 97.024)
    assert sampling["tokens_per_second_at_limit"] == pytest.approx(10 / 48.512)
    assert sampling["tokens_per_second_bandwidth_bound"] == pytest.approx(10 / 30.4)  # 2 x 15,200 bytes at 1,000/s
    assert training["seconds"] == pytest.approx(2 * 51.488) and training["limit_seconds"] == pytest.approx(2 * 12.872)
    assert training["share"] == pytest.approx(0.25)
    slower = roofline([warm_up, step], tiny_config(), 2, 2, {**figures, "bandwidth": {"best": 100.0}})["sampling"]
    assert slower["bound"] == "bandwidth" and slower["limit_seconds"] == pytest.approx(49.6 + 51.84 + 50.56)


def test_a_rate_is_its_best_repeat_after_the_warm_up():
    """roofline.rate: the work over the fastest repeat (another process's time slice only slows one), the slow first
    call left out, and how far the repeats spread. Sleeps stand in for the work: no speed of this machine is asserted."""
    import time

    from roofline import rate

    sleeps = iter([0.3, 0.04, 0.02, 0.08, 0.04, 0.04])
    figure = rate(1.0, lambda: time.sleep(next(sleeps)), seconds=0.0)
    assert figure["repeats"] == 5
    assert figure["best"] == pytest.approx(1 / 0.02, rel=0.3) and figure["worst"] == pytest.approx(1 / 0.08, rel=0.3)
    assert figure["spread"] == pytest.approx(0.75, abs=0.15)


def test_a_figure_is_measured_again_while_other_processes_take_the_cpus(monkeypatch):
    """roofline.quietest: tried again while others took over 10% of the CPUs, until a quiet try or the patience is
    spent (each try 10 s on a clock of the test's); the quiet try kept, or with none, the least busy one, said to
    be busy: not the best of the busy tries, the luckiest."""
    import types

    import roofline

    clock = [0.0]
    monkeypatch.setattr(roofline, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    tries = [{"best": 5.0, "others_cpu_share": 0.5}, {"best": 7.0, "others_cpu_share": 0.3},
             {"best": 6.0, "others_cpu_share": 0.4}, {"best": 4.0, "others_cpu_share": 0.05},
             {"best": 9.0, "others_cpu_share": 0.0}]

    def tried(figures):
        def measure_again(measure_figure):
            clock[0] += 10.0
            return next(figures)
        return measure_again

    monkeypatch.setattr(roofline, "with_others_share", tried(iter(tries)))
    assert roofline.quietest(None, patience=1e9) == {**tries[3], "tries": 4}
    monkeypatch.setattr(roofline, "with_others_share", tried(iter(tries)))
    busy = roofline.quietest(None, patience=25.0)  # tries at 0, 10 and 20 s
    assert busy == {**tries[1], "tries": 3}
    assert "other processes took 30% of the CPUs: BUSY, this figure is low" in roofline.how({**busy, "repeats": 4, "spread": 0.1})
    monkeypatch.setattr(roofline, "with_others_share", tried(iter(tries)))
    assert roofline.quietest(None, patience=0.0) == {**tries[0], "tries": 1}


@pytest.mark.parametrize("argv, message", [(["--runs", "0"], "error: --runs must be at least 1, not 0"),
                                           (["--dtype", "foo"], "error: argument --dtype: invalid choice: 'foo'"),
                                           (["--patience", "-1"], "error: --patience must be 0 or more seconds, not -1.0"),
                                           (["--patience", "nan"], "error: --patience must be 0 or more seconds, not nan")])
def test_roofline_refuses_a_bad_option_in_one_line(argv, message, capsys):
    """A dtype torch has no name for ended in a traceback from getattr(torch, ...)."""
    import roofline

    with pytest.raises(SystemExit) as stop:
        roofline.parse_args(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]


def assert_roofline(table, steps, stdout):
    """step_time's roofline in its JSON and its output: the bandwidth and the peak measured, the shares the measured
    steps' time over their limit, the rows' lengths the steps sampled."""
    phases = table["roofline"]
    figures = phases["figures"]
    assert figures["bandwidth"]["best"] > 0 and figures["matmul"]["best"] > 0 and figures["threads"] >= 1
    assert all(0 <= figures[name]["others_cpu_share"] <= 1.05 and figures[name]["tries"] >= 1 for name in ("bandwidth", "matmul"))
    training = sum(s["seconds"] - s["sampling_seconds"] for s in steps[1:])
    assert phases["training"]["seconds"] == pytest.approx(training)
    assert phases["training"]["limit_seconds"] == pytest.approx(sum(s["training_flops"] for s in steps[1:])
                                                                 / figures["matmul"]["best"])
    sampling = phases["sampling"]
    assert sampling["share"] == pytest.approx(sampling["limit_seconds"] / sum(s["sampling_seconds"] for s in steps[1:]))
    assert sampling["bytes"] > 0 and sampling["limit_seconds"] > 0
    for step in steps:
        assert len(step["prompt_tokens"]) == 4 and sum(step["completion_tokens"]) == step["tokens"]
    assert "| sampling: " in stdout and "| training | " in stdout and "sampled tokens per second: " in stdout
    assert "read bandwidth " in stdout and "matmul peak " in stdout


def test_step_time_alone_prints_and_writes_its_roofline(tiny_model_dir, tmp_path, capsys):
    """--only project, the issue's command: its roofline printed and in its JSON and RESULT line, with the machine (run
    in this process: a fresh one spends about 10 s importing)."""
    stdout, table = run_benchmark(tmp_path, "step_time.py", "--model-name", tiny_model_dir, "--steps", "2",
                                  "--max-new-tokens", "8", "--dtype", "float32", "--only", "project", "--patience", "0",
                                  dtype="float32", capsys=capsys)
    assert_roofline(table["project"], table["project"]["steps"], stdout)
    assert json.loads(stdout.rsplit("RESULT ", 1)[1]) == table["project"]
