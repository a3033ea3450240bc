"""Step time, sampling throughput and peak memory: experiment_base against TRL's GRPOTrainer.

The same GRPO workload runs through both, each in a fresh process (so peak memory is its own),
one after the other in one invocation:

    python benchmarks/step_time.py                         # packaged Gemma-3-270M, CPU, 4 prompts x 4 x 64 tokens
    python benchmarks/step_time.py --steps 6 --json benchmarks/results/step_time.json
    python benchmarks/step_time.py --only project          # one side alone (for profiling)

Identical on both sides: the model and its dtype (--dtype auto: bfloat16 on a CPU with AVX512-BF16, else
float32), the prompts (formatted by
experiment_base.format_prompt), prompts per step, group size, completion budget, LoRA rank/alpha on
every linear layer, gradient checkpointing, learning rate, KL weight (beta), the GRPO loss
(per-sequence token mean, std-scaled group advantages), one optimizer update per step, the reward
function (experiment_base.Scorer), sampling at temperature 1 with no top-k / top-p. Both
stop a completion at EOS only: experiment_base's extra stop strings are switched off here, since
TRL has no equivalent by default.

Reported per side: seconds per step (median over the steps after the first, which is a warm-up),
where that time goes (sampling vs the rest), sampled tokens per second, peak memory (RSS; and GPU
peak when CUDA is present), and the training phase's FLOP/s: the matrix-multiply FLOPs the step's
sequences need (common.training_flops says how they are counted; the same count on both sides, of the
sequences each side ran: with beta = 0 the project runs no pass over a completion whose advantage is 0,
TRL runs them all) over the seconds that are not sampling, and its share of this machine's matmul peak in the same
dtype, measured here after both sides (roofline.matmul_peak). Then the ratios project / TRL.
Then the project's roofline (benchmarks/roofline.py, docs/results/roofline.md): each phase's measured seconds against
its limit on this machine, the bytes it reads over the read bandwidth and its FLOPs over the matmul peak, both
measured in the same run; and the sampled tokens per second against those at the limit. --only prints that side's
(sampling only for the project: TRL's rows' lengths are not recorded) and writes --json.
--profile adds the PyTorch profiler's table of the training phase of one more project step, run after the
measured ones, operator by operator, and the share of that phase's operator time spent in the operators that do the
counted FLOPs (matrix multiplies, attention), with the rate they reach there against the peak.
"""

import argparse
import json
import sys

from common import (check_steps, load_experiment, machine, peak_memory, project_steps, resolved_dtype, run_alone,
                    step_summary, training_flops, trl_steps, workload, workload_parser, write_json)
from roofline import PATIENCE, measure, print_roofline, roofline


def parse_args(argv=None):
    p = workload_parser(__doc__, steps=4, only=["project", "trl"])
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-5, help="learning rate (default: %(default)s)")
    p.add_argument("--kl-weight", type=float, default=0.0, help="beta (TRL's default is 0) (default: %(default)s)")
    p.add_argument("--profile", action="store_true", help="profile one more project step's training phase, after the measured ones")
    p.add_argument("--patience", type=float, default=PATIENCE, help="seconds the roofline's bandwidth and peak may each "
                   "be measured again while other processes take the CPUs (default: %(default)s; 0: once)")
    p.add_argument("--side-of-pair", action="store_true", help=argparse.SUPPRESS)  # main runs --only SIDE with it: the
    # RESULT line alone, since main measures the roofline and writes --json itself, after both sides
    args = check_steps(p, p.parse_args(argv))
    if not args.patience >= 0:  # nan too
        p.error(f"--patience must be 0 or more seconds, not {args.patience}")
    return args


def run_project(args):
    base = load_experiment()
    base.STOP_STRINGS = ()  # EOS only, as TRL
    path, dtype, device, _, tasks = workload(args, base)
    dtype_name = str(dtype).removeprefix("torch.")
    options = base.parse_args(["--model-name", path, "--device", device, "--dtype", dtype_name, "--quantization", "none",
                               "--lora-r", str(args.lora_r), "--lora-alpha", str(2 * args.lora_r), "--lr", str(args.lr),
                               "--kl-weight", str(args.kl_weight), "--group-size", str(args.group_size),
                               "--rollouts-per-step", str(args.prompts), "--max-length", str(args.max_new_tokens),
                               "--train-batch-size", str(args.prompts * args.group_size), "--temperature", "1.0",
                               "--gradient-checkpointing"])  # TRL's settings (checkpointing: trl_steps')
    profile = {} if args.profile else None
    rollouts, rollout = [], base.rollout
    base.rollout = lambda *a, **k: rollouts.append(rollout(*a, **k)) or rollouts[-1]  # the rows' lengths: the roofline's
    steps = project_steps(base, options, tasks, args, profile)
    for step, result in zip(steps, rollouts):  # (the profiled extra step's rollout comes last, with no step)
        prompts = result.attention_mask[:: args.group_size, : -result.action_mask.shape[1]].sum(1)  # one row a prompt
        step.update(prompt_tokens=prompts.tolist(), completion_tokens=result.action_mask.sum(1).tolist())
    memory = {**peak_memory(device), **({"peak_rss_gb": profile["peak_rss_gb"]} if profile else {})}  # not the profiler's
    return {"steps": steps, **memory, **({"profile": {k: v for k, v in profile.items() if k != "peak_rss_gb"}} if profile else {})}


def run_trl(args):
    from transformers import AutoModelForCausalLM

    base = load_experiment()
    path, dtype, device, tokenizer, tasks = workload(args, base)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    steps = trl_steps(args, model, tokenizer, tasks, base.Scorer(), device, args.lr, args.kl_weight)
    for number, step in enumerate(steps):  # the same count as the project's: this step's prompts, G completions each
        prompts = tasks[number * args.prompts : (number + 1) * args.prompts]
        prompt_tokens = [len(tokenizer(t["prompt"]).input_ids) for t in prompts for _ in range(args.group_size)]
        mean = step["tokens"] / len(prompt_tokens)  # TRL counts its completions' tokens in all: each the mean
        step["training_flops"] = training_flops(model.config, args.lora_r, prompt_tokens, [mean] * len(prompt_tokens),
                                                True, args.kl_weight > 0)
    return {"steps": steps, **peak_memory(device)}


def summarise(result, peak):
    summary = {**step_summary(result["steps"]), **{k: v for k, v in result.items() if k != "steps"}, "steps": result["steps"]}
    summary["share_of_peak"] = summary["training_flops_per_second"] / peak["flops_per_second"]
    return summary


def side_roofline(args, steps, figures, who):
    """The roofline of one side's steps (roofline.roofline), printed; the model's shapes from its config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(load_experiment().resolve_model_path(args.model_name))
    phases = roofline(steps, config, args.lora_r, resolved_dtype(args.dtype).itemsize, figures)
    print_roofline(phases, who)
    return phases


def main(argv=None):
    args = parse_args(argv)
    if args.only:
        result = run_project(args) if args.only == "project" else run_trl(args)
        if not args.side_of_pair:  # run alone: its roofline, measured now, and --json
            dtype = resolved_dtype(args.dtype)
            where = machine(dtype)
            who = {"project": "the project", "trl": "TRL"}[args.only]
            result["roofline"] = side_roofline(args, result["steps"], measure(dtype, args.patience), who)
            write_json(args.json, {args.only: result, "settings": {k: str(v) for k, v in vars(args).items()}}, where)
        print("RESULT " + json.dumps(result))
        return
    sides = {}
    for side in ("project", "trl"):
        print(f"running {side} ...", flush=True)
        sides[side] = run_alone(__file__, side, [*(argv if argv is not None else sys.argv[1:]), "--side-of-pair"])
    dtype = resolved_dtype(args.dtype)
    figures = measure(dtype, args.patience)  # after both sides, on the otherwise idle machine
    peak = {"size": figures["matmul"]["size"], "flops_per_second": figures["matmul"]["best"]}
    results = {side: summarise(result, peak) for side, result in sides.items()}
    project, trl = results["project"], results["trl"]
    for result in results.values():  # GFLOP/s in the table
        result["training_gflops_per_second"] = result["training_flops_per_second"] / 1e9
    rows = [("seconds per step (median)", "step_seconds", "{:.2f}"), ("  of which sampling", "sampling_seconds", "{:.2f}"),
            ("sampled tokens per second", "tokens_per_second", "{:.1f}"), ("peak RSS, GB", "peak_rss_gb", "{:.2f}"),
            ("training GFLOP/s", "training_gflops_per_second", "{:.1f}"), ("  share of the matmul peak", "share_of_peak", "{:.0%}")]
    if "gpu_peak_gb" in project:
        rows.append(("GPU peak, GB", "gpu_peak_gb", "{:.2f}"))
    print(f"\n{args.prompts} prompts x {args.group_size} completions x {args.max_new_tokens} tokens, "
          f"{args.steps - 1} measured steps, model {args.model_name}\n")
    print(f"| {'':28s} | {'project':>8s} | {'TRL':>8s} | {'project / TRL':>13s} |")
    print(f"| {'-' * 28} | {'-' * 8} | {'-' * 8} | {'-' * 13} |")
    for label, key, fmt in rows:
        print(f"| {label:28s} | {fmt.format(project[key]):>8s} | {fmt.format(trl[key]):>8s} | {project[key] / trl[key]:>13.2f} |")
    results["roofline"] = side_roofline(args, project["steps"], figures, "the project")
    if "profile" in project:
        profile = project["profile"]
        profile["matmul_share"] = profile["matmul_seconds"] / profile["operator_seconds"]
        seconds = profile["matmul_seconds"] or float("nan")  # a step that trained no row ran no product
        profile["matmul_share_of_peak"] = profile["training_flops"] / seconds / peak["flops_per_second"]
        print(f"\nthe training phase of one more project step, by operator (self CPU time):\n{profile['table']}")
        print(f"matrix multiplies and attention: {profile['matmul_seconds']:.2f} s of the operators' "
              f"{profile['operator_seconds']:.2f} s ({profile['matmul_share']:.0%}); the step's "
              f"{profile['training_flops'] / 1e9:.0f} GFLOP in them run at {profile['matmul_share_of_peak']:.0%} of the peak")
    results["matmul_peak"] = peak
    results["settings"] = {k: str(v) for k, v in vars(args).items()}
    results["ratios"] = {key: project[key] / trl[key] for _, key, _ in rows}
    write_json(args.json, results, machine(resolved_dtype(args.dtype)))


if __name__ == "__main__":
    main()
