"""The weights packed for oneDNN (tiny_grpo/onednn.py, taken inside sampling_weights on a CPU in bfloat16): the plain
product's numbers, the layers given back after, and a rollout's tokens."""

import pytest
import torch

import tiny_grpo.models
import tiny_grpo.onednn
from conftest import swapped
from tiny_grpo.onednn import PackedLinear, can_pack

needs_packing = pytest.mark.skipif(not can_pack(torch.zeros(1, 1, dtype=torch.bfloat16)),
                                   reason="this CPU's oneDNN has no bfloat16 kernels: nothing is packed")

def within_one_rounding(packed, plain):
    """Both round a float32 sum of the same products to bfloat16 once; where oneDNN sums in another order they may
    part by one bfloat16 step (2^-8 of the value), never more."""
    torch.testing.assert_close(packed.float(), plain.float(), rtol=2**-7, atol=1e-30)

@needs_packing
@pytest.mark.parametrize("shape", [(300, 64), (64, 300), (4096, 48)])
def test_packed_linear_is_the_plain_product(shape):
    torch.manual_seed(0)
    weight, bias = torch.randn(*shape, dtype=torch.bfloat16), torch.randn(shape[0], dtype=torch.bfloat16)
    for b in (None, bias):
        product = PackedLinear(weight, b, rows=16)
        assert product.packed is not None
        for x in [torch.randn(rows, shape[1], dtype=torch.bfloat16) for rows in (1, 3, 16, 40)] + [
                torch.randn(2, 5, shape[1], dtype=torch.bfloat16),  # [B, L, H], as a prefill
                torch.randn(6, 2, shape[1], dtype=torch.bfloat16)[:, 1]]:  # rows that are not contiguous
            packed, plain = product(x), torch.nn.functional.linear(x, weight, b)
            assert packed.shape == plain.shape and packed.dtype == torch.bfloat16
            within_one_rounding(packed, plain)

def test_what_is_not_packed_takes_the_plain_product(monkeypatch):
    torch.manual_seed(0)
    for weight in (torch.randn(8, 4), torch.randn(8, 4, dtype=torch.bfloat16, requires_grad=True)):  # float32; trained
        assert not can_pack(weight) and PackedLinear(weight).packed is None
    monkeypatch.setattr(tiny_grpo.onednn, "PACKING", False)
    weight = torch.randn(8, 4, dtype=torch.bfloat16)
    assert PackedLinear(weight).packed is None
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    assert torch.equal(PackedLinear(weight)(x), torch.nn.functional.linear(x, weight))

@needs_packing
def test_an_input_of_another_dtype_takes_the_plain_product():
    weight = torch.randn(8, 4, dtype=torch.bfloat16)
    product = PackedLinear(weight)
    with pytest.raises(RuntimeError):  # as torch.nn.functional.linear: mixed dtypes are an error, not a silent cast
        product(torch.randn(3, 4))

def load_bfloat16(experiment, model_dir):
    args = experiment.parse_args(["--model-name", str(model_dir), "--device", "cpu", "--quantization", "none",
                                  "--dtype", "bfloat16"])
    torch.manual_seed(0)
    model, tokenizer = experiment.load_model(args)
    return args, model.eval(), tokenizer

@needs_packing
def test_sampling_weights_packs_every_frozen_bfloat16_linear_layer_and_gives_it_back(task_experiment, tiny_model_dir):
    """Inside: the body's 14 linear layers and the output layer multiply by packed weights, LoRA's float32 ones do
    not; the logits within one rounding of the plain ones (the same bits on the EPYC measured); after: every layer
    its own again. The rollout's tokens: the same where the logits are the same bits (a token whose two best
    logits part by one rounding may go either way)."""
    args, model, tokenizer = load_bfloat16(task_experiment, tiny_model_dir)
    batch = tokenizer(["12+34=46", "9*9=81xx", "7-2"], return_tensors="pt", padding=True)
    tasks = [{"prompt": tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                      add_generation_prompt=True), "answer": "5"} for q in ("2+3", "4*4", "9-1")]
    lm_head = model.get_output_embeddings()
    with torch.no_grad():
        before = model(**batch).logits
        torch.manual_seed(1)
        plain = task_experiment.rollout(model, tokenizer, tasks, 4, 24).sequence_ids
        with task_experiment.sampling_weights(model, args):
            assert swapped(model) == 15 and lm_head.sampling_product.packed is not None
            inside = model(**batch).logits
            torch.manual_seed(1)
            packed = task_experiment.rollout(model, tokenizer, tasks, 4, 24).sequence_ids
        assert swapped(model) == 0 and not hasattr(lm_head, "sampling_product")
        assert torch.equal(model(**batch).logits, before)
    within_one_rounding(inside, before)
    if torch.equal(inside, before):
        assert torch.equal(packed, plain)

@needs_packing
def test_packing_waits_for_the_memory(experiment, tiny_model_dir, monkeypatch):
    """The packed copies are made only when a quarter of the free memory holds them."""
    args, model, _ = load_bfloat16(experiment, tiny_model_dir)
    size = sum(m.weight.nbytes for m in model.modules() if type(m) is torch.nn.Linear and can_pack(m.weight))

    def layers_swapped(free):
        monkeypatch.setattr(tiny_grpo.models, "free_memory", lambda device: free)
        with experiment.sampling_weights(model, args):
            return swapped(model)

    assert layers_swapped(4 * size) == 15 and layers_swapped(4 * size - 1) == 0
