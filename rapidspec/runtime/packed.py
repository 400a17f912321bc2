"""Linear layers whose weights are held in oneDNN's prepacked layout (CPU).

``F.linear`` on CPU hands a plain [out, in] weight to oneDNN (or MKL), which
lays it out in its own blocked format again on every call. For a decode step
that reorder costs about as much as the product: on 2 cores of an AVX-512
EPYC, 30 distinct [3072, 576] bfloat16 weights (a SmolLM2 layer's gate/up)
took 11.4 ms for one token through ``F.linear`` and 4.9 ms through the
prepacked weights; 13.1 vs 5.6 ms for 7 tokens; float32 22.1 vs 9.8 ms.
bfloat16 results were bit-identical, float32 within 1e-4 (another summation
order).

:class:`PackedLinear` keeps *only* the packed weight (the plain one is
freed), so packing costs no memory, and both forwards (the lean one and
transformers') run through it. A tied output layer (sharing the input
embedding's table) gets a packed copy of its own, as the int8/int4 layers do:
the embedding lookup still needs the plain table.

PyTorch exposes the packing as the oneDNN operators that its compiler's CPU
backend emits for linear layers (``torch.ops.mkldnn._reorder_linear_weight``
and ``_linear_pointwise``); :func:`packing_available` checks that they exist
and that they agree with ``F.linear`` before anything is packed.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

#: Weight dtypes the prepacked product takes.
PACKED_DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def packing_available(dtype: torch.dtype) -> bool:
    """Whether this PyTorch build prepacks CPU linear weights of ``dtype`` and gets ``F.linear``'s result."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 64, generator=generator).to(dtype)  # [out, in]
        bias = torch.randn(48, generator=generator).to(dtype)
        rows = torch.randn(3, 64, generator=generator).to(dtype)  # [n, in]
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        got = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
        tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-4
        agrees = torch.allclose(got.float(), F.linear(rows, weight, bias).float(), atol=tolerance, rtol=tolerance)
    except (AttributeError, RuntimeError) as error:
        logger.info("no prepacked linear weights for %s: %s", dtype, error)
        return False
    if not agrees:
        logger.warning("prepacked linear product disagrees with F.linear for %s; weights stay plain", dtype)
    return agrees


class PackedLinear(nn.Module):
    """``x @ W.T + bias`` with ``W`` [out, in] held prepacked for oneDNN (CPU only)."""

    def __init__(self, weight: torch.Tensor, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        # batch-size hint 1: decode steps and verifies are the products that pay for the packing.
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1))
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight, linear.bias)

    @property
    def weight(self) -> torch.Tensor:
        """The weight [out, in] in the plain layout (a new tensor: for quantising a copy, not for decoding)."""
        return self.packed_weight.to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed_weight, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` of a CPU ``model`` by a :class:`PackedLinear`, in place.

    Layers on other devices or of dtypes :func:`packing_available` refuses
    stay as they are. Returns the number of layers packed.
    """
    packed = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if (
                type(child) is nn.Linear
                and child.weight.device.type == "cpu"
                and packing_available(child.weight.dtype)
            ):
                setattr(parent, child_name, PackedLinear.from_linear(child))
                packed += 1
    return packed


def packed_bytes(module: PackedLinear) -> int:
    """Bytes of ``module``'s weight and bias as a product reads them (the plain size of the packed weight)."""
    weight = module.out_features * module.in_features * module.packed_weight.element_size()
    return weight + (0 if module.bias is None else module.bias.nbytes)
