"""The fast form of sample's decode steps (ended rows leave the batch, per-row uniforms, the cache's room, a CUDA
graph on CUDA) and the token draw; tests hold them equal to the plain loop, token for token."""

import functools, sys, weakref  # noqa: E401

import torch

from tiny_grpo.logprobs import body_and_head

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

    def draw(self, logits, temperature, top_p, pad_id, sample_token):
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

SAMPLING_BLOCK = 512  # draw picks a block of this many vocabulary ids, then an id within it

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

@torch.no_grad()
def sample_fast(model, tokenizer, prompt_ids, prompt_mask, group_size, max_length, temperature, top_p, sample_token,
                stop_strings):
    """The fast form of a train.py's sample(plain=True), the same tokens (test_sample_fast_draws_the_plain_loops_tokens):
    the transformer and its output layer apart, logits for the last position only; decode_batch's steps, in which
    rows that ended leave the batch, each row draws its own uniforms, the KV cache gets its room once, and on CUDA
    a step is one CUDA graph. sample_token and stop_strings are the train.py's."""
    body, head = body_and_head(model)  # the transformer; the output layer, for the rows that need logits
    stop_ids = torch.tensor(stop_token_ids(model, tokenizer), device=prompt_ids.device)  # EOS, and the config's
    out = prefill(body, prompt_ids, prompt_mask)  # the prompts' forward; the beginning they share, once
    out.past_key_values.batch_repeat_interleave(group_size)  # each prompt's cache, once for each of its G completions
    logits = head(out.last_hidden_state[:, -1]).repeat_interleave(group_size, dim=0)
    batch = decode_batch(body, head, out.past_key_values, prompt_mask.repeat_interleave(group_size, dim=0), max_length)
    finished = torch.zeros(batch.rows, dtype=torch.bool, device=prompt_ids.device)
    tokens, actions = [], []
    for t in range(max_length):
        next_ids = batch.draw(logits, temperature, top_p, tokenizer.pad_token_id, sample_token)  # a_t ~ pi(. | s_t): sample_token
        next_ids = next_ids.masked_fill(finished, tokenizer.pad_token_id)
        tokens.append(next_ids)
        actions.append(~finished)  # a token is an action if its sequence had not ended before it
        finished = finished | torch.isin(next_ids, stop_ids) | ends_with_stop_string(tokenizer, tokens, finished, stop_strings)
        if finished.all() or t == max_length - 1:
            break
        logits = batch.step(next_ids, actions[-1], finished)  # s_t+1: one more position for the rows still running
    return torch.stack(tokens, dim=1), torch.stack(actions, dim=1).long()

SHARED_LEAST = 16  # prompts that share fewer first tokens than this are prefilled whole (above any length: always)

def prefill(body, prompt_ids, prompt_mask):
    """The prompts' forward pass and KV cache: body(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=
    positions that count real tokens only), the plain form, with the beginning the prompts share run once for each
    count of left pads. The held-out evaluation's 100 prompts share the worked example, 136 of their 158 to 166
    tokens, and the prefill was 60% of an evaluation (docs/results/roofline.md). A row is [pad x p | shared | own];
    its first p + L columns hold the same keys and values in every row of p pads (causal attention; a row's numbers
    do not depend on the other rows of the batch, measured to the bit, but do on the width: so the row is run whole),
    so one row a pad count is run, and the columns from L + min(p) on run over all rows after that cache, as the
    plain form's do: the same bits (test_a_shared_prompt_beginning_is_run_once_and_gives_the_same_bits). Where that
    would not run a quarter fewer tokens, the plain form."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    rows, width = prompt_ids.shape
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: positions count real tokens only
    pads = (prompt_mask == 0).sum(1)
    left_padded = bool((prompt_mask == (torch.arange(width, device=pads.device) >= pads[:, None])).all())
    window = getattr(getattr(body, "config", None), "sliding_window", None)
    shared = shared_length(prompt_ids, pads) if rows > 1 and left_padded and (window is None or width < window) else 0
    start = shared + int(pads.min())  # every row's columns before start are its pads and shared tokens
    cost = len(pads.unique()) * width + rows * (width - start)  # tokens run: a whole row a pad count, then the rest
    if shared < SHARED_LEAST or cost > 0.75 * rows * width:
        return body(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True)
    caches = {pad: body(input_ids=prompt_ids[row], attention_mask=prompt_mask[row], position_ids=positions[row],
                        use_cache=True).past_key_values
              for pad, row in first_row_per_pad(pads)}  # a whole row for each count of pads
    if any(type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) for c in caches.values() for layer in c.layers):
        return body(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True)
    cache = caches[int(pads[0])]  # its layers take every row's pads and shared tokens, before its own
    for i, layer in enumerate(cache.layers):
        layer.keys, layer.values = [torch.stack([getattr(caches[int(pad)].layers[i], name)[0, ..., :start, :]
                                                 for pad in pads]) for name in ("keys", "values")]
        if hasattr(layer, "cumulative_length"):  # a sliding-window layer counts its positions there
            layer.cumulative_length = start
    return body(input_ids=prompt_ids[:, start:], attention_mask=prompt_mask, position_ids=positions[:, start:],
                past_key_values=cache, use_cache=True)

def first_row_per_pad(pads):
    """(pad count, [the first row with it]) for each pad count the rows have."""
    return [(int(pad), (pads == pad).nonzero()[0]) for pad in pads.unique()]

def shared_length(prompt_ids, pads):
    """How many first real tokens every left-padded row shares, less one: each row keeps a token of its own."""
    width = prompt_ids.shape[1]
    least = width - int(pads.max())  # the shortest prompt
    aligned = torch.stack([row[int(p) : int(p) + least] for row, p in zip(prompt_ids, pads)])
    differs = (aligned != aligned[:1]).any(0).nonzero()
    return min(int(differs[0]) if len(differs) else least, least - 1)

def ends_with_stop_string(tokenizer, tokens, finished, stop_strings):
    """True for running sequences whose last tokens spell one of stop_strings (a token holds one character or more).
    The tails cross to the host in one copy and the answers come back in one: on a GPU, writing each row's answer
    into a GPU tensor was a copy and a wait per row, 256 of them at every token (README: where sampling's time goes)."""
    tail = torch.stack(tokens[-max(map(len, stop_strings), default=1):], dim=1)
    running = (~finished).nonzero().flatten()
    texts = tokenizer.batch_decode(tail[running].tolist())
    hit = torch.zeros_like(finished)
    hit[running] = torch.tensor([any(stop in text for stop in stop_strings) for text in texts], dtype=torch.bool).to(hit.device)
    return hit

def pad_right(x, width, value):
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)
