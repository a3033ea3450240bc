"""The fast form of torch.nn.functional.linear(x, W, b) for a frozen bfloat16 weight on a CPU: W reordered once into
oneDNN's blocked layout, then every product reads it in that layout. PyTorch's bfloat16 matmul on a CPU is oneDNN
already, but it reorders W at every call; a decode step's products are a few rows tall, so the reorder is most of
their time. Measured on the 2-core AMD EPYC with AVX512-BF16 (docs/results/roofline.md): Gemma-3's 262,144 x 640
output layer at 16 rows 33 -> 18 ms, the body's layers 0.74 -> 0.54 ms a layer, the same bits at every row count
tried (test_onednn.py holds them equal within one bfloat16 rounding on any CPU, and equal bit for bit where they are
here). float32 is left alone: there oneDNN's sums round otherwise than MKL's (5e-6 at 640 terms), and on the EPYC
without AVX-512, where its packed products beat MKL's 1.2 to 3.9x at most shapes, the default run came out 1.4%
faster for 1.07 GB more memory (docs/results/roofline.md)."""

import torch

PACKING = True  # False: every product plain (benchmarks/sampling.py --lever packed switches it)

def can_pack(weight):
    """Whether weight is one this module packs: bfloat16, frozen, on a CPU whose oneDNN has bfloat16 kernels."""
    mkldnn = torch.ops.mkldnn  # private operators: a build without them packs nothing
    return (PACKING and weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and not weight.requires_grad
            and torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise") and getattr(mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())

class PackedLinear:
    """x -> x W^T + b, as torch.nn.functional.linear(x, weight, bias), W packed once for rows-row products (any
    row count works; rows tunes the layout). A weight can_pack refuses, or an input of another dtype: the plain
    product."""

    def __init__(self, weight, bias=None, rows=16):
        self.weight, self.bias = weight, bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows) if can_pack(weight) else None

    def __call__(self, x):
        if self.packed is None or x.dtype != torch.bfloat16 or (self.bias is not None and self.bias.dtype != x.dtype):
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
