"""The fast form of torch.nn.functional.linear(x, W, b) for a frozen weight on a CPU: W reordered once into oneDNN's
blocked layout, then every product reads it in that layout. A decode step's products are a few rows tall.
- bfloat16: PyTorch's product is oneDNN already, but it reorders W at every call, most of a few-row product's time.
  Measured on the 2-core AMD EPYC with AVX512-BF16 (docs/results/roofline.md): Gemma-3's 262,144 x 640 output layer
  at 16 rows 33 -> 18 ms, the body's layers 0.74 -> 0.54 ms a layer, the same bits at every row count tried
  (test_onednn.py holds them equal within one bfloat16 rounding on any CPU).
- float32: PyTorch's product is MKL's, which on the AMD EPYC without AVX-512 took 335 ms for the output layer at 16
  rows (127 in output_logits' blocks) against 85 packed here; a rollout 0.77x, an evaluation 0.74x the time
  (docs/results/roofline.md). oneDNN sums in another order: within float32 rounding of MKL's sums, not their bits
  (test_onednn.py states the bound), so a token whose two best logits are that close may be drawn otherwise."""

import torch

PACKING = True  # False: every product plain (benchmarks/sampling.py --lever packed switches it)

def can_pack(weight):
    """Whether weight is one this module packs: frozen, on a CPU whose PyTorch has oneDNN's packed product, and float32
    or bfloat16 (this one where oneDNN has bfloat16 kernels)."""
    mkldnn = torch.ops.mkldnn  # private operators: a build without them packs nothing
    if not (PACKING and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and not weight.requires_grad and torch.backends.mkldnn.is_available()
            and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")):
        return False
    return weight.dtype == torch.float32 or getattr(mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()

class PackedLinear:
    """x -> x W^T + b, as torch.nn.functional.linear(x, weight, bias), W packed once for rows-row products (any
    row count works; rows tunes the layout). A weight can_pack refuses, or an input of another dtype than W's: the
    plain product."""

    def __init__(self, weight, bias=None, rows=16):
        self.weight, self.bias = weight, bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows) if can_pack(weight) else None

    def __call__(self, x):
        if self.packed is None or x.dtype != self.weight.dtype or (self.bias is not None and self.bias.dtype != x.dtype):
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
