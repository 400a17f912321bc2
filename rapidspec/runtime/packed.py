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

Fused products (q/k/v, gate/up: one call instead of three or two, where a
oneDNN call costs 30-40 µs however small) are packed whole by
:func:`pack_fused`; the layers they replace become :class:`ProductSlice`
views of one :class:`SharedProduct`, so transformers' forward on the same
model still works and still computes each product once.

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


class SharedProduct(nn.Module):
    """One packed product whose output several :class:`ProductSlice` layers share (q/k/v, gate/up).

    transformers' forward calls ``q_proj(h)``, ``k_proj(h)``, ``v_proj(h)`` on
    the same tensor ``h``: the first call computes the fused product, the
    others called with the same input object take their columns of it, and the
    output is let go once every slice has taken its part. A call with another
    input computes afresh, so results never depend on call order (an input
    changed in place between the calls would be missed; no forward does that).
    """

    def __init__(self, packed: PackedLinear, widths: list[int]) -> None:
        super().__init__()
        self.packed = packed
        self.starts = [sum(widths[:index]) for index in range(len(widths) + 1)]
        self._input = self._output = None
        self._pending = 0

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:  # [..., in] -> [..., widths[index]]
        if x is not self._input or self._pending == 0:
            self._input, self._output, self._pending = x, self.packed(x), len(self.starts) - 1
        output = self._output
        self._pending -= 1
        if self._pending == 0:
            self._input = self._output = None
        return output[..., self.starts[index] : self.starts[index + 1]]


class ProductSlice(nn.Module):
    """Stands in for one of the layers fused into a :class:`SharedProduct` (its output columns)."""

    def __init__(self, shared: SharedProduct, index: int) -> None:
        super().__init__()
        self.shared = shared
        self.index = index
        self.in_features = shared.packed.in_features
        self.out_features = shared.starts[index + 1] - shared.starts[index]

    def _rows(self) -> slice:
        return slice(self.shared.starts[self.index], self.shared.starts[self.index + 1])

    @property
    def weight(self) -> torch.Tensor:
        """This layer's weight [out, in], plain (a new tensor: for quantising a copy, not for decoding)."""
        return self.shared.packed.weight[self._rows()]

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.shared.packed.bias
        return None if bias is None else bias[self._rows()]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part={self.index}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.part(x, self.index)


def pack_fused(fused: nn.Linear, parent: nn.Module, names: list[str]) -> PackedLinear | None:
    """Pack ``fused`` (the product of ``parent``'s layers ``names``, fused) and let those layers share it.

    Each named layer of ``parent`` is replaced by a :class:`ProductSlice` of
    one :class:`SharedProduct`, so the plain fused weight (which the originals
    held views of) is freed: no second copy. Returns the packed product for
    the lean forward, or None (nothing changed) where packing is unavailable.
    """
    if type(fused) is not nn.Linear or fused.weight.device.type != "cpu" or not packing_available(fused.weight.dtype):
        return None
    widths = [getattr(parent, name).out_features for name in names]
    shared = SharedProduct(PackedLinear.from_linear(fused), widths)
    for index, name in enumerate(names):
        setattr(parent, name, ProductSlice(shared, index))
    return shared.packed


def pack_linears(model: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` of a CPU ``model`` by a :class:`PackedLinear`, in place.

    Layers on other devices or of dtypes :func:`packing_available` refuses
    stay as they are (as do layers inside a :class:`SharedProduct`, packed
    already). Returns the number of layers packed.
    """
    packed = 0
    for parent in list(model.modules()):
        if isinstance(parent, (SharedProduct, ProductSlice)):
            continue
        for child_name, child in list(parent.named_children()):
            if (
                type(child) is nn.Linear
                and child.weight.device.type == "cpu"
                and packing_available(child.weight.dtype)
            ):
                setattr(parent, child_name, PackedLinear.from_linear(child))
                packed += 1
    return packed


def release_checkpoint(model: nn.Module) -> None:
    """Give the CPU parameters left after packing (embeddings, norms, biases) memory of their own.

    A safetensors checkpoint is memory-mapped as one file and the loaded
    weights are views of it; packing frees the linear weights, but while the
    embedding still views the file every page read during loading stays
    resident (for Qwen2.5-Coder 0.5B in bfloat16: 1.0 GiB of file pages to keep
    a 0.25 GiB embedding). Copying the few remaining parameters releases the
    mapping. Packed weights are already copies of their own.
    """
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.device.type == "cpu":
                parameter.data = parameter.data.clone()


def packed_bytes(module: PackedLinear) -> int:
    """Bytes of ``module``'s weight and bias as a product reads them (the plain size of the packed weight)."""
    weight = module.out_features * module.in_features * module.packed_weight.element_size()
    return weight + (0 if module.bias is None else module.bias.nbytes)
