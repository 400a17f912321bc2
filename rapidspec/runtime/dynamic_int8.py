"""int8 weights times int8 activations: PyTorch's dynamically quantised CPU product, one token at a time.

PyTorch's int8 weight-only kernel (``aten::_weight_int8pack_mm``) reads the
weights once but computes row after row: on a 2-core AMD EPYC with AVX-512,
Qwen 0.5B's output layer (151936 x 896) took 9.7 ms for one token and 24.0 ms
for seven, so a verification of 7 tokens cost 2.4 plain steps where a float
product costs 1.2. PyTorch's dynamically quantised linear product
(``quantized::linear_dynamic``, the FBGEMM kernels behind
``torch.ao.nn.quantized.dynamic.Linear``) rounds the activations to 8 bits
too and multiplies in integers, with VNNI where the CPU has it: the same layer
took 5.4 ms for one token and 6.7 ms for seven (benchmarks/low_bit_kernels.py).

Its activations share one scale and zero point per call, chosen from the
whole input, so a token's result would depend on the tokens beside it (a
verification of 7 tokens would not compute what 7 plain steps compute).
:func:`dynamic_int8_product` makes the rounding per token and the same in any
batch: each row is divided by its largest magnitude (to [-1, 1]), one extra
row ``[1, -1, 0, ...]`` pins the call's range to exactly [-1, 1], so every row
is rounded on one fixed grid of 255 steps (as fine as a symmetric int8
rounding per token), and each output row is multiplied back by its row's
magnitude. Integer sums are exact, so a row's output is bit for bit the same
alone or among others (tests/test_dynamic_int8.py).

Without VNNI the kernel sums pairs of products in 16 bits, which can saturate
on 8-bit activations; there the activations are rounded to 7 bits (PyTorch's
``reduce_range``, what its own x86 quantisation does on such CPUs).
"""

from __future__ import annotations

import functools
import warnings

import torch

#: Whether this PyTorch build has the dynamically quantised CPU product (FBGEMM, x86 only).
AVAILABLE = "fbgemm" in torch.backends.quantized.supported_engines


@functools.cache
def reduce_range() -> bool:
    """Whether activations are rounded to 7 bits (CPUs without VNNI, see the module's docstring)."""
    return not torch.cpu._is_vnni_supported()


def kernel_name() -> str:
    """What an int8 layer multiplies with on this machine (part of the name of kept keys and values)."""
    if not AVAILABLE:
        return "int8 weights, bfloat16 activations"
    return f"int8 weights, {7 if reduce_range() else 8}-bit activations per token"


def pack_weight(weight_int8: torch.Tensor, scales: torch.Tensor) -> torch.ScriptObject:
    """The kernel's packed copy of ``weight_int8`` [out, in] with one scale per output channel ([out]).

    ``weight ~= weight_int8 * scales[:, None]`` (symmetric, as
    :func:`rapidspec.runtime.quantization.quantize_weight` rounds).
    """
    zero_points = torch.zeros(weight_int8.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # PyTorch marks its quantised tensor type deprecated; the packed weight is the kernel's only input format
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch._make_per_channel_quantized_tensor(weight_int8.cpu(), scales.double().cpu(), zero_points, 0)
    return torch.ops.quantized.linear_prepack(quantized, None)


def dynamic_int8_product(rows: torch.Tensor, packed: torch.ScriptObject) -> torch.Tensor:
    """``rows @ W.T`` for ``rows`` [n, in] (any float dtype) and a :func:`pack_weight` weight: [n, out] float32.

    Each row's activations are rounded on a grid of their own (see the
    module's docstring); rows are independent, so the result of a row does
    not depend on the others.
    """
    rows = rows.float()  # [n, in]
    magnitudes = rows.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)  # [n, 1]
    pin = rows.new_zeros(1, rows.shape[1])  # [1, in]: fixes the call's range to [-1, 1]
    pin[0, 0], pin[0, 1] = 1.0, -1.0
    pinned = torch.cat([rows / magnitudes, pin])  # [n + 1, in], every entry in [-1, 1]
    out = torch.ops.quantized.linear_dynamic(pinned, packed, reduce_range())  # [n + 1, out]
    return out[:-1] * magnitudes
