"""A sampling lever on and off, alternated in one process on the same prompts and seed, so that both sample the same
tokens and only the time differs (the table counts the completions that parted from the baseline's):

- `--lever ended` (the default): experiment_base's rollout with ended rows dropped from the decode batch (the
  default) and kept to the last step (ENDED_SHARE above 1, as before 2026-11-24). The same tokens in float32
  (tested); in bfloat16 a completion can part.
- `--lever packed`: the frozen weights packed once a rollout for oneDNN (tiny_grpo/onednn.py, bfloat16 on a CPU)
  against the plain products (onednn.PACKING off).
- `--lever shared`: the beginning the prompts share run once for each count of left pads (tiny_grpo/decode.py's
  prefill) against every prompt run whole (SHARED_LEAST above any length).

`--evaluation` times the default command's held-out evaluation instead of a rollout: experiment_base's evaluate
on its default held-out set (100 problems, greedy, its CPU budget and generation batch); --prompts, --group-size,
--max-new-tokens and --data-path are then not used.

    python benchmarks/sampling.py                                   # packaged Gemma-3-270M, 4 prompts x 4 x 64 tokens
    python benchmarks/sampling.py --group-size 8 --max-new-tokens 128 --repeats 2
    python benchmarks/sampling.py --shares 0.01 0.25 0.5        # the rule: drop once this share of the batch has ended
    python benchmarks/sampling.py --lever packed --prompts 8 --group-size 8 --max-new-tokens 128
    python benchmarks/sampling.py --lever shared --evaluation --repeats 2

Stops at EOS and at experiment_base's stop strings, as a training run does (step_time.py stops at EOS only, as
TRL). Reports per setting the median sampling seconds over --repeats rounds, sampled tokens per second, and the
ratio dropped / kept.
"""

import argparse
import math
import statistics
import time

from common import ROOT, load_experiment, machine, output_file, resolved_dtype, workload, write_json
import tiny_grpo.decode
import tiny_grpo.onednn


def share(text):
    """An argparse type: a share of the decode batch, from 0 to 1. nan would never drop a row (no comparison with nan
    holds) and a share below 0 drops at every token, as 0 does; above 1 never drops: that is the 'kept' run."""
    value = float(text)
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise argparse.ArgumentTypeError(f"must be a share of the batch from 0 to 1, got {text}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-name", default="packaged:gemma-3-270m", help="hub id, local folder or .gguf (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per rollout (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=4, help="completions per prompt (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="completion budget (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of (dropped, kept) after a warm-up (default: %(default)s)")
    p.add_argument("--lever", choices=["ended", "packed", "shared"], default="ended", help="what to switch: ended "
                   "rows dropped or kept, the weights packed for oneDNN or not, the prompts' shared beginning run once "
                   "or in every row (default: %(default)s)")
    p.add_argument("--evaluation", action="store_true", help="time the default command's held-out evaluation instead "
                   "of a rollout")
    p.add_argument("--shares", type=share, nargs="+", help="with --lever ended: ENDED_SHARE values to compare as "
                   "'dropped', each from 0 to 1 (default: experiment_base's own)")
    p.add_argument("--dtype", default="auto", help="model dtype, as experiment_base's --dtype (default: %(default)s)")
    p.add_argument("--data-path", default=str(ROOT / "data" / "math_tasks.jsonl"), help="prompts (default: data/math_tasks.jsonl)")
    p.add_argument("--json", type=output_file, help="also write the results as JSON here")
    args = p.parse_args(argv)
    if min(args.prompts, args.group_size, args.max_new_tokens, args.repeats) < 1:
        p.error("--prompts, --group-size, --max-new-tokens and --repeats must be at least 1")
    if args.shares and args.lever != "ended":
        p.error("--shares needs --lever ended")
    args.steps = 1  # workload() reads prompts x steps tasks
    return args


def main(argv=None):
    args = parse_args(argv)
    base = load_experiment()
    path, dtype, device, _, tasks = workload(args, base)
    options = base.parse_args(["--model-name", path, "--device", device, "--dtype", str(dtype).removeprefix("torch."),
                               "--quantization", "none"])
    model, tokenizer = base.load_model(options)
    model.eval()
    torch = base.torch
    if args.evaluation:  # the default command's held-out rows, with their prompts
        score, train_tasks, tasks = base.load_inputs(options)
        base.add_prompts(model, tokenizer, options, train_tasks, tasks)

    def setting(share=tiny_grpo.decode.ENDED_SHARE, packing=True, shared=tiny_grpo.decode.SHARED_LEAST):
        def switch():
            tiny_grpo.decode.ENDED_SHARE, tiny_grpo.onednn.PACKING = share, packing
            tiny_grpo.decode.SHARED_LEAST = shared
        return switch

    def timed(switch):
        switch()
        torch.manual_seed(0)
        started = time.perf_counter()
        if args.evaluation:
            result = base.evaluate(model, tokenizer, tasks, options, score)[1]
        else:
            with base.sampling_weights(model, options):  # as a run samples (the weights packed, where they are)
                result = base.rollout(model, tokenizer, tasks, args.group_size, args.max_new_tokens)
        return time.perf_counter() - started, result

    if args.lever == "packed":
        baseline, configs = "plain", {"plain": setting(packing=False), "packed": setting()}
    elif args.lever == "shared":
        baseline, configs = "whole", {"whole": setting(shared=math.inf), "shared": setting()}
    else:
        baseline, configs = "kept", {"kept": setting(share=2.0)}  # above 1: never dropped
        for share in args.shares or [tiny_grpo.decode.ENDED_SHARE]:
            configs["dropped" if not args.shares else f"dropped at {share:g}"] = setting(share=share)
    _, first = timed(configs[baseline])  # warm-up, and the tokens every way must sample
    seconds, differing, sampled = {name: [] for name in configs}, dict.fromkeys(configs, 0), {}
    for _ in range(args.repeats):
        for name, switch in configs.items():
            took, result = timed(switch)
            seconds[name].append(took)
            # float32: the same tokens every way (tested). bfloat16: one of 16 parted on a Sapphire Rapids (our reading,
            # not traced: a row's logits differ in the last bits with the batch's row count)
            differing[name] = max(differing[name], sum(a != b for a, b in zip(first.completions, result.completions)))
            sampled[name] = int(result.action_mask.sum())
    tokens = int(first.action_mask.sum())
    lengths = first.action_mask.sum(1)
    results = {name: {"seconds": statistics.median(values), "all_seconds": values, "tokens": sampled[name],
                      "tokens_per_second": sampled[name] / statistics.median(values),
                      f"completions_unlike_{baseline}": differing[name]} for name, values in seconds.items()}
    for name in configs:
        results[name][f"ratio_to_{baseline}"] = results[name]["seconds"] / results[baseline]["seconds"]
    results["tokens"] = tokens
    results["completion_lengths"] = sorted(lengths.tolist())
    shape = (f"the held-out evaluation, {len(tasks)} problems" if args.evaluation
             else f"{args.prompts} prompts x {args.group_size} completions x {args.max_new_tokens} tokens")
    print(f"\n{shape}, {tokens} sampled "
          f"(lengths {int(lengths.min())} to {int(lengths.max())}, median {int(lengths.median())}), model {args.model_name}, "
          f"median of {args.repeats}\n")
    print(f"| {dict(kept='ended rows', plain='products', whole='prompts')[baseline]} | sampling s | tokens/s | / {baseline} | "
          f"completions unlike {baseline}'s (of {len(first.completions)}) |\n| --- | --- | --- | --- | --- |")
    for name in configs:
        r = results[name]
        print(f"| {name} | {r['seconds']:.2f} | {r['tokens_per_second']:.1f} | {r[f'ratio_to_{baseline}']:.2f} | "
              f"{r[f'completions_unlike_{baseline}']} |")
    write_json(args.json, results, machine(resolved_dtype(args.dtype)))


if __name__ == "__main__":
    main()
