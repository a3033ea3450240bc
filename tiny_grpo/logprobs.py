"""The fast form of the story's log-probs, log_softmax(logits / T) gathered at the actions: the output layer in
blocks, its gradient written out, prompts packed. Tests hold it equal to the plain form, values and gradients."""

import math

import torch

from tiny_grpo.errors import InputError
from tiny_grpo.models import uncast_lora_inputs

def body_and_head(model):
    """(the transformer body, LoRA layers included; the output layer as hidden [N, H] -> float32 logits [N, V]), apart
    so that only the rows that need logits reach the output layer (262k columns for Gemma-3), as contiguous 2-D rows
    (a strided [B, 1, H] slice makes PyTorch's CPU matmul copy the whole matrix per row: 100x slower at 262k)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lm_head, softcap = output_layer(model)
    product = getattr(lm_head, "sampling_product", None)  # its weight packed for oneDNN, inside sampling_weights
    return base.get_decoder(), lambda hidden: output_logits(hidden, lm_head.weight, lm_head.bias, softcap, product=product)

def output_layer(model):
    """(the output layer, a torch.nn.Linear; its logit soft-capping s, or None)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lm_head = base.get_output_embeddings()
    if type(lm_head) is not torch.nn.Linear:  # ActionLogProb writes out the gradient of a plain linear layer
        raise InputError(f"the model's output layer is a {type(lm_head).__name__}, not a torch.nn.Linear: "
                         "ActionLogProb needs it unquantized and without an adapter")
    return lm_head, getattr(base.config, "final_logit_softcapping", None)

OUTPUT_BLOCK = 1024  # on a CPU in float32, output_logits forms W h^T this many vocabulary ids at a time (README)

def output_logits(hidden, weight, bias=None, softcap=None, temperature=1.0, work=None, product=None):
    """Float32 logits z = c(W h + b) / T [N, V] of rows h [N, H]: c the Gemma-2 style soft-capping s tanh(u / s) when
    the model has one, T the sampling temperature. Into work = (a buffer of at least V N elements in W's dtype,
    z [n, V] float32, ...), n >= N, when given (ActionLogProb's workspace), else into new tensors. Autograd off
    (the sampler, ActionLogProb's two passes): the products write into their buffers. product: W h + b's fast form
    (a PackedLinear, the same bits), taken instead of the products below when given and no work is."""
    x = hidden.to(weight.dtype)
    if product is not None and work is None:
        return output_logits_after(product(x).float(), softcap, temperature)
    # u = W h + b, taken as u^T = W h^T [V, N], not h W^T: at V = 262k PyTorch's CPU
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
    return output_logits_after(logits, softcap, temperature)

def output_logits_after(logits, softcap, temperature):
    """u [N, V] float32 -> z = c(u) / T, in place."""
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
        exp = exp_(torch.sub(logits, top, out=work[2][: len(hidden)]))  # e^(z - m), as .exp_() (exp_, below)
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

EXP_FLOOR = -87.0  # exp_ gives 0 at or below it: e^-87 = 1.6e-38, float32's normal range ends at 1.2e-38 (e^-87.34)
AT_FLOOR = torch.full((64,), EXP_FLOOR).exp_()[0].item()  # e^floor as .exp_() rounds it (once, at import)

def exp_(x):
    """x.exp_()'s fast form for x = z - max(z) in ActionLogProb's forward pass: e^x in place, and 0 where
    x <= EXP_FLOOR (e^x <= 1.6e-38), as a CPU that flushes float32's subnormal numbers to zero; NaN stays NaN. On the
    EPYC without AVX-512, PyTorch's exp took 15 to 40 times as long for an input whose e^x is below float32's normal
    range (docs/results/roofline.md); at T = 0.35 a fifth of Gemma-3's 262,144 shifted logits are there, and .exp_()
    took 145 ms of a 64-row chunk, this 23 ms. Above the floor, the same bits; below it, values under 1.6e-38 beside
    a sum of at least 1 (the top logit's e^0), which float32 cannot hold: log-probs, entropies and d log pi / dh came
    out the same bits on a Gemma-3 batch and in test_exp_flushes_only_what_float32_cannot_add. Not in --no-lora's
    backward pass, whose dL/dW has rows made of such values alone: there, .exp_()."""
    return torch.nn.functional.threshold_(x.clamp_(min=EXP_FLOOR).exp_(), AT_FLOOR, 0.0)  # 0 where <= e^floor

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

def fast_log_probs(model, input_ids, attention_mask, num_actions, temperature=1.0, action_mask=None):
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
    action_mask = (attention_mask[:, -num_actions:] if action_mask is None else action_mask).bool()
    # [N, H]: the state before token t predicts token t. index_select, not [before[action_mask]]: a prompt's last state
    # is before each of its completions' first tokens, and indexing's backward adds those gradients up in any order
    # on two threads (PyTorch's parallel index_put_), index_select's in the order of the rows (index_add_)
    hidden = hidden.flatten(0, 1).index_select(0, before[action_mask])
    actions = input_ids[:, -num_actions:][action_mask]  # [N]
    lm_head, softcap = output_layer(model)
    chunk = max(1, LOGITS_CHUNK_ELEMENTS // model.config.vocab_size)  # rows per chunk
    work = output_workspace(min(chunk, len(hidden)), lm_head.weight)  # shared by the chunks' forward and backward
    log_probs, entropy = zip(*[ActionLogProb.apply(h, lm_head.weight, lm_head.bias, a, softcap, temperature, work)
                               for h, a in zip(hidden.split(chunk), actions.split(chunk))])
    zeros = torch.zeros(action_mask.shape, device=hidden.device)
    return zeros.masked_scatter(action_mask, torch.cat(log_probs)), zeros.masked_scatter(action_mask, torch.cat(entropy))

def pack_prompts(input_ids, attention_mask, num_actions, config):
    """The rows of a batch that share a prompt (their first W - num_actions columns, ids and mask), packed into one
    sequence each: [prompt, completion 1, ..., completion k], k as large as saves FLOPs (below), a prompt's rows split
    evenly among its sequences (16 rows at most 15 a sequence: 8 + 8, not 15 + 1), each completion without the
    padding after its last real token (one with 40 tokens in a batch 128 wide takes 40 columns). The body then runs
    each prompt once per packed sequence instead of once per completion: at 4 prompts x 4 x 64 on Gemma-3 two thirds
    of every row is prompt (README, "Speed and memory against TRL"). A 4-D attention mask lets each completion token
    see the prompt and the earlier tokens of its own completion, as in its row (sliding-window layers: the same
    window, counted in the row's columns), and every token keeps its row's position id: the same log-probs as the rows
    one by one, up to float rounding (tested).
    Returns (ids [K, L], position ids [K, L], the mask, before [B, num_actions]: where the state before each completion
    token lies in the packed hidden states [K L, H]). Only SDPA takes such a mask: with another attention
    (flash-attention 2 on CUDA) or another kind of layer, every row is a sequence of its own, with its 2-D mask, as
    wide as the longest of them."""
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
    # each completion without its trailing padding: a batch's rows are as wide as its longest, which may be 3x the rest
    token = torch.arange(num_actions, device=device)
    ends = ((token + 1) * attention_mask[:, prompt_width:]).amax(1)  # [B]: the columns up to its last real token
    keep = token < ends[:, None]  # [B, num_actions]
    earlier = (group[:, None] == group[None, :]) & (member[None, :] < member[:, None])  # the rows packed before it
    start = prompt_width + (earlier.long() * ends[None, :]).sum(1)  # [B]: where its completion begins
    length = int((start + ends).max())
    where = start[:, None] + token  # [B, num_actions]: each completion token's column in its packed sequence

    def packed(x, fill=0):  # [B, W] -> [K, L]: the prompt, then each of the sequence's rows' completions in turn
        out = x.new_full((len(first), length), fill)
        out[:, :prompt_width] = x[first, :prompt_width]
        out[group[:, None].expand_as(where)[keep], where[keep]] = x[:, prompt_width:][keep]
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
