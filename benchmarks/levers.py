"""Which performance levers pay: experiment_base's step with one lever switched off at a time.

Each configuration runs in its own process (so its peak memory is its own) on the same workload as
benchmarks/step_time.py (4 prompts x 4 completions x 64 tokens, EOS-only stopping, beta 0 unless
the configuration says otherwise) and reports the median sampling and training seconds over the
steps after a warm-up, and peak RSS.

    python benchmarks/levers.py                            # packaged Gemma-3-270M on CPU, every configuration
    python benchmarks/levers.py --configs default fp32     # some of them

Configurations (each differs from `default` in one thing):
  default          bfloat16 on CPUs with AMX/AVX512-BF16, inverse-CDF sampling, ended rows dropped from the decode
                   batch, decoder + output layer on
                   the last prompt row only, log-probs of action tokens in chunks (the output layer's gradient
                   formed in each chunk's forward pass, not recomputed; since 2026-11-27), activations kept (no
                   gradient checkpointing on a CPU; since 2026-11-30)
  fp32             float32 weights and compute
  multinomial      torch.multinomial instead of inverse-CDF sampling
  keep_ended       rows that have ended stay in the decode batch to the last step (same tokens, as before 2026-11-24)
  hf_prefill       the prefill through model(..., logits_to_keep=1), as transformers' generate does
  full_logits      log-probs from one [batch, tokens, vocab] float32 log-softmax over the completion
  autograd_head    the output layer's chunks under torch.utils.checkpoint with autograd's backward and new tensors
                   instead of ActionLogProb's written-out one in a workspace (as before 2026-11-26; the entropy
                   still once a chunk)
  checkpointing    gradient checkpointing: activations recomputed in the backward pass instead of kept
  kl               beta = 0.01: one more forward pass, through the reference policy
"""

import json
import resource
import statistics
import sys

from common import (check_steps, load_experiment, machine, project_steps, resolved_dtype, run_alone, workload,
                    workload_parser, write_json)
import tiny_grpo.decode
import tiny_grpo.logprobs

CONFIGS = ["default", "fp32", "multinomial", "keep_ended", "hf_prefill", "full_logits", "autograd_head", "checkpointing",
           "kl"]


def parse_args(argv=None):
    p = workload_parser(__doc__, steps=3, only=CONFIGS)
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=CONFIGS, help="configurations (default: all)")
    return check_steps(p, p.parse_args(argv))


def switch_off(base, config):
    """Patch experiment_base so that one lever is off."""
    torch = base.torch
    if config == "multinomial":
        def sample_token(logits, temperature, top_p, uniforms=None):
            if temperature == 0:
                return logits.argmax(-1)
            return torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1).squeeze(-1)
        base.sample_token = sample_token
    if config == "keep_ended":
        tiny_grpo.decode.ENDED_SHARE = 2.0  # above 1: never drop
    if config == "hf_prefill":  # the model's forward slices the last position itself: a strided [B, 1, H] matmul
        original = tiny_grpo.decode.body_and_head

        def body_and_head(model):
            body, head = original(model)
            return body, lambda hidden: head(hidden.unsqueeze(1)).squeeze(1)
        tiny_grpo.decode.body_and_head = body_and_head  # the fast decode's prefill
    if config == "full_logits":
        def sequence_log_probs(model, input_ids, attention_mask, num_actions=None, temperature=1.0, plain=False):
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False, logits_to_keep=num_actions + 1).logits[:, :-1].float() / temperature
            log_probs = torch.log_softmax(logits, -1)  # [B, T, V] float32
            taken = log_probs.gather(-1, input_ids[:, -num_actions:, None]).squeeze(-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1).detach()
            mask = attention_mask[:, -num_actions:].bool()
            return taken.masked_fill(~mask, 0), entropy.masked_fill(~mask, 0)
        base.sequence_log_probs = sequence_log_probs
    if config == "autograd_head":
        from torch.utils.checkpoint import checkpoint

        class ActionLogProb:
            @staticmethod
            def apply(hidden, weight, bias, actions, softcap, temperature, work):
                entropy = []  # from the chunk's forward pass, not again when the backward pass recomputes it

                def chunk(h, w, b):  # the output layer's product as output_logits forms it, in one piece: autograd records it
                    u = (w @ h.to(w.dtype).t() if b is None else torch.addmm(b[:, None], w, h.to(w.dtype).t())).t().float()
                    logits = (torch.tanh(u / softcap) * softcap if softcap else u) / temperature
                    log_z = logits.logsumexp(dim=-1)
                    if not entropy:
                        with torch.no_grad():
                            entropy.append(log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1))
                    return logits.gather(-1, actions.unsqueeze(-1)).squeeze(-1) - log_z

                if torch.is_grad_enabled():
                    return checkpoint(chunk, hidden, weight, bias, use_reentrant=False), entropy[0]
                return chunk(hidden, weight, bias), entropy[0]
        tiny_grpo.logprobs.ActionLogProb = ActionLogProb

def run_config(args, config):
    base = load_experiment()
    base.STOP_STRINGS = ()  # EOS only, as in step_time.py
    switch_off(base, config)
    path, dtype, device, _, tasks = workload(args, base)
    dtype_name = "float32" if config == "fp32" else str(dtype).removeprefix("torch.")
    options = base.parse_args(["--model-name", path, "--device", device, "--dtype", dtype_name, "--quantization", "none",
                               "--kl-weight", "0.01" if config == "kl" else "0", "--group-size", str(args.group_size),
                               "--rollouts-per-step", str(args.prompts), "--max-length", str(args.max_new_tokens),
                               "--train-batch-size", str(args.prompts * args.group_size), "--temperature", "1.0"]
                              + (["--gradient-checkpointing"] if config == "checkpointing" else []))
    steps = project_steps(base, options, tasks, args)
    measured = steps[1:]
    return {
        "sampling_seconds": statistics.median(s["sampling_seconds"] for s in measured),
        "training_seconds": statistics.median(s["seconds"] - s["sampling_seconds"] for s in measured),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main(argv=None):
    args = parse_args(argv)
    if args.only:
        print("RESULT " + json.dumps(run_config(args, args.only)))
        return
    results = {}
    for config in args.configs:  # each in a fresh process, which ignores --configs when given --only
        print(f"running {config} ...", flush=True)
        results[config] = run_alone(__file__, config, argv if argv is not None else sys.argv[1:])
    print(f"\n{args.prompts} prompts x {args.group_size} completions x {args.max_new_tokens} tokens, model {args.model_name}, "
          f"median of {args.steps - 1} steps\n")
    print("| configuration | sampling s | training s | step s | peak RSS GB |\n| --- | --- | --- | --- | --- |")
    for config, r in results.items():
        step = r["sampling_seconds"] + r["training_seconds"]
        print(f"| {config} | {r['sampling_seconds']:.2f} | {r['training_seconds']:.2f} | {step:.2f} | {r['peak_rss_gb']:.2f} |")
    write_json(args.json, results, machine(f"{resolved_dtype(args.dtype)} (fp32: float32)"))


if __name__ == "__main__":
    main()
