"""Int8 weight-only linear layers: a cheaper drafter step on CPU.

A decode step of a small model on CPU reads every weight once per token, so it
is bound by memory traffic: for Qwen2.5-0.5B in bfloat16 on 2 cores, the
matrix products are about 80% of a step and the tied 151,936-token output
layer alone ~14 ms of ~53 ms. Storing the weights as int8 with one float scale
per output channel halves those bytes; PyTorch's int8 weight-only kernel
(``aten::_weight_int8pack_mm``, the one gpt-fast calls on CPU) multiplies
them without materialising a dequantised copy. Measured here: a 0.5B step
52.9 -> 25.4 ms, a SmolLM2-135M step 25.2 -> 17.9 ms.

With η = 0 the output follows the target exactly whatever the drafter, so
int8 drafter weights can only change acceptance. With η > 0 the engine
follows p̂ built from the drafter's distribution q, here the int8 drafter's q.

Layout: :func:`quantize_weight` is the pure per-channel rounding,
:class:`Int8Linear` the module, :func:`quantize_linears` replaces a model's
``nn.Linear`` modules in place, :func:`quantized_copy` quantises a copy that
shares every other tensor with the original (an int8 self-drafter next to a
bfloat16 target costs only the int8 weights).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from rapidspec.errors import RapidspecError

#: Accepted values of ``quantize`` options.
QUANTIZATIONS = ("none", "int8")
#: Rows (tokens) up to which the int8 kernel runs; longer inputs (prefill
#: chunks) are compute-bound and go through a dequantised float product (on 2
#: cores the int8 kernel was faster at 8 rows, the float product at 64).
KERNEL_MAX_ROWS = 16
#: The CPU kernel reads the reduction dimension in vector blocks; other widths
#: (none in the models we know) take the dequantised path.
KERNEL_IN_FEATURES_MULTIPLE = 32


def check_quantization(method: str) -> str:
    """Validate a ``quantize`` option; returns it."""
    if method not in QUANTIZATIONS:
        raise RapidspecError(f"quantize must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
    return method


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 rounding of a weight matrix.

    ``weight``: [out, in] float. Returns ``(weight_int8, scales)``: int8
    [out, in] in [-127, 127] and float32 scales [out] with
    ``weight ~= weight_int8 * scales[:, None]`` (error at most scale / 2 per entry).
    """
    float_weight = weight.detach().float()  # [out, in]
    scales = float_weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0  # [out]
    weight_int8 = torch.round(float_weight / scales[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
    return weight_int8, scales


class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights and one scale per output channel.

    Computes ``x @ (weight_int8 * scales[:, None]).T + bias`` for ``x`` of
    shape [..., in_features]. Short inputs on CPU use PyTorch's int8
    weight-only kernel; anything else (long inputs, other devices) multiplies
    by the dequantised weights, so the module is correct on every device.
    """

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)  # [out, in] int8
        self.register_buffer("scales", scales)  # [out], the activation dtype
        self.bias = bias  # [out] or None, shared with the float layer

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        weight_int8, scales = quantize_weight(linear.weight)
        return cls(weight_int8, scales.to(linear.weight.dtype), linear.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def _use_kernel(self, rows: torch.Tensor) -> bool:
        return (
            rows.device.type == "cpu"
            and rows.shape[0] <= KERNEL_MAX_ROWS
            and rows.dtype == self.scales.dtype
            and self.in_features % KERNEL_IN_FEATURES_MULTIPLE == 0
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [n, in]
        if self._use_kernel(rows):
            out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.weight_int8, self.scales)  # [n, out]
            if self.bias is not None:
                out = out + self.bias
        else:
            weight = self.weight_int8.to(x.dtype) * self.scales.to(x.dtype)[:, None]  # [out, in]
            out = F.linear(rows, weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by an :class:`Int8Linear`, in place.

    Tied weights (an output layer sharing the input embedding) stay shared in
    float for the embedding lookup; the output layer gets its own int8 copy.
    Returns the number of layers replaced.
    """
    replaced = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, child_name, Int8Linear.from_linear(child))
                replaced += 1
    return replaced


def quantized_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with int8 linear layers; every other tensor is shared.

    The original is left untouched (its float linear weights are only read).
    """
    shared = {id(tensor): tensor for tensor in (*model.parameters(), *model.buffers())}
    clone = copy.deepcopy(model, memo=shared)
    quantize_linears(clone)
    return clone

