"""What fits in 24 GB: GPU memory of experiment_base's default CUDA run, from parts measured on CPU.

Builds the Llama-3.2-1B architecture from its public configuration with random weights (nothing is
downloaded: memory does not depend on the values), loads it the way experiment_base does on CUDA
(4-bit NF4 with double quantization, bfloat16 compute, LoRA rank 16 on every linear layer, gradient
checkpointing), and measures on the CPU:

  * the quantized model's bytes (bitsandbytes' own footprint), the LoRA parameters and the 4-bit layers'
    weights (sampling holds them dequantized to bfloat16: --sampling-weights);
  * the KV cache bytes per token, from a real cache after a prefill;
  * the bytes autograd saves for the backward pass per token, with checkpointing (what the whole
    forward keeps) and for one decoder layer without it (what the backward pass recomputes at a time),
    counted exactly with saved-tensor hooks. On CPU, SDPA's math path keeps the attention
    probabilities, which flash-attention on a GPU does not: the layer figure is an upper bound.

Then arithmetic scales the parts to the run (group 8 x prompts per generation batch, 512-token
completions, micro-batches of --train-batch-size) and prints the peak of the sampling phase and of
the training phase.

    python benchmarks/memory_estimate.py
    python benchmarks/memory_estimate.py --generation-batch-size 512 --max-length 2048
    python benchmarks/memory_estimate.py --tiny          # a 2-layer model of the same shape, for a quick check
"""

import argparse
import tempfile

from common import LLAMA_3_2_1B, build_random_llama, load_experiment, machine, output_file, write_json
import tiny_grpo.logprobs

GB = 2**30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (default: %(default)s)")
    p.add_argument("--generation-batch-size", type=int, default=256, help="sequences sampled at once (default: %(default)s)")
    p.add_argument("--train-batch-size", type=int, default=16, help="sequences per micro-batch (default: %(default)s)")
    p.add_argument("--prompt-length", type=int, default=160, help="prompt tokens (default: %(default)s)")
    p.add_argument("--max-length", type=int, default=512, help="completion budget (default: %(default)s)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (default: %(default)s)")
    p.add_argument("--measure-tokens", type=int, default=256, help="tokens of the CPU measurements (default: %(default)s)")
    p.add_argument("--tiny", action="store_true", help="2 layers instead of 16 (the per-layer parts scale)")
    p.add_argument("--json", type=output_file, help="also write the parts and totals as JSON here")
    args = p.parse_args(argv)
    least = {"group_size": 1, "generation_batch_size": 1, "train_batch_size": 1, "prompt_length": 1, "max_length": 1,
             "lora_r": 1, "measure_tokens": 2}  # half of the measured tokens are a completion: at least 2
    for name, minimum in least.items():
        if getattr(args, name) < minimum:
            p.error(f"--{name.replace('_', '-')} must be at least {minimum}, got {getattr(args, name)}")
    return args


def saved_bytes(function, model):
    """Run function() and count the bytes autograd saves for the backward pass (each storage once), less the model's
    weights (the output layer's, which ActionLogProb saves): they are counted once, as weights."""
    import torch

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), 0

    def pack(tensor):
        nonlocal total
        key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key not in seen and key[0] not in weights and tensor.device.type == "cpu":
            seen.add(key)
            total += key[1]
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return total


def measure(args):
    import bitsandbytes as bnb
    import torch

    base = load_experiment()
    with tempfile.TemporaryDirectory() as folder:
        config = build_random_llama(folder, **({"num_hidden_layers": 2} if args.tiny else {}))  # the real shapes
        options = base.parse_args(["--model-name", folder, "--device", "cpu", "--quantization", "4bit",
                                   "--dtype", "bfloat16", "--lora-r", str(args.lora_r),
                                   "--lora-alpha", str(2 * args.lora_r), "--gradient-checkpointing"])  # CUDA's default
        model, _ = base.load_model(options)
    layers = config.num_hidden_layers
    weights = model.get_memory_footprint()
    quantized = sum(m.weight.quant_state.shape.numel() for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ids = torch.randint(0, config.vocab_size, (1, args.measure_tokens))
    mask = torch.ones_like(ids)

    model.eval()
    with torch.no_grad():  # KV cache per token, from a real cache
        cache = tiny_grpo.logprobs.body_and_head(model)[0](input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        kv = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values)) / args.measure_tokens

    model.train()  # what the forward keeps for the backward pass, with checkpointing (the default)
    head = tiny_grpo.logprobs.output_layer(model)[0].weight
    head.requires_grad_(True)  # ActionLogProb then keeps h [N, H] for a backward that recomputes, instead of forming
    # d log pi / dh [N, H] in the forward: the same bytes (and 12 an action token of actions and log-sum-exp; with
    # the tied embeddings, by our reading, their lookup's ids), without a [N, V] x [V, H] product in bf16, which a
    # CPU without AVX512-BF16 emulates at about 0.3 GFLOP/s
    try:
        keep = saved_bytes(lambda: base.sequence_log_probs(model, ids, mask, args.measure_tokens // 2)[0].sum(), model) / args.measure_tokens
    finally:
        head.requires_grad_(False)
    layer = tiny_grpo.logprobs.body_and_head(model)[0].layers[0]
    hidden = torch.randn(1, args.measure_tokens, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(args.measure_tokens)[None]
    rotary = tiny_grpo.logprobs.body_and_head(model)[0].rotary_emb(hidden, positions)
    model.eval()  # checkpointing is off outside training mode: the layer keeps all it needs, as when recomputed
    recompute = saved_bytes(lambda: layer(hidden, attention_mask=None, position_embeddings=rotary,
                                          position_ids=positions), model) / args.measure_tokens
    return {"weights": weights, "lora_params": lora, "quantized_params": quantized, "kv_per_token": kv, "checkpoint_per_token": keep,
            "layer_recompute_per_token": recompute, "layers": layers, "vocab": config.vocab_size,
            "measured_layers": layers, "full_layers": LLAMA_3_2_1B["num_hidden_layers"]}


def estimate(parts, args):
    """Scale the measured parts to the run; bytes."""
    scale = parts["full_layers"] / parts["measured_layers"]  # per-layer parts, when measured on --tiny
    sequence = args.prompt_length + args.max_length
    lora = parts["lora_params"] * scale
    optimizer = lora * (4 + 4 + 2)  # fp32 LoRA weights and gradients, paged 8-bit AdamW's two states
    vocab = parts["vocab"]
    sampling = {
        "weights (4-bit NF4 + bf16 embeddings/norms)": parts["weights"],
        "LoRA weights, gradients, 8-bit AdamW": optimizer,
        "4-bit layers dequantized to bf16 (--sampling-weights auto/dequantized)": parts["quantized_params"] * scale * 2,
        "KV cache": parts["kv_per_token"] * scale * args.generation_batch_size * sequence,
        "next-token logits, probabilities, CDF (fp32)": 3 * 4 * args.generation_batch_size * vocab,
    }
    tokens = args.train_batch_size * sequence
    training = {
        "weights (4-bit NF4 + bf16 embeddings/norms)": parts["weights"],
        "LoRA weights, gradients, 8-bit AdamW": optimizer,
        "activations kept by checkpointing": parts["checkpoint_per_token"] * scale * tokens,
        "one layer recomputed in the backward pass": parts["layer_recompute_per_token"] * tokens,
        "output-layer workspace (2^24 logits: one bf16 buffer, two fp32)": (2 + 4 + 4) * 2**24,
    }
    return {"sampling": sampling, "training": training}


def main(argv=None):
    args = parse_args(argv)
    parts = measure(args)
    phases = estimate(parts, args)
    print(f"\nLlama-3.2-1B, 4-bit NF4 + LoRA r{args.lora_r}, completions of {args.max_length} tokens after "
          f"{args.prompt_length}-token prompts, {args.generation_batch_size} sequences sampled at once "
          f"(group {args.group_size}), micro-batches of {args.train_batch_size}\n")
    print(f"measured on CPU: weights {parts['weights'] / GB:.2f} GB, LoRA {parts['lora_params'] / 1e6:.1f} M parameters, "
          f"KV cache {parts['kv_per_token'] / 1024:.1f} KiB/token, kept by checkpointing "
          f"{parts['checkpoint_per_token'] / 1024:.1f} KiB/token, one layer's recompute "
          f"{parts['layer_recompute_per_token'] / 1024:.1f} KiB/token"
          + (f" (on {parts['measured_layers']} layers, scaled to {parts['full_layers']})" if args.tiny else "") + "\n")
    for phase, items in phases.items():
        print(f"| {phase} | GB |\n| --- | --- |")
        for name, value in items.items():
            print(f"| {name} | {value / GB:.2f} |")
        print(f"| **peak, {phase}** | **{sum(items.values()) / GB:.2f}** |\n")
    write_json(args.json, {"parts": parts, "phases_gb": {p: {k: v / GB for k, v in i.items()} for p, i in phases.items()}},
               machine("bfloat16 (the CUDA default it estimates)"))


if __name__ == "__main__":
    main()
