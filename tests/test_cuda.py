"""The CUDA path, on a machine with a GPU: LoRA gradients through 4-bit NF4 weights, paged 8-bit AdamW, the sampler,
two steps and a resume of every experiment, and experiment_accelerate_ddp under `accelerate launch` over NCCL.

Skipped where CUDA is absent (CI has none); on one NVIDIA H100 on 2026-11-24 and 2026-11-26: 9 passed, on 2026-11-27 (after two
fixes it found): 12 passed, the two-GPU test skipped each time (README, "What was verified, and where"). On a CUDA machine,
`python -m pytest tests/test_cuda.py -q`. The tiny model is the other tests' (conftest), in bfloat16 on the GPU."""

import socket
import sys

import pytest
import torch

from conftest import EXPERIMENTS, ROOT, load_experiment, run_command, run_script, swapped, tensorboard_scalars, write_jsonl
import tiny_grpo.decode
import tiny_grpo.models

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_args(model_dir, *extra):
    return ["--model-name", str(model_dir), "--device", "cuda", "--quantization", "4bit", "--dtype", "bfloat16",
            "--lora-r", "8", *map(str, extra)]


@pytest.fixture
def base_on_cuda(tiny_model_dir):
    base = load_experiment("experiment_base")
    args = base.parse_args(cuda_args(tiny_model_dir))
    model, tokenizer = base.load_model(args)
    return base, args, model, tokenizer


def test_lora_gradients_reach_the_first_layer_through_4bit_weights(base_on_cuda):
    import bitsandbytes as bnb

    base, args, model, tokenizer = base_on_cuda
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    assert next(model.parameters()).device.type == "cuda"
    batch = tokenizer(["What is 2+3? <answer>5</answer>"], return_tensors="pt").to("cuda")
    model.train()
    log_probs, _ = base.sequence_log_probs(model, batch.input_ids, batch.attention_mask, 4)
    log_probs.sum().backward()
    first = [p.grad for n, p in model.named_parameters() if "layers.0." in n and "lora_B" in n]
    assert first and all(g is not None and g.abs().sum() > 0 for g in first)  # B starts at 0: its gradient does not


def test_paged_8bit_adamw_lowers_the_loss(base_on_cuda):
    import bitsandbytes as bnb

    base, args, model, tokenizer = base_on_cuda
    optimizer = base.make_optimizer(model, args)
    assert isinstance(optimizer, bnb.optim.PagedAdamW8bit)
    batch = tokenizer(["What is 2+3? <answer>5</answer>"], return_tensors="pt").to("cuda")
    model.train()
    losses = []
    for _ in range(5):
        loss = -base.sequence_log_probs(model, batch.input_ids, batch.attention_mask, 4)[0].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_the_sampler_draws_each_token_at_its_probability():
    base = load_experiment("experiment_base")
    probs = torch.zeros(20_000, 1000, device="cuda")
    probs[:, :3] = torch.tensor([0.5, 0.3, 0.2], device="cuda")
    torch.manual_seed(0)
    drawn = base.sample_token(probs.log(), 1.0, 1.0)
    assert drawn.device.type == "cuda" and drawn.max().item() <= 2  # a token of probability 0 is never drawn
    shares = torch.bincount(drawn, minlength=3).float() / len(drawn)
    assert torch.allclose(shares.cpu(), torch.tensor([0.5, 0.3, 0.2]), atol=0.02)


def test_sampling_weights_on_cuda(base_on_cuda):
    """--sampling-weights auto on the GPU: the free memory read from CUDA, the 4-bit layers dequantized inside and
    restored after. One layer's product within one bfloat16 rounding of bitsandbytes' own (for a few rows bitsandbytes
    takes its fused kernel, which rounds otherwise; for 64 rows the same bits), the whole model's logits within 5% in
    norm. On the H100 on 2026-11-27 a first version asked every logit within 5% + 0.05 and failed; a probe then
    measured 2.5% in norm, the same argmax everywhere, and the copy nearer float32 arithmetic than the fused kernel
    (README, "What was verified, and where"). This version passed there."""
    import bitsandbytes as bnb

    base, args, model, tokenizer = base_on_cuda
    assert args.sampling_weights == "auto"
    total = torch.cuda.get_device_properties(0).total_memory
    assert 0 < tiny_grpo.models.free_memory(args.device) <= total
    assert tiny_grpo.models.free_memory("cuda") > 0 and tiny_grpo.models.free_memory(torch.device("cuda")) > 0  # accelerate's: no index
    torch.cuda.set_per_process_memory_fraction(0.01)  # a cap, as benchmarks/gpu_run.py --memory-cap-gb sets one
    try:
        assert tiny_grpo.models.free_memory(args.device) <= 0.01 * total
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    batch = tokenizer(["What is 2+3? <answer>5</answer>", "What is 4*4?"], return_tensors="pt", padding=True).to("cuda")
    layer = next(m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))
    x = torch.randn(5, layer.in_features, device="cuda", dtype=torch.bfloat16)
    model.eval()
    with torch.no_grad():
        quantized = model(**batch).logits.float()
        theirs = layer(x).float()
        with base.sampling_weights(model, args):
            assert swapped(model) == 14  # 2 layers x 7 linear layers
            dequantized = model(**batch).logits.float()
            ours = layer(x).float()
    assert swapped(model) == 0
    assert torch.allclose(ours, theirs, rtol=2**-7, atol=2**-7 * theirs.abs().max().item()), (ours - theirs).abs().max()
    relative = ((dequantized - quantized).norm() / quantized.norm()).item()
    assert relative < 0.05, f"logits {relative} apart (relative norm)"


def test_packed_prompts_and_the_formed_gradient_on_cuda(base_on_cuda):
    """sequence_log_probs as it trains on the GPU (4-bit bf16, LoRA, SDPA): rows that share a prompt packed into one
    sequence with a 4-D mask (pack_prompts) and the output layer's gradient formed in the forward pass
    (ActionLogProb, the layer frozen), against the textbook computation row by row (the model's own bf16 logits,
    log-softmax, autograd): log-probs and LoRA gradients within bf16 rounding. Passed on an H100 twice on 2026-11-27,
    before and after a prompt's rows were split evenly among its sequences (here each group fits one), and on an H200 on
    2026-11-30 once this test, too, left each completion's trailing padding out."""
    from test_experiments_grpo_math import grouped_sequences, log_probs_and_body_shapes, naive_log_probs, packed_widths

    base, args, model, tokenizer = base_on_cuda
    model.train()
    ids, mask, num_actions = (x.to("cuda") if torch.is_tensor(x) else x for x in grouped_sequences(tokenizer))
    ours, shapes = log_probs_and_body_shapes(base, model, ids, mask, num_actions)
    prompt_width, widest = packed_widths(ids, mask, num_actions)  # each completion without its trailing padding
    assert shapes == [(3, prompt_width + widest)]  # packed: SDPA on CUDA too
    theirs = naive_log_probs(model, ids, mask, num_actions)
    worst = (ours - theirs).abs().max().item()
    assert worst < 0.1, f"log-probs {worst} apart"
    params = [p for p in model.parameters() if p.requires_grad]
    a = torch.cat([g.flatten() for g in torch.autograd.grad(ours.sum(), params)])
    b = torch.cat([g.flatten() for g in torch.autograd.grad(theirs.sum(), params)])
    relative = ((a - b).norm() / b.norm()).item()
    assert b.norm() > 0 and relative < 0.05, f"LoRA gradients {relative} apart (relative norm)"


def test_the_decode_cache_fills_in_place_on_cuda(base_on_cuda, monkeypatch):
    """reserve_cache on the GPU: the decode steps write into room made once, rows leaving the batch as they end, and
    draw the same tokens as with the library's update (on the CPU tested in float32; here 4-bit bf16)."""
    base, args, model, tokenizer = base_on_cuda
    model.eval()
    monkeypatch.setattr(tiny_grpo.decode, "stop_token_ids", lambda *args: list(range(5, 25)))  # rows end at varied steps
    monkeypatch.setattr(tiny_grpo.decode, "ENDED_SHARE", 0.25)
    prompts = tokenizer(["What is 1 + 2?", "Say something long"], return_tensors="pt", padding=True).to("cuda")
    reserve = tiny_grpo.decode.reserve_cache
    monkeypatch.setattr(tiny_grpo.decode, "decode_batch", tiny_grpo.decode.DecodeBatch)  # not the CUDA graph's static cache

    def sample(in_place):
        monkeypatch.setattr(tiny_grpo.decode, "reserve_cache", lambda cache, tokens: in_place and reserve(cache, tokens))
        torch.manual_seed(3)
        return base.sample(model, tokenizer, prompts.input_ids, prompts.attention_mask, 8, 30, 1.0, 1.0)

    ids, actions = sample(in_place=False)
    in_place_ids, in_place_actions = sample(in_place=True)
    differing = (in_place_ids != ids).any(1).sum().item()
    assert differing == 0 and torch.equal(in_place_actions, actions), f"{differing} of 16 rows differ"
    lengths = actions.sum(1)
    assert lengths.min() < lengths.max()  # rows left the batch at different steps


def test_the_graph_decode_step_on_cuda(base_on_cuda, monkeypatch):
    """GraphDecode on the GPU: the decode step captured as one CUDA graph at the second token, its first replays
    checked against eager steps without trouble, and the tokens DecodeBatch draws (every row to the end) for the same
    seed. 4-bit bf16: were a token to differ, the attention over the whole static cache (masked) rounding otherwise
    than over the filled part would be the first suspect."""
    base, args, model, tokenizer = base_on_cuda
    model.eval()
    monkeypatch.setattr(tiny_grpo.decode, "stop_token_ids", lambda *args: list(range(5, 25)))  # rows end at varied steps
    monkeypatch.setattr(tiny_grpo.decode, "ENDED_SHARE", 2.0)  # DecodeBatch keeps every row, as the graph does
    prompts = tokenizer(["What is 1 + 2?", "Say something long"], return_tensors="pt", padding=True).to("cuda")
    made, decode_batch = [], tiny_grpo.decode.decode_batch

    def sample(chooser):
        monkeypatch.setattr(tiny_grpo.decode, "decode_batch", lambda *args: made.append(chooser(*args)) or made[-1])
        torch.manual_seed(3)
        return base.sample(model, tokenizer, prompts.input_ids, prompts.attention_mask, 8, 30, 1.0, 1.0)

    ids, actions = sample(tiny_grpo.decode.DecodeBatch)
    graph_ids, graph_actions = sample(decode_batch)
    graph = made[-1]
    assert type(graph) is tiny_grpo.decode.GraphDecode and graph.graph is not None and graph.replays == graph.CHECKED_REPLAYS
    assert not tiny_grpo.decode.GRAPH_TROUBLE
    differing = (graph_ids != ids).any(1).sum().item()
    assert differing == 0 and torch.equal(graph_actions, actions), f"{differing} of 16 rows differ"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_two_steps_then_a_resume(name, tiny_model_dir, tmp_path):
    """Each experiment as a user runs it on one GPU: two 4-bit steps, a checkpoint, and a third step from it."""
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(20)]
    data = write_jsonl(tmp_path / "tasks.jsonl", rows)
    common = cuda_args(tiny_model_dir, "--data-path", data, "--eval-data-path", data, "--eval-prompts", 2, "--group-size", 4,
                       "--rollouts-per-step", 2, "--max-length", 12, "--eval-interval", 1, "--run-name", "gpu",
                       "--log-dir", tmp_path / "runs", "--checkpoint-path", tmp_path / "out")
    if name == "experiment_multiturn_qa":
        common += ["--retriever", "bm25", "--max-turns", "2", "--top-k", "2"]  # CUDA's 3: past 2048
    if name == "experiment_multiturn_tool_calling":
        common += ["--max-turns", "2"]
    first = run_script(ROOT / name / "train.py", *common, "--max-steps", 2)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "out" / "gpu" / "step_000002").is_dir()
    again = run_script(ROOT / name / "train.py", *common, "--max-steps", 3, "--resume", tmp_path / "out" / "gpu")
    assert again.returncode == 0, again.stderr[-3000:]
    losses = dict(tensorboard_scalars(tmp_path / "runs" / "gpu")["train/loss"])
    assert sorted(losses) == [1, 2, 3]
    memory = dict(tensorboard_scalars(tmp_path / "runs" / "gpu")["perf/memory_gb"])
    assert 0 < memory[3] < torch.cuda.get_device_properties(0).total_memory / 2**30  # GPU memory, not the host's


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL wants one GPU per process: needs two")
def test_ddp_on_two_gpus_over_nccl(tiny_model_dir, tmp_path):
    """accelerate launch with the folder's multi-GPU config: two processes, one GPU each, NCCL; the weights stay equal."""
    import json

    rows = [{"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(20)]
    data = write_jsonl(tmp_path / "tasks.jsonl", rows)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               ROOT / "experiment_accelerate_ddp" / "multi_gpu.yaml", "--num_processes", 2, "--main_process_port", port,
               ROOT / "experiment_accelerate_ddp" / "train.py",
               *cuda_args(tiny_model_dir, "--data-path", data, "--eval-data-path", data, "--eval-prompts", 2,
                          "--group-size", 4, "--rollouts-per-step", 4, "--max-length", 12, "--max-steps", 2,
                          "--eval-interval", 2, "--debug-ranks", "--run-name", "ddp", "--log-dir", tmp_path / "runs",
                          "--checkpoint-path", tmp_path / "out")]
    result = run_command(command, timeout=900, env={"NCCL_DEBUG": "WARN"})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = {rank: [json.loads(line) for line in (tmp_path / "runs" / "ddp" / f"rank_{rank}.jsonl").read_text().splitlines()]
             for rank in (0, 1)}
    for mine, theirs in zip(lines[0], lines[1]):
        assert mine["weights_after"] == theirs["weights_after"] != mine["weights_before"]
    assert (tmp_path / "out" / "ddp" / "step_000002").is_dir()
