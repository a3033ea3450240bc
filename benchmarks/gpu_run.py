"""The 24 GB GPU path, measured: experiment_base's default CUDA training step on Llama-3.2-1B, without the hub.

Builds the Llama-3.2-1B architecture from its public configuration with random weights (as memory_estimate.py
does), loads it with experiment_base's own load_model and make_optimizer at its CUDA defaults (4-bit NF4 with double
quantization, bfloat16 compute, LoRA rank 16 on every linear layer, gradient checkpointing, paged 8-bit AdamW) and
runs real steps of experiment_base's rollout and train_step at the CUDA defaults: 16 prompts x 8 completions x
512 tokens, sampled at once, trained 16 at a time (until 2026-11-27 the defaults were 32 x 16 x 1,024). Random weights seldom emit EOS, so completions run to the
budget: the worst case.

--memory-cap-gb 24 caps the process with torch.cuda.set_per_process_memory_fraction, so a larger GPU behaves as a
24 GB one. Each step reports the peak allocated and reserved GPU memory of sampling and of training, their seconds
and the sampled tokens per second; memory_estimate.py's estimate for the same sizes is printed beside them, and a
table gives the largest --generation-batch-size and --train-batch-size that fit caps of 24, 16, 12 and 8 GB (the
estimate's parts, scaled by how far the measurement was from it).

    python benchmarks/gpu_run.py                            # on a CUDA machine: 3 steps at the defaults
    python benchmarks/gpu_run.py --memory-cap-gb 8 --generation-batch-size 64 --train-batch-size 4
    python benchmarks/gpu_run.py --dry-run                  # the same code on the CPU, on a small model: under a minute

Then the same steps run through TRL's GRPOTrainer in the same process (the model loaded the same way, paged 8-bit
AdamW, bf16, the same sizes, learning rate, beta and reward), and a table puts the two side by side: step seconds,
sampled tokens per second, peak GPU memory, and their ratio. Out of memory under the cap is reported as TRL's
result. --skip-trl runs experiment_base alone.

Run on one NVIDIA H100 80GB on 2026-11-24, 2026-11-26 and 2026-11-27 (the figures are in the README's "What was verified,
and where" and benchmarks/results/gpu_run_h100_*.json, named in docs/results/verified.md); everywhere else, --dry-run.
"""

import argparse
import tempfile

import memory_estimate
from common import (ROOT, build_random_llama, load_experiment, machine, output_file, project_steps, step_summary,
                    trl_steps, workload, write_json)

GB = 2**30
CAPS_GB = (24, 16, 12, 8)
# --dry-run checks code paths, not sizes: the Llama architecture (grouped-query attention, tied embeddings) at small
# widths. At Llama-3.2-1B's own widths a CPU without AVX512-BF16 emulates every bfloat16 matmul (measured on an AMD
# EPYC: a [32, 8192] x [8192, 2048] product 3.7 s in bfloat16, 0.014 s in float32), and the dry run ran past 10 minutes
# there (it is 28 s now). A 32k vocabulary keeps the random model from sampling EOS, so completions still run to the budget.
DRY_RUN_SHAPE = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, vocab_size=32768)
BATCH_SIZES = (512, 384, 256, 192, 128, 96, 64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="training steps (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="completion budget (default: %(default)s)")
    p.add_argument("--generation-batch-size", type=int, default=256, help="sequences sampled at once (default: %(default)s)")
    p.add_argument("--train-batch-size", type=int, default=16, help="sequences per micro-batch (default: %(default)s)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (default: %(default)s)")
    p.add_argument("--memory-cap-gb", type=float, default=24.0, help="GPU memory this process may use (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="the same code on the CPU, on a 2-layer Llama of small widths, "
                   "2 prompts x 2 completions x 8 tokens, for CI; the estimate still measures Llama-3.2-1B's shapes")
    p.add_argument("--skip-trl", action="store_true", help="run experiment_base alone, not TRL's GRPOTrainer after it")
    p.add_argument("--skip-estimate", action="store_true", help="leave out memory_estimate.py's estimate and the table "
                   "of what fits (it loads Llama-3.2-1B on the CPU once more)")
    p.add_argument("--evaluate", action="store_true", help="first time train.py's step-0 evaluation: --eval-prompts' "
                   "default held-out problems, greedy, the same budget")
    p.add_argument("--experiment", default="experiment_base", help="the folder, in the repository, whose train.py runs: "
                   "an older copy of experiment_base's placed there compares before and after in one lease (default: %(default)s)")
    p.add_argument("--json", type=output_file, help="also write the steps, the estimate and the recommendation as JSON here")
    args = p.parse_args(argv)
    args.sizes = argparse.Namespace(**vars(args))  # the estimate and the recommendation: the sizes asked for
    args.progress = True  # each step's figures printed as it ends: a lease's time limit then costs only the step it stops
    if args.dry_run:
        args.prompts, args.group_size, args.max_new_tokens = 2, 2, 8
        args.generation_batch_size, args.train_batch_size = 4, 2
    for name in ("steps", "prompts", "group_size", "max_new_tokens", "generation_batch_size", "train_batch_size", "lora_r"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.group_size < 2 or not 0 < args.memory_cap_gb < float("inf"):
        p.error("--group-size must be at least 2 and --memory-cap-gb a positive number")
    return args


def cap_memory(torch, cap_gb):
    """Let this process allocate at most cap_gb of the GPU; returns the GPU's name and total memory in GB."""
    properties = torch.cuda.get_device_properties(0)
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gb * GB / properties.total_memory))
    return properties.name, properties.total_memory / GB


def setup(args, folder, device):
    """experiment_base (or --experiment), its options at the CUDA defaults for the sizes asked for, the tokenizer and
    the tasks."""
    base = load_experiment(args.experiment)
    options = base.parse_args(["--model-name", str(folder), "--device", device, "--quantization", "4bit",
                               "--dtype", "bfloat16", "--lora-r", str(args.lora_r), "--lora-alpha", str(2 * args.lora_r),
                               "--group-size", str(args.group_size), "--rollouts-per-step", str(args.prompts),
                               "--max-length", str(args.max_new_tokens), "--train-batch-size", str(args.train_batch_size),
                               "--generation-batch-size", str(args.generation_batch_size), "--temperature", "1.0"])
    workload_args = argparse.Namespace(model_name=str(folder), dtype="bfloat16", prompts=args.prompts, steps=args.steps,
                                       data_path=ROOT / "data" / "math_tasks.jsonl")
    tokenizer, tasks = workload(workload_args, base)[3:]
    return base, options, tokenizer, tasks


def run_steps(args, folder, device):
    """experiment_base's steps on the random model in folder: the list of per-step figures, and the longest prompt."""
    base, options, tokenizer, tasks = setup(args, folder, device)
    prompt_tokens = max(len(tokenizer(t["prompt"]).input_ids) for t in tasks)
    evaluation = None
    if args.evaluate:
        held_out = base.load_tasks(str(ROOT / options.eval_data_path), max_rows=2 if args.dry_run else options.eval_prompts)
        evaluation = {"tasks": [{**t, "prompt": base.format_prompt(tokenizer, t["question"])} for t in held_out]}
    steps = project_steps(base, options, tasks, args, evaluation=evaluation)
    if evaluation:
        steps[0]["evaluation"] = evaluation
    return steps, prompt_tokens


def run_trl(args, folder, device):
    """The same steps through TRL's GRPOTrainer: the model loaded as experiment_base's load_model loads it (4-bit NF4,
    double quantization, bfloat16 compute), TRL's LoRA and gradient checkpointing, paged 8-bit AdamW and bf16 on
    CUDA, the same prompts, sizes, learning rate, beta and reward. Out of memory under the cap is a result too."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    gc.collect()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
    base, options, tokenizer, tasks = setup(args, folder, device)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=quantization,
                                                     attn_implementation=base.attention_implementation(device),
                                                     device_map={"": device})
        return {"steps": trl_steps(args, model, tokenizer, tasks, base.Scorer(), device, options.lr, options.kl_weight,
                                   args.train_batch_size, args.generation_batch_size,
                                   optim="paged_adamw_8bit" if cuda else None, bf16=cuda)}
    except torch.OutOfMemoryError as e:
        return {"steps": [], "error": f"out of memory under the {args.memory_cap_gb:g} GB cap: {str(e).splitlines()[0]}"}


def estimate(args, prompt_tokens, generation_batch_size, train_batch_size, parts):
    """memory_estimate.py's peaks (GB) of sampling and of training for these batch sizes, with the completion budget
    asked for (--dry-run runs 8 tokens, but estimates the run it stands for) and prompts of at least 160 tokens (a
    chat template's header and the system prompt in Llama's own tokenizer)."""
    sizes = argparse.Namespace(group_size=args.sizes.group_size, generation_batch_size=generation_batch_size,
                               train_batch_size=train_batch_size, prompt_length=max(prompt_tokens, 160),
                               max_length=args.sizes.max_new_tokens, lora_r=args.lora_r)
    return {phase: sum(items.values()) / GB for phase, items in memory_estimate.estimate(parts, sizes).items()}


def recommend(args, prompt_tokens, parts, scale):
    """For each cap, the largest generation and train batch sizes whose estimated peak, times scale (measured over
    estimated, per phase), fits under it."""
    table = {}
    def peak(phase, generation, train):
        return estimate(args, prompt_tokens, generation, train, parts)[phase] * scale[phase]

    for cap in CAPS_GB:
        table[cap] = {"generation_batch_size": next((b for b in BATCH_SIZES if peak("sampling", b, 1) <= cap), None),
                      "train_batch_size": next((b for b in BATCH_SIZES if peak("training", 1, b) <= cap), None)}
    return table


def side_by_side(steps, trl_result, cuda):
    """experiment_base and TRL on the same steps: {"experiment_base": {...}, "TRL": {...}} of step_summary's figures
    and, on CUDA, each side's peak GPU memory over its steps, allocated and reserved."""
    sides = {"experiment_base": step_summary(steps), "TRL": step_summary(trl_result["steps"])}
    def peak(steps, phases, kind):
        return max(step[f"{phase}_{kind}_gb"] for step in steps for phase in phases)

    if cuda:  # TRL samples within its optimizer step (256 of 512 at a time), so its peaks are per step
        for kind in ("allocated", "reserved"):
            sides["experiment_base"][f"peak_{kind}_gb"] = peak(steps, ("sampling", "training"), kind)
            sides["TRL"][f"peak_{kind}_gb"] = peak(trl_result["steps"], ("step",), kind)
    return sides


def print_side_by_side(sides):
    print("\nThe same steps through TRL's GRPOTrainer:\n")
    rows = [("seconds per step (median)", "step_seconds", "{:.1f}"), ("  of which sampling", "sampling_seconds", "{:.1f}"),
            ("sampled tokens per second", "tokens_per_second", "{:.0f}"),
            ("peak GPU GB, allocated", "peak_allocated_gb", "{:.2f}"), ("peak GPU GB, reserved", "peak_reserved_gb", "{:.2f}")]
    ours, theirs = sides["experiment_base"], sides["TRL"]
    print("| | experiment_base | TRL | experiment_base / TRL |\n| --- | --- | --- | --- |")
    for label, key, fmt in rows:
        if key in ours:
            print(f"| {label} | {fmt.format(ours[key])} | {fmt.format(theirs[key])} | {ours[key] / theirs[key]:.2f} |")


def main(argv=None):
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        raise SystemExit("error: no CUDA device here; --dry-run runs the same code on the CPU")
    load_experiment(args.experiment)  # its import sets the CUDA allocator's options, before cap_memory starts CUDA
    gpu = cap_memory(torch, args.memory_cap_gb) if cuda else None
    with tempfile.TemporaryDirectory() as folder:
        build_random_llama(folder, **(DRY_RUN_SHAPE if args.dry_run else {}))
        steps, prompt_tokens = run_steps(args, folder, "cuda:0" if cuda else "cpu")
        trl = None if args.skip_trl else run_trl(args, folder, "cuda:0" if cuda else "cpu")
    estimated, scale, recommendation = None, None, {}
    if not args.skip_estimate:
        parts = memory_estimate.measure(argparse.Namespace(tiny=args.dry_run, lora_r=args.lora_r, measure_tokens=64 if args.dry_run else 256))
        estimated = estimate(args, prompt_tokens, args.sizes.generation_batch_size, args.sizes.train_batch_size, parts)
        measured = steps[-1]
        scale = {phase: measured[f"{phase}_allocated_gb"] / estimated[phase] if cuda else 1.0 for phase in ("sampling", "training")}
        recommendation = recommend(args, prompt_tokens, parts, scale)

    where = f"{gpu[0]} capped at {args.memory_cap_gb:g} GB of {gpu[1]:.0f}" if cuda else "CPU (--dry-run: 2 layers, small widths)"
    print(f"\nLlama-3.2-1B architecture, random weights, 4-bit NF4 + LoRA r{args.lora_r}, {where}: {args.prompts} prompts x "
          f"{args.group_size} completions x {args.max_new_tokens} tokens (prompts of up to {prompt_tokens} tokens), "
          f"sampled {args.generation_batch_size} at a time, trained {args.train_batch_size} at a time\n")
    print("| step | sampling s | training s | sampled tokens/s | sampling peak GB, allocated / reserved | training peak GB, allocated / reserved |")
    print("| --- | --- | --- | --- | --- | --- |")
    for i, s in enumerate(steps, 1):
        memory = [f"{s[f'{phase}_allocated_gb']:.2f} / {s[f'{phase}_reserved_gb']:.2f}" if cuda else "-" for phase in ("sampling", "training")]
        print(f"| {i} | {s['sampling_seconds']:.1f} | {s['seconds'] - s['sampling_seconds']:.1f} | "
              f"{s['tokens'] / s['sampling_seconds']:.0f} | {memory[0]} | {memory[1]} |")
    if steps[0].get("evaluation"):
        e = steps[0]["evaluation"]
        print(f"\nthe step-0 evaluation: {e['rows']} held-out problems, greedy, {e['tokens']} tokens in {e['seconds']:.1f} s"
              + (f", peak GB {e['evaluation_allocated_gb']:.2f} / {e['evaluation_reserved_gb']:.2f}" if cuda else ""))
    if trl is not None and trl["steps"]:
        trl["side_by_side"] = side_by_side(steps, trl, cuda)
        print_side_by_side(trl["side_by_side"])
    elif trl is not None:
        print(f"\nTRL's GRPOTrainer on the same steps: {trl['error']}")
    if estimated is None:
        write_json(args.json, {"settings": {k: str(v) for k, v in vars(args.sizes).items()}, "device": where, "steps": steps,
                               "trl": trl, "prompt_tokens": prompt_tokens}, machine("bfloat16" + (f" on {gpu[0]}" if cuda else "")))
        return
    print(f"\nmemory_estimate.py for {args.sizes.generation_batch_size} sequences sampled and {args.sizes.train_batch_size} "
          f"trained at once, {args.sizes.max_new_tokens}-token completions: sampling {estimated['sampling']:.2f} GB, training {estimated['training']:.2f} GB"
          + (f" (measured / estimated: {scale['sampling']:.2f}, {scale['training']:.2f})" if cuda else " (not measured: no GPU)"))
    print(f"\nWhat fits, {args.sizes.max_new_tokens}-token completions in groups of {args.sizes.group_size}"
          + (", from the estimate scaled by measured / estimated" if cuda else ", from the estimate alone") + ":\n")
    print("| cap, GB | largest --generation-batch-size | largest --train-batch-size |\n| --- | --- | --- |")
    for cap, sizes in recommendation.items():
        print(f"| {cap} | {sizes['generation_batch_size']} | {sizes['train_batch_size']} |")
    write_json(args.json, {"settings": {k: str(v) for k, v in vars(args.sizes).items()}, "device": where, "steps": steps,
                           "trl": trl, "prompt_tokens": prompt_tokens, "estimate_gb": estimated, "measured_over_estimated": scale,
                           "recommendation": {str(cap): sizes for cap, sizes in recommendation.items()}},
               machine("bfloat16" + (f" on {gpu[0]}" if cuda else "")))


if __name__ == "__main__":
    main()
