"""The roofline of a GRPO step (issue 76): how near each phase of step_time.py's step runs to what this machine allows.

A forward pass of the model can run no faster than the bytes it reads over the memory's read bandwidth, nor than its
FLOPs over the matmul peak: its limit is the larger of the two. A phase's limit is the sum over its passes.
- Sampling is a prefill of the prompts, then one decode step per token. A decode step reads every weight once,
  whatever the rows (and each running row's KV cache), and does 2 FLOPs per weight and row (sampling_passes): bound
  by the bandwidth at few rows, by the peak at many (in bfloat16 on the 2-core EPYC, from 8 to 12 rows up).
- Training runs every token of its sequences in each pass: bound by the matmul peak. Its FLOPs are
  common.training_flops' count (docs/results/roofline.md gives the formula and its sources).
The bandwidth and the peak are measured in the same run (measure), each the best of many short repeats after a
warm-up (another process's time slice only slows a repeat), and measured again for a while if other processes took
more than 10% of the CPUs meanwhile; the figures say how busy the machine was.

    python benchmarks/roofline.py              # this machine's read bandwidth and matmul peak, in --dtype
    python benchmarks/roofline.py --runs 5     # five times, each in a fresh process, and how far apart they are
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from common import forward_flops, resolved_dtype

BUFFER_MB = 512  # the bandwidth's buffer: 16 x the 32 MB L3 of the EPYC these figures were first taken on
MATMUL_SIZE = 2048  # square products: on the EPYC, 1024 to 4096 are within 10% of each other (roofline.md)
QUIET = 0.1  # the share of the CPUs other processes may take while a figure is measured; above it, it is measured again
PATIENCE = 10.0  # seconds to measure a figure again while the machine is busy (quietest)


def rate(work, function, seconds, least=5):
    """work / the time of one call of function, over repeats after a warm-up call: repeated until `seconds` have
    passed and at least `least` ran. {"best", "median", "worst", "repeats", "spread"}: spread is (best - worst) /
    best, how much the repeats of this run differed (others' time slices among them)."""
    function()  # warm-up: first-touch page faults, oneDNN's kernel choice and packing, the clock rising
    times, started = [], time.perf_counter()
    while len(times) < least or time.perf_counter() - started < seconds:
        begun = time.perf_counter()
        function()
        times.append(time.perf_counter() - begun)
    rates = sorted(work / t for t in times)
    return {"best": rates[-1], "median": statistics.median(rates), "worst": rates[0], "repeats": len(rates),
            "spread": (rates[-1] - rates[0]) / rates[-1]}


def read_bandwidth(dtype, megabytes=BUFFER_MB, seconds=1.5):
    """Bytes per second a sum reads over a buffer of megabytes in dtype, far beyond the last-level cache: a decode
    step's weights stream through the cache the same way, once each. The sum runs on torch's threads."""
    import torch

    buffer = torch.ones(megabytes * 2**20 // dtype.itemsize, dtype=dtype)
    figure = rate(buffer.nbytes, buffer.sum, seconds)
    return {**figure, "method": f"sum over {megabytes} MB of {str(dtype).removeprefix('torch.')}"}


def matmul_peak(dtype, size=MATMUL_SIZE, seconds=2.0):
    """FLOP/s of a size x size product in dtype on torch's threads. The size is fixed, so that every run times the
    same product (the earlier peak doubled its size until a product took 0.2 s: a busy moment could pick another).
    Its 2x moves between runs (issue 76) were the load, not the method: quiet, it held within 3% (roofline.md)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
    figure = rate(2 * size**3, lambda: torch.mm(a, b), seconds)
    return {**figure, "size": size, "method": f"{size} x {size} products in {str(dtype).removeprefix('torch.')}"}


def cpu_seconds():
    """(seconds all CPUs were busy or stolen by the hypervisor since boot, this process's CPU seconds); the first
    is None where /proc/stat is not (not Linux)."""
    own = sum(os.times()[:2])
    try:
        with open("/proc/stat") as stat:
            user, nice, system, _, _, irq, softirq, steal = map(int, stat.readline().split()[1:9])
    except (OSError, ValueError):
        return None, own
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), own


def with_others_share(measure_figure):
    """measure_figure()'s dict, with the "others_cpu_share": the share of the CPUs that other processes (and the
    hypervisor) took while it ran, None off Linux. This machine's figures are only its own where that is small."""
    (busy, own), started = cpu_seconds(), time.perf_counter()
    figure = measure_figure()
    (busy_after, own_after), wall = cpu_seconds(), time.perf_counter() - started
    others = None if busy is None else max(0.0, ((busy_after - busy) - (own_after - own)) / (wall * os.cpu_count()))
    return {**figure, "others_cpu_share": others}


def quietest(measure_figure, patience):
    """measure_figure() (with_others_share), made again while other processes took more than QUIET of the CPUs
    during it, until patience seconds have passed: the quiet try, or where none was, the least busy one, with
    "tries". Another process lowers a figure (on 2 shared cores the bandwidth halved, issue 76); the best of many
    busy tries would be the luckiest, not the machine's (29 GB/s among tries of 24-26)."""
    started, tries = time.perf_counter(), []
    while not tries or (busy(tries[-1]) and time.perf_counter() - started < patience):
        tries.append(with_others_share(measure_figure))
    return {**min(tries, key=lambda figure: figure["others_cpu_share"] or 0.0), "tries": len(tries)}


def busy(figure):
    return figure["others_cpu_share"] is not None and figure["others_cpu_share"] > QUIET


def measure(dtype, patience=PATIENCE):
    """This machine's read bandwidth and matmul peak in dtype, measured now, each at the quietest moment patience
    seconds allow (quietest), with the threads torch runs on."""
    import torch

    return {"bandwidth": quietest(lambda: read_bandwidth(dtype), patience),
            "matmul": quietest(lambda: matmul_peak(dtype), patience), "threads": torch.get_num_threads()}


def describe(figures):
    """One line: the bandwidth and the peak, how each was measured, how far its repeats spread, and how busy the
    machine was meanwhile."""
    bandwidth, matmul = figures["bandwidth"], figures["matmul"]
    return (f"read bandwidth {bandwidth['best'] / 1e9:.1f} GB/s ({bandwidth['method']}, {how(bandwidth)}); "
            f"matmul peak {matmul['best'] / 1e9:.1f} GFLOP/s ({matmul['method']}, {figures['threads']} threads, "
            f"{how(matmul)})")


def how(figure):
    """How a figure was measured, in words: its repeats, their spread, its tries and how busy the machine was."""
    words = f"best of {figure['repeats']}, repeats within {figure['spread']:.0%}"
    words += f", the quietest of {figure['tries']} tries" if figure["tries"] > 1 else ""
    if figure["others_cpu_share"] is not None:
        words += f"; other processes took {figure['others_cpu_share']:.0%} of the CPUs"
        words += ": BUSY, this figure is low" if busy(figure) else ""
    return words


def linear_weights(config, lora_r):
    """(the weights of the model's linear layers, output layer included, LoRA's weights at rank lora_r on every
    linear layer of the body): what a forward pass reads. The model is built from config on the meta device (no
    memory, no download) and its nn.Linear layers counted, so that any architecture is counted as transformers
    builds it. The input embedding is a lookup of a few rows, the norms are vectors: not counted."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    body = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    weights = sum(m.weight.numel() for m in body) + head.weight.numel()
    return weights, lora_r * sum(m.in_features + m.out_features for m in body)


def sampling_passes(config, lora_r, dtype_bytes, prompt_tokens, completion_tokens, lora_bytes=4):
    """[(bytes, FLOPs)] of each forward pass of one sample() call: the prefill of the prompts (prompt_tokens[i] real
    tokens of prompt i), then the decode steps of its rows (completion_tokens[j] tokens of row j, the rows of a
    prompt side by side: len(completion_tokens) / len(prompt_tokens) a prompt). The prefill gives every row its
    first token; decode step k (k = 1 .. the longest row - 1) runs each row that has not ended (more than k tokens),
    whose cache then holds its prompt, k tokens and the new one.

    Bytes: the weights once a pass (dtype_bytes each; LoRA's, lora_bytes: float32), and the KV cache each running
    row reads (keys and values, each layer), or the prefill writes. FLOPs: common.forward_flops' count, of a row
    whose prefix is cached (a repeated prompt there), and the output layer on one position a row. Padding and rows
    that ended but still run in the batch are not counted, nor the draw's passes over the logits: the work the
    completions need, as training_flops counts it."""
    c = getattr(config, "text_config", config)
    weights, lora = linear_weights(config, lora_r)
    read = weights * dtype_bytes + lora * lora_bytes
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", c.num_attention_heads)
    cache_bytes = 2 * c.num_hidden_layers * kv_heads * head_dim * dtype_bytes  # a position's keys and values

    passes = [(read + cache_bytes * sum(prompt_tokens), prefill_flops(config, lora_r, prompt_tokens))]
    group = len(completion_tokens) // len(prompt_tokens)
    for k in range(1, max(completion_tokens)):
        context = [prompt_tokens[j // group] + k for j, length in enumerate(completion_tokens) if length > k]
        passes.append((read + cache_bytes * sum(p + 1 for p in context), decode_flops(config, lora_r, context)))
    return passes


def prefill_flops(config, lora_r, prompt_tokens):
    """The prefill's FLOPs: every prompt token through the body, the last one also through the output layer (as
    forward_flops counts a row of prompt_tokens - 1 prompt tokens and 1 action token)."""
    return sum(forward_flops(config, lora_r, [p - 1 for p in prompt_tokens], [1] * len(prompt_tokens)))


def decode_flops(config, lora_r, context):
    """A decode step's FLOPs: one new token a row after context[i] cached positions, attending to them and itself
    (forward_flops' row whose prompt is already in its packed sequence)."""
    return sum(forward_flops(config, lora_r, context, [1] * len(context), [True] * len(context)))


def limit_seconds(passes, figures):
    """(the least time passes [(bytes, FLOPs)] can take, each the larger of bytes / bandwidth and FLOPs / peak; the
    share of that time in passes bound by the bandwidth)."""
    times = [(read / figures["bandwidth"]["best"], flops / figures["matmul"]["best"]) for read, flops in passes]
    total = sum(max(pair) for pair in times)
    return total, sum(memory for memory, compute in times if memory >= compute) / total if total else 0.0


def roofline(steps, config, lora_r, dtype_bytes, figures):
    """Each phase of the steps after the first (a warm-up; all of them if there is one, as common.step_summary)
    against its limit under figures (measure's): {"figures": figures, "sampling": ..., "training": ...}, each phase
    {"seconds" measured, "flops", "limit_seconds", "share" of the limit reached (limit / measured), "bound"}.
    Sampling needs the steps' "prompt_tokens" and "completion_tokens" (step_time records them for the project),
    training their "training_flops"; a phase without them is left out."""
    measured = steps[1:] or steps
    phases = {"figures": figures}
    if all("completion_tokens" in s for s in measured):
        phases["sampling"] = sampling_phase(measured, config, lora_r, dtype_bytes, figures)
    if all("training_flops" in s for s in measured):
        seconds = sum(s["seconds"] - s["sampling_seconds"] for s in measured)
        flops = sum(s["training_flops"] for s in measured)
        limit = flops / figures["matmul"]["best"]
        phases["training"] = {"seconds": seconds, "flops": flops, "limit_seconds": limit, "share": limit / seconds,
                              "bound": "matmul peak"}
    return phases


def sampling_phase(steps, config, lora_r, dtype_bytes, figures):
    """The sampling phase of steps against its limit (roofline's keys), with its "bytes", its "prefills" (one a step)
    and "decode_steps", the "bandwidth_share" of its limit (in passes bound by the bandwidth), and the sampled
    "tokens_per_second" measured, "tokens_per_second_at_limit" and "tokens_per_second_bandwidth_bound" (were every
    pass bound by its bytes alone: the decode's usual limit, which the FLOPs may overtake)."""
    passes = [p for s in steps
              for p in sampling_passes(config, lora_r, dtype_bytes, s["prompt_tokens"], s["completion_tokens"])]
    limit, memory = limit_seconds(passes, figures)
    seconds, tokens = sum(s["sampling_seconds"] for s in steps), sum(s["tokens"] for s in steps)
    return {"seconds": seconds, "bytes": sum(p[0] for p in passes), "flops": sum(p[1] for p in passes),
            "prefills": len(steps), "decode_steps": len(passes) - len(steps), "limit_seconds": limit,
            "share": limit / seconds, "bound": "bandwidth" if memory >= 0.5 else "matmul peak",
            "bandwidth_share": memory,
            "tokens_per_second": tokens / seconds, "tokens_per_second_at_limit": tokens / limit,
            "tokens_per_second_bandwidth_bound": tokens * figures["bandwidth"]["best"] / sum(p[0] for p in passes)}


def print_roofline(phases, who):
    """The roofline as a table, after the line of the figures it was measured against."""
    print(f"\nroofline of {who}'s measured steps (docs/results/roofline.md): {describe(phases['figures'])}\n")
    print("| phase | seconds | GB read | GFLOP | limit, s | bound by | share of the limit |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    sampling, training = phases.get("sampling"), phases.get("training")
    if sampling:
        print(f"| sampling: {sampling['prefills']} prefills, {sampling['decode_steps']} decode steps | "
              f"{sampling['seconds']:.2f} | {sampling['bytes'] / 1e9:.1f} | {sampling['flops'] / 1e9:.0f} | "
              f"{sampling['limit_seconds']:.2f} | {sampling['bound']} ({sampling['bandwidth_share']:.0%} of it "
              f"bandwidth) | {sampling['share']:.0%} |")
    if training:
        print(f"| training | {training['seconds']:.2f} | - | {training['flops'] / 1e9:.0f} | "
              f"{training['limit_seconds']:.2f} | {training['bound']} | {training['share']:.0%} |")
    if sampling:
        print(f"\nsampled tokens per second: {sampling['tokens_per_second']:.1f} now, "
              f"{sampling['tokens_per_second_at_limit']:.1f} at the limit (each pass at the bandwidth or the peak), "
              f"{sampling['tokens_per_second_bandwidth_bound']:.1f} were they bound by the bandwidth alone")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="as experiment_base's --dtype (default: %(default)s)")
    p.add_argument("--patience", type=float, default=PATIENCE, help="seconds to measure a figure again while other "
                   "processes take more than %d%% of the CPUs (default: %%(default)s)" % (100 * QUIET))
    p.add_argument("--runs", type=int, default=1, help="measure this many times, each in a fresh process, and give "
                   "the spread of their figures (default: %(default)s)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs must be at least 1, not {args.runs}")
    if not args.patience >= 0:  # nan too
        p.error(f"--patience must be 0 or more seconds, not {args.patience}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.runs == 1:
        figures = measure(resolved_dtype(args.dtype), args.patience)
        print(describe(figures))
        print("RESULT " + json.dumps(figures))
        return
    runs = []
    for _ in range(args.runs):  # a fresh process each: its allocator, threads and page faults its own
        out = subprocess.run([sys.executable, __file__, "--dtype", args.dtype, "--patience", str(args.patience)],
                             capture_output=True, text=True)
        if out.returncode != 0 or "RESULT " not in out.stdout:
            sys.exit(f"error: a measuring run failed:\n{out.stderr[-3000:]}")
        runs.append(json.loads(out.stdout.rsplit("RESULT ", 1)[1]))
        print(describe(runs[-1]), flush=True)
    for name, unit in (("bandwidth", "GB/s"), ("matmul", "GFLOP/s")):
        best = [run[name]["best"] / 1e9 for run in runs]
        spread = (max(best) - min(best)) / max(best)
        print(f"{name}: {', '.join(f'{b:.1f}' for b in best)} {unit}; the runs within {spread:.0%} of the best")


if __name__ == "__main__":
    main()
