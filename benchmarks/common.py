"""What the benchmarks share: loading an experiment's train.py, the GRPO step workload that step_time.py and
levers.py time, running one side in a fresh process, and reading TensorBoard scalars. tests/conftest.py loads the
experiments through load_experiment too."""

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
import tiny_grpo.logprobs

ROOT = Path(__file__).resolve().parent.parent


# Llama-3.2-1B(-Instruct), from its public config.json
LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                    rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)


def build_random_llama(folder, **overrides):
    """Save the Llama-3.2-1B architecture (overrides: num_hidden_layers=2, say) with random bfloat16 weights to
    folder, and a tokenizer that makes each word of a prompt one token (<unk>) and has an EOS the random model
    seldom samples. Nothing is downloaded: memory and speed do not depend on the weights' values."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(**{**LLAMA_3_2_1B, **overrides}, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("meta"):  # no memory, no initialisation: the layers' own init would run twice (half the time)
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.init_weights()  # transformers' init, once: normal(0, 0.02) weights, unit norms, the rotary frequencies
    model.save_pretrained(folder)
    words = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    return config


def load_module(path, name=None):
    """A Python file imported by path as its own module (named after the file unless named)."""
    spec = importlib.util.spec_from_file_location(name or Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_experiment(name="experiment_base"):
    """An experiment's train.py as a module of its own, experiment_base's unless named."""
    return load_module(ROOT / name / "train.py", f"{name}_train")


def output_file(text):
    """An argparse type for an option naming a file to write (--json, --out FILE.png): refused at once, in one line,
    when it is a folder, runs through a file, or lies where no file can be made; found only when the results were
    written, it cost the run's work and gave a traceback. A missing folder is fine: it is made when written."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder: give a file's name")
    writable_folder(path.parent)
    return path


def output_folder(text):
    """An argparse type for an option naming a folder to write in (--out FOLDER), checked as output_file checks."""
    path = Path(text)
    writable_folder(path)
    return path


def writable_folder(folder):
    """Raise ArgumentTypeError unless folder is, or can be made as, a folder to write in: its nearest existing part
    must be a folder in which a file can be made (tried, as a temporary file: permissions, a read-only disk)."""
    existing = next(part for part in [folder, *folder.parents] if os.path.exists(part))  # "." or "/" at the last
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{existing} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot create a file in {existing}: {e.strerror}")


def workload_parser(description, steps, only):
    """The options both benchmarks of a GRPO step share: model, sizes, steps, dtype, data, --only, --json."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-name", default="packaged:gemma-3-270m", help="hub id, local folder or .gguf (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=4, help="completions per prompt (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="completion budget (default: %(default)s)")
    p.add_argument("--steps", type=int, default=steps, help="steps per run; the first is a warm-up (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="model dtype, as experiment_base's --dtype (default: %(default)s)")
    p.add_argument("--data-path", default=str(ROOT / "data" / "math_tasks.jsonl"), help="prompts (default: data/math_tasks.jsonl)")
    p.add_argument("--only", choices=only, help="run one of them in this process and print its JSON")
    p.add_argument("--json", type=output_file, help="also write the results as JSON here")
    return p


def check_steps(parser, args):
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is a warm-up")
    return args


def workload(args, base):
    """(model folder, dtype, device, tokenizer, tasks): the same for both sides; each task carries its formatted
    prompt."""
    device = "cuda" if base.torch.cuda.is_available() else "cpu"
    path = base.resolve_model_path(args.model_name)
    dtype = base.resolve_dtype(args.dtype, device)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tasks = base.load_tasks(args.data_path, max_rows=args.prompts * args.steps)
    for task in tasks:
        task["prompt"] = base.format_prompt(tokenizer, task["question"])
    return path, dtype, device, tokenizer, tasks


def resolved_dtype(name):
    """The dtype experiment_base's --dtype NAME gives on this machine (auto: bfloat16 where the hardware has it)."""
    base = load_experiment()
    return base.resolve_dtype(name, "cuda" if base.torch.cuda.is_available() else "cpu")


def peak_memory(device):
    import torch

    peak = {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if device == "cuda":
        peak["gpu_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return peak


def project_steps(base, options, tasks, args, profile=None, evaluation=None):
    """Load the model and run args.steps GRPO steps of experiment_base, timing sampling and the whole step, and
    counting each step's training FLOPs (training_flops); on CUDA also the peak GPU memory, allocated and reserved,
    of each phase. profile: a dict that receives the PyTorch profiler's table of the training phase of one more
    step, run after the measured ones (the profiler's own time and memory stay out of the figures). evaluation: a
    dict holding "tasks", the held-out tasks of train.py's step-0 evaluation, run first and timed into it
    ("seconds", "tokens")."""
    torch = base.torch
    cuda = options.device.startswith("cuda")
    torch.manual_seed(0)
    model, tokenizer = base.load_model(options)
    optimizer = base.make_optimizer(model, options)
    if evaluation is not None:  # as train.py's run does before its first step
        spied = []
        rollout = base.rollout
        base.rollout = lambda *a, **k: spied.append(rollout(*a, **k)) or spied[-1]
        started = time.perf_counter()
        try:
            evaluation.update(base.evaluate(model, tokenizer, evaluation.pop("tasks"), options, base.Scorer())[0])
        finally:
            base.rollout = rollout
        evaluation.update(seconds=time.perf_counter() - started, tokens=int(spied[0].action_mask.sum()),
                          rows=len(spied[0].completions), **(gpu_peaks(torch, "evaluation") if cuda else {}))
        if getattr(args, "progress", False):
            print(f"evaluation: {json.dumps(evaluation)}", flush=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0)  # constant, as --warmup-steps 0
    steps = []
    for step in range(args.steps + (profile is not None)):  # --profile: one more step, profiled and not counted
        peaks = {}
        started = time.perf_counter()
        model.eval()
        start = min(step, args.steps - 1) * args.prompts  # the profiled extra step takes the last step's prompts
        with base.sampling_weights(model, options):  # as train.py samples: 4-bit weights dequantized once a rollout
            result = base.rollout(model, tokenizer, tasks[start : start + args.prompts], args.group_size,
                                  args.max_new_tokens, options.temperature,  # the T train_step takes log-probs at
                                  generation_batch_size=options.generation_batch_size)
        sampled = time.perf_counter()
        if cuda:
            peaks.update(gpu_peaks(torch, "sampling"))
        advantages = base.group_advantages(result.rewards.view(-1, args.group_size)).flatten().to(options.device)
        model.train()
        batch = (result.sequence_ids, result.attention_mask, result.action_mask, advantages)
        passes = []  # the passes train_step runs (with beta = 0 none over a completion whose advantage is 0)
        with spied_packing(base, passes):
            if step == args.steps:  # the extra step's training phase, operator by operator
                profile["peak_rss_gb"] = peak_memory(options.device)["peak_rss_gb"]  # the measured steps' peak, before it
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
                    base.train_step(model, batch, options, optimizer, scheduler)
                operators = profiler.key_averages()
                profile["table"] = operators.table(sort_by="self_cpu_time_total", row_limit=15)
                profile["operator_seconds"] = sum(op.self_cpu_time_total for op in operators) / 1e6
                profile["matmul_seconds"] = sum(op.self_cpu_time_total for op in operators if is_matmul(op.key)) / 1e6
            else:
                base.train_step(model, batch, options, optimizer, scheduler)
        if cuda:
            peaks.update(gpu_peaks(torch, "training"))
        flops = sum(training_flops(model.config, options.lora_r, *rows, options.gradient_checkpointing, repeated=repeated)
                    if gradients else sum(forward_flops(model.config, options.lora_r, *rows, repeated)[:2])
                    for *rows, repeated, gradients in passes)
        ran = (advantages != 0).cpu() if options.kl_weight == 0 else torch.ones(len(advantages), dtype=torch.bool)
        if step == args.steps:
            profile["training_flops"] = flops  # done by the matrix multiplies and attention (is_matmul)
            break
        steps.append({"seconds": time.perf_counter() - started, "sampling_seconds": sampled - started,
                      "tokens": int(result.action_mask.sum()), "training_flops": flops, "trained": int(ran.sum()),
                      "completions": len(ran), **peaks})
        if getattr(args, "progress", False):  # a command that a time limit may stop keeps the steps it finished
            print(f"step {step + 1}: {json.dumps(steps[-1])}", flush=True)
    return steps


@contextlib.contextmanager
def spied_packing(base, passes):
    """Inside: each call of tiny_grpo.logprobs.pack_prompts (every pass of sequence_log_probs) appends to passes (the rows' prompt
    tokens, their completion tokens, repeated: whether a row's prompt was already run for an earlier row of its
    packed sequence, and whether the pass takes gradients): the rows and layout the FLOPs are counted on. A pass
    without gradients (pi_ref's) counts one forward of the body and the output layer."""
    real = tiny_grpo.logprobs.pack_prompts

    def spy(input_ids, attention_mask, num_actions, config):
        packed = real(input_ids, attention_mask, num_actions, config)
        width = input_ids.shape[1] - num_actions
        sequence = (packed[3][:, 0] // packed[0].shape[1]).tolist()  # the packed sequence each row joined
        passes.append((attention_mask[:, :width].sum(1).tolist(), attention_mask[:, width:].sum(1).tolist(),
                       [s in sequence[:i] for i, s in enumerate(sequence)], base.torch.is_grad_enabled()))
        return packed

    tiny_grpo.logprobs.pack_prompts = spy
    try:
        yield
    finally:
        tiny_grpo.logprobs.pack_prompts = real


def is_matmul(operator):
    """Does a profiler operator do the FLOPs training_flops counts? The matrix multiplies, and attention (its
    products run inside one fused operator, forward and backward)."""
    return operator in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm") or "scaled_dot_product" in operator


def step_summary(steps):
    """Over the steps after the first (a warm-up; all of them if there is one): median seconds per step and of
    sampling, sampled tokens per second, and where the steps counted their training FLOPs, the training phase's
    FLOP/s (all its FLOPs over all its seconds)."""
    measured = steps[1:] or steps
    summary = {"step_seconds": statistics.median(s["seconds"] for s in measured),
               "sampling_seconds": statistics.median(s["sampling_seconds"] for s in measured),
               "tokens_per_second": sum(s["tokens"] for s in measured) / sum(s["sampling_seconds"] for s in measured)}
    if all("training_flops" in s for s in measured):
        seconds = sum(s["seconds"] - s["sampling_seconds"] for s in measured)
        summary["training_flops_per_second"] = sum(s["training_flops"] for s in measured) / seconds
    return summary


def training_flops(config, lora_r, prompt_tokens, completion_tokens, checkpointing=True, reference_pass=False,
                   repeated=None):
    """The matrix-multiply FLOPs one GRPO training step needs for sequences of prompt_tokens[i] real prompt tokens and
    completion_tokens[i] action tokens (padding not counted: the work the algorithm needs, not what a layout adds).

    A forward pass costs, per token, 2 x the weights of the body's linear layers (q, k, v, o, gate, up, down in each
    layer), plus LoRA's 2 x r x (in + out) per adapted layer; per layer and pair of positions a token attends to
    (causal), 2 x 2 x heads x head_dim (scores and the weighted sum); the output layer 2 x hidden x vocab per action
    token only (no other row reaches it). A training pass is that forward, its recomputation under gradient
    checkpointing (the body's layers), and the backward pass, which costs one forward for the input gradients (the
    frozen weights need no weight gradient) and, for LoRA, one more for its weight gradients. The output layer is
    counted twice: its forward and its input gradient, which the experiments' ActionLogProb forms in the forward
    pass (it is not computed again; before 2026-11-27 it was, and this count had it three times with checkpointing).
    A reference pass (beta > 0) is one more forward. Element-wise work (norms, softmax, rotary, the entropy) is not
    counted. repeated[i]: row i's prompt was already run for an earlier row of its packed sequence (the
    experiments' pack_prompts), so the row adds only its completion (forward_flops)."""
    body, head, adapter = forward_flops(config, lora_r, prompt_tokens, completion_tokens, repeated)
    forwards = 3 if checkpointing else 2  # forward, recomputation, backward (input gradients)
    total = forwards * body + 2 * head + (forwards + 1) * adapter  # LoRA's weight gradients: one forward more
    return total + (body + head if reference_pass else 0)


def forward_flops(config, lora_r, prompt_tokens, completion_tokens, repeated=None):
    """(body, output layer, LoRA): the matrix-multiply FLOPs of one forward pass, as training_flops counts them. A
    row whose prompt its packed sequence already holds (repeated[i]) adds its completion's tokens, and their
    attention to the prompt and to each other; not the prompt again."""
    repeated = repeated or [False] * len(prompt_tokens)
    c = getattr(config, "text_config", config)
    hidden, inner, layers, vocab = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    heads, kv_heads = c.num_attention_heads, getattr(c, "num_key_value_heads", c.num_attention_heads)
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    shapes = [(hidden, heads * head_dim), (hidden, kv_heads * head_dim), (hidden, kv_heads * head_dim),
              (heads * head_dim, hidden), (hidden, inner), (hidden, inner), (inner, hidden)]  # (in, out) per layer
    weights = layers * sum(i * o for i, o in shapes)
    lora = layers * lora_r * sum(i + o for i, o in shapes)
    tokens = sum(p for p, again in zip(prompt_tokens, repeated) if not again) + sum(completion_tokens)
    pairs = sum((p + t) * (p + t + 1) // 2 - (p * (p + 1) // 2 if again else 0)
                for p, t, again in zip(prompt_tokens, completion_tokens, repeated))
    body = 2 * weights * tokens + 4 * layers * heads * head_dim * pairs
    head = 2 * hidden * vocab * sum(completion_tokens)
    adapter = 2 * lora * tokens
    return body, head, adapter


def trl_steps(args, model, tokenizer, tasks, score, device, lr, beta, train_batch_size=None, generation_batch_size=None,
              optim=None, bf16=False):
    """TRL's GRPOTrainer on the same workload as project_steps: args.steps optimizer steps, each of args.prompts x
    args.group_size completions of up to args.max_new_tokens tokens sampled at temperature 1 (generation_batch_size
    at a time, default all), trained train_batch_size at a time (default all) in one update; LoRA r=args.lora_r,
    alpha 2r, on every linear layer, gradient checkpointing, the GRPO loss with std-scaled group advantages. Per step:
    seconds, sampling seconds, sampled tokens, and on CUDA the step's peak GPU memory, allocated and reserved.
    optim: a transformers optimizer name (None: its default)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sequences = args.prompts * args.group_size
    train_batch_size = train_batch_size or sequences
    tokenizer.padding_side = "left"
    dataset = Dataset.from_dict({"prompt": [t["prompt"] for t in tasks], "answer": [t["answer"] for t in tasks]})

    def reward(prompts, completions, answer, **kwargs):
        return score(completions, answer, [{}] * len(answer))[0].tolist()

    steps, marks = [], {}
    cuda = device.startswith("cuda")

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            marks["start"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            steps.append({"seconds": time.perf_counter() - marks["start"], "sampling_seconds": marks.pop("sampling", 0.0),
                          "tokens": marks.pop("tokens", 0), **(gpu_peaks(torch, "step") if cuda else {})})

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), max_steps=args.steps, learning_rate=lr, beta=beta,
        per_device_train_batch_size=train_batch_size, gradient_accumulation_steps=sequences // train_batch_size,
        num_generations=args.group_size, generation_batch_size=generation_batch_size or sequences, num_iterations=1,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, loss_type="grpo",
        scale_rewards="group", epsilon=0.2, gradient_checkpointing=True, use_cpu=not cuda, bf16=bf16,
        logging_steps=1, report_to="none", save_strategy="no", shuffle_dataset=False, disable_dropout=True, seed=0,
        **({"optim": optim} if optim else {}),
    )
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer,
                          peft_config=lora, callbacks=[Timer()])
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **k):  # sampling and scoring, as the project's rollout
        started = time.perf_counter()
        out = generate(*a, **k)
        marks["sampling"] = marks.get("sampling", 0.0) + time.perf_counter() - started
        marks["tokens"] = marks.get("tokens", 0) + int(out["completion_mask"].sum())
        return out

    trainer._generate_and_score_completions = timed_generate
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    trainer.train()
    return steps


def gpu_peaks(torch, phase):
    """The peak GPU memory since the last call, allocated and reserved, in GB; then the peaks start again."""
    torch.cuda.synchronize()
    peaks = {f"{phase}_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
             f"{phase}_reserved_gb": torch.cuda.max_memory_reserved() / 2**30}
    torch.cuda.reset_peak_memory_stats()
    return peaks


def run_alone(script, only, argv):
    """Run `script --only ONLY ARGV` in a fresh process (its peak memory is its own); returns its RESULT JSON."""
    process = subprocess.run([sys.executable, str(script), "--only", only, *argv], capture_output=True, text=True)
    lines = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
    if process.returncode != 0 or not lines:
        sys.exit(f"error: {only} failed:\n{process.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


ISA_CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")  # what caps torch's CPU kernels


def machine(dtype):
    """Where a figure was measured, printed as one line and returned as a dict: the CPU model, its cores, whether it
    has AVX512-BF16 (without it bfloat16 matmuls are emulated, and experiment_base's --dtype auto picks float32) and
    AMX, the vector kernels torch runs (AVX512, AVX2, ...) with any cap the environment put on them, and the dtype the
    benchmark used. A figure means little without them: the same run differs by CPU, and by the kernels on one CPU
    (ATEN_CPU_CAPABILITY=avx2 with MKL's and oneDNN's caps runs an AVX-512 CPU's float32 as one without AVX-512)."""
    import torch

    fields = {}  # the first processor's "model name" and "flags"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:  # not Linux: the model from platform, the flags unknown
        pass
    flags = set(fields.get("flags", "").split())
    info = {"cpu": fields.get("model name") or platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
            "kernels": torch.backends.cpu.get_cpu_capability(), "dtype": str(dtype).removeprefix("torch.")}
    caps = {name: os.environ[name] for name in ISA_CAPS if os.environ.get(name)}
    if caps:
        info["isa_caps"] = caps
    print(f"machine: {info['cpu']}, {info['cores']} cores, AVX512-BF16 {'yes' if info['avx512_bf16'] else 'no'}, "
          f"AMX-BF16 {'yes' if info['amx_bf16'] else 'no'}, kernels {info['kernels']}"
          + "".join(f", {name}={value}" for name, value in caps.items()) + f"; dtype {info['dtype']}", flush=True)
    return info


def write_json(path, results, where):
    """Write results, with `where` (machine()'s dict) under "machine", as JSON to path (nothing when path is None)."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**results, "machine": where}, indent=2))
        print(f"\nwrote {path}")


if __name__ == "__main__":  # .ci/run prints where the tests run: python benchmarks/common.py
    import torch

    machine("float32 and bfloat16 (tests); experiment_base's --dtype auto picks "
            + ("bfloat16" if torch.cpu._is_avx512_bf16_supported() else "float32") + " on this CPU")


def event_files(log_dir):
    """The TensorBoard event files of the run in log_dir: those in the folder itself, as TensorBoard takes a folder's
    files for one run. A subfolder is none of it: superseded-*/ holds an earlier start's events, set aside by train.py
    (TensorBoard shows it as a run of its own), wandb/ holds W&B's files."""
    from tensorboard.backend.event_processing.io_wrapper import IsSummaryEventsFile

    folder = Path(log_dir)
    return sorted(f for f in folder.iterdir() if f.is_file() and IsSummaryEventsFile(str(f))) if folder.is_dir() else []


def scalars(log_dir):
    """{tag: [(step, value), ...]} of the run in log_dir, as TensorBoard loads it: its event_files in order, each
    purge_step (train.py's Logger writes one on --resume) dropping the steps from it on that an earlier start wrote
    after its last checkpoint; one value per step (the last)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # the folder ending in a separator: a folder whose name holds "tfevents" would be opened as one event file
    accumulator = EventAccumulator(os.path.join(log_dir, ""), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: sorted({e.step: e.value for e in accumulator.Scalars(tag)}.items())
            for tag in accumulator.Tags()["scalars"]}
