"""The weights packed for oneDNN (tiny_grpo/onednn.py, taken inside sampling_weights on a CPU in float32 and bfloat16):
the plain product's numbers, the layers given back after, and a rollout's tokens."""

import pytest
import torch

import tiny_grpo.models
import tiny_grpo.onednn
from conftest import swapped
from tiny_grpo.onednn import PackedLinear, can_pack

def packs(dtype):
    """The dtype as a test parameter, skipped where this CPU's PyTorch packs nothing of that dtype."""
    reason = f"this CPU's oneDNN packs no {dtype} weight (bfloat16: no AVX512-BF16 kernels)"
    return pytest.param(dtype, marks=pytest.mark.skipif(not can_pack(torch.zeros(1, 1, dtype=dtype)), reason=reason))

DTYPES = [packs(torch.float32), packs(torch.bfloat16)]

def within_rounding(packed, plain, x, weight, bias=None):
    """bfloat16: both round a float32 sum of the same products to bfloat16 once; where oneDNN sums in another order
    they may part by one bfloat16 step (2^-8 of the value), never more. float32: each sum of K products and a bias,
    taken in any order, is within K u (|x| |W|^T + |b|) of the exact one (u = 2^-24, the unit roundoff), so the two
    within twice that."""
    if packed.dtype == torch.bfloat16:
        torch.testing.assert_close(packed.float(), plain.float(), rtol=2**-7, atol=1e-30)
        return
    size = x.abs() @ weight.abs().T + (0 if bias is None else bias.abs())
    assert ((packed - plain).abs() <= 2 * (weight.shape[1] + 1) * 2**-24 * size).all()

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(300, 64), (64, 300), (4096, 48), (1000, 640)])
def test_packed_linear_is_the_plain_product(shape, dtype):
    torch.manual_seed(0)
    weight, bias = torch.randn(*shape, dtype=dtype), torch.randn(shape[0], dtype=dtype)
    for b in (None, bias):
        product = PackedLinear(weight, b, rows=16)
        assert product.packed is not None
        for x in [torch.randn(rows, shape[1], dtype=dtype) for rows in (1, 3, 16, 40)] + [
                torch.randn(2, 5, shape[1], dtype=dtype),  # [B, L, H], as a prefill
                torch.randn(6, 2, shape[1], dtype=dtype)[:, 1]]:  # rows that are not contiguous
            packed, plain = product(x), torch.nn.functional.linear(x, weight, b)
            assert packed.shape == plain.shape and packed.dtype == dtype
            within_rounding(packed, plain, x, weight, b)

def test_what_is_not_packed_takes_the_plain_product(monkeypatch):
    torch.manual_seed(0)
    for weight in (torch.randn(8, 4, dtype=torch.float16), torch.randn(8, 4, requires_grad=True),
                   torch.randn(8, 4, dtype=torch.bfloat16, requires_grad=True)):  # float16; trained weights
        assert not can_pack(weight) and PackedLinear(weight).packed is None
    monkeypatch.setattr(tiny_grpo.onednn, "PACKING", False)
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(8, 4, dtype=dtype)
        assert PackedLinear(weight).packed is None
        x = torch.randn(3, 4, dtype=dtype)
        assert torch.equal(PackedLinear(weight)(x), torch.nn.functional.linear(x, weight))

@pytest.mark.parametrize("dtype", DTYPES)
def test_an_input_of_another_dtype_takes_the_plain_product(dtype):
    weight = torch.randn(8, 4, dtype=dtype)
    product = PackedLinear(weight)
    assert product.packed is not None
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    with pytest.raises(RuntimeError):  # as torch.nn.functional.linear: mixed dtypes are an error, not a silent cast
        product(torch.randn(3, 4, dtype=other))

def load(experiment, model_dir, dtype):
    args = experiment.parse_args(["--model-name", str(model_dir), "--device", "cpu", "--quantization", "none",
                                  "--dtype", str(dtype).removeprefix("torch.")])
    torch.manual_seed(0)
    model, tokenizer = experiment.load_model(args)
    return args, model.eval(), tokenizer

@pytest.mark.parametrize("dtype", DTYPES)
def test_sampling_weights_packs_every_frozen_linear_layer_and_gives_it_back(task_experiment, tiny_model_dir, dtype):
    """Inside: the body's 14 linear layers and the output layer multiply by packed weights, LoRA's float32 ones do
    not; the logits within rounding of the plain ones (bfloat16: one rounding; float32: a few; the same bits on the
    EPYCs measured); after: every layer its own again. The rollout's tokens: the same where the logits are
    the same bits (a token whose two best logits part by one rounding may go either way)."""
    args, model, tokenizer = load(task_experiment, tiny_model_dir, dtype)
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
    if dtype == torch.bfloat16:
        torch.testing.assert_close(inside.float(), before.float(), rtol=2**-7, atol=1e-30)
    else:  # through the layers' sums, float32's roundings add up: within 1e-5 of the largest logit (0 measured here)
        assert (inside - before).abs().max() <= 1e-5 * before.abs().max()
    if torch.equal(inside, before):
        assert torch.equal(packed, plain)

@pytest.mark.parametrize("dtype", DTYPES)
def test_packing_waits_for_the_memory(experiment, tiny_model_dir, monkeypatch, dtype):
    """The packed copies are made only when a quarter of the free memory holds them."""
    args, model, _ = load(experiment, tiny_model_dir, dtype)
    size = sum(m.weight.nbytes for m in model.modules() if type(m) is torch.nn.Linear and can_pack(m.weight))

    def layers_swapped(free):
        monkeypatch.setattr(tiny_grpo.models, "free_memory", lambda device: free)
        with experiment.sampling_weights(model, args):
            return swapped(model)

    assert layers_swapped(4 * size) == 15 and layers_swapped(4 * size - 1) == 0
