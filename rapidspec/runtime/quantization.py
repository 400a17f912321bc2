"""Weight-only int8 and int4 linear layers: a cheaper drafter step on CPU.

A decode step of a small model on CPU reads every weight once per token, so it
is bound by memory traffic: for Qwen2.5-0.5B in bfloat16 on 2 cores, the
matrix products are about 80% of a step and the tied 151,936-token output
layer alone ~14 ms of ~53 ms. Fewer bytes per weight make the step cheaper:

* ``int8``: one float scale per output channel (symmetric). On x86 CPUs the
  layer multiplies by PyTorch's dynamically quantised product, activations
  rounded to 8 bits per token (:mod:`rapidspec.runtime.dynamic_int8`): a
  verification of 7 tokens costs little more than one, and every row count
  (prefill chunks too) takes it. Elsewhere PyTorch's int8 weight-only kernel
  (``aten::_weight_int8pack_mm``, the one gpt-fast calls on CPU) takes up to
  :data:`KERNEL_MAX_ROWS` rows (measured with it: a 0.5B step 52.9 -> 25.4 ms,
  a SmolLM2-135M step 25.2 -> 17.9 ms).
* ``int4``: a scale and a zero point per group of :data:`INT4_GROUP` input
  columns (asymmetric), multiplied by PyTorch's int4 CPU kernel
  (``aten::_weight_int4pack_mm_for_cpu``). Half the bytes of int8 again: the
  linear layers of 24 Qwen2.5-0.5B blocks with cold caches took 8.9 ms
  instead of 17.1 ms. The kernel wants its own packed layout, so an int4
  layer also keeps a portable copy of its codes (for prefill chunks and other
  devices): in memory it costs as much as int8.

With η = 0 the output follows the target exactly whatever the drafter, so
low-bit drafter weights can only change acceptance. With η > 0 the engine
follows p̂ built from the drafter's distribution q, here the quantised
drafter's q.

Layout: :func:`quantize_weight` and :func:`quantize_weight_int4` are the pure
roundings, :class:`Int8Linear` and :class:`Int4Linear` the modules,
:func:`quantize_linears` replaces a model's ``nn.Linear`` modules in place,
:func:`quantized_copy` quantises a copy that shares every other tensor with
the original (a low-bit self-drafter next to a bfloat16 target costs only the
quantised weights).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from rapidspec.runtime import dynamic_int8
from rapidspec.runtime.errors import QuantizationError
from rapidspec.runtime.packed import PackedLinear, ProductSlice, SharedProduct

#: What this runtime loads linear layers as (the float copy, int8 or int4 rounded from it, the GGUF file's
#: low-bit blocks), the ``quantize`` options of a target, and those :func:`quantize_linears` rounds to: the
#: user-facing lists are :mod:`rapidspec.config`'s, the same (tests/test_layout.py), since the runtime imports
#: nothing above it.
QUANTIZATIONS = ("none", "int8", "int4", "gguf")
TARGET_QUANTIZATIONS = ("auto", *QUANTIZATIONS)
ROUNDED_QUANTIZATIONS = ("int8", "int4")

#: int4: input columns sharing one scale and zero point.
INT4_GROUP = 64
#: The int4 CPU kernel needs the output width to be a multiple of this; a
#: layer that does not fit (in or out width) stays int8.
INT4_OUT_FEATURES_MULTIPLE = 16
#: Rows (tokens) up to which the int4 kernel and the int8 weight-only one run; longer inputs (prefill
#: chunks) are compute-bound and go through a dequantised float product (on 2
#: cores the int8 kernel was faster at 8 rows, the float product at 64).
KERNEL_MAX_ROWS = 16
#: The CPU kernel reads the reduction dimension in vector blocks; other widths
#: (none in the models we know) take the dequantised path.
KERNEL_IN_FEATURES_MULTIPLE = 32
#: What the kernels compute in, and the dtype of every layer's scales and zero points: PyTorch's int8 and
#: int4 CPU kernels are vectorised for bfloat16 inputs, also on CPUs without bfloat16 instructions, and
#: run a scalar loop for float32 ones (measured on a 2-core Cascade Lake without bfloat16 instructions,
#: a 9728 x 896 layer and one token: int8 0.81 ms in bfloat16 against 11.8 ms in float32; int4 0.68
#: against 29.4 ms; a float32 product 2.45 ms; benchmarks/low_bit_kernels.py). A float32 model's inputs
#: are rounded to bfloat16 for the product and its output returned in float32.
KERNEL_DTYPE = torch.bfloat16


#: Layers whose inputs int8 layers never round to 8 bits: the MLP's down projection, whose input (the gated
#: product) has outlier channels. Measured on Qwen2.5-Coder 0.5B over a 600-token document: its largest input
#: was 37 times the median per token, and rounding it per token moved its output rows by 2.9% (median), against
#: 1.1-1.5% for the output layer and the attention's output projection; greedy answers to 12 questions
#: identical to the float copy's: 9 with the down projections on bfloat16 inputs, 7 without (10 with no
#: activation rounding at all). The cost, in two interleaved runs at 8K tokens: plain steps 2-4% slower,
#: verifications of 7 tokens from 4% faster to 7% slower (one process timing both, not a kept benchmark).
FLOAT_INPUT_LAYERS = ("down_proj",)


def rounds_activations(name: str) -> bool:
    """Whether the int8 layer at module path (or name) ``name`` rounds its inputs (:data:`FLOAT_INPUT_LAYERS`)."""
    return name.rpartition(".")[2] not in FLOAT_INPUT_LAYERS


def int8_numerics() -> str:
    """What int8 layers compute with on this machine, in words (part of the name of kept keys and values)."""
    return f"{dynamic_int8.kernel_name()}; bfloat16 inputs for {', '.join(FLOAT_INPUT_LAYERS)}"


def check_quantization(method: str) -> str:
    """Validate a ``quantize`` option (:data:`TARGET_QUANTIZATIONS`); returns it (:class:`QuantizationError` if unknown)."""
    if method not in TARGET_QUANTIZATIONS:
        raise QuantizationError(f"quantize must be one of {', '.join(TARGET_QUANTIZATIONS)}, got {method!r}")
    return method


def quantize_weight(weight: torch.Tensor, scale_dtype: torch.dtype = KERNEL_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 rounding of a weight matrix.

    ``weight``: [out, in] float. Returns ``(weight_int8, scales)``: int8
    [out, in] in [-127, 127] and scales [out] in ``scale_dtype`` with
    ``weight ~= weight_int8 * scales[:, None]``. The scales are rounded to
    ``scale_dtype`` first and the codes computed from the rounded scales, so
    the error is at most scale / 2 per entry (plus, where a scale was
    rounded down, the clamp of a row's largest entry: at most 1 / 256 of a
    bfloat16 scale more).
    """
    float_weight = weight.detach().float()  # [out, in]
    tiny = torch.finfo(scale_dtype).tiny
    scales = (float_weight.abs().amax(dim=1) / 127.0).clamp(min=tiny).to(scale_dtype)  # [out]
    weight_int8 = torch.round(float_weight / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
    return weight_int8, scales


class _LowBitLinear(nn.Module):
    """What the int8 and int4 layers share: ``x @ W.T + bias`` for ``x`` [..., in_features].

    Short inputs on CPU go through the layer's kernel when it takes them;
    anything else (long inputs, other devices) multiplies by the dequantised
    weights, so the layers are correct on every device.
    """

    in_features: int
    out_features: int
    bias: nn.Parameter | None  # [out] or None, shared with the float layer

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in ``dtype``."""
        raise NotImplementedError

    def _kernel_takes(self, rows: torch.Tensor) -> bool:
        """Whether the CPU kernel can multiply ``rows`` [n, in] (on CPU)."""
        raise NotImplementedError

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ W.T`` by the CPU kernel ([n, in] contiguous, any float dtype -> [n, out])."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [n, in]
        if rows.device.type == "cpu" and self._kernel_takes(rows):
            out = self._kernel(rows.contiguous()).to(x.dtype)  # [n, out]
            if self.bias is not None:
                out = out + self.bias
        else:
            out = F.linear(rows, self.dequantized(x.dtype), self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


class Int8Linear(_LowBitLinear):
    """``nn.Linear`` with int8 weights and one scale per output channel: ``W = weight_int8 * scales[:, None]``.

    With ``round_activations`` (and FBGEMM) the kernel is PyTorch's
    dynamically quantised product, activations rounded to 8 bits per token
    (:mod:`rapidspec.runtime.dynamic_int8`); without, PyTorch's int8
    weight-only product on bfloat16 inputs (:func:`rounds_activations` says
    which layers keep their inputs).
    """

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: nn.Parameter | None,
                 round_activations: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)  # [out, in] int8
        self.register_buffer("scales", scales)  # [out], KERNEL_DTYPE
        self.bias = bias
        self.round_activations = round_activations
        self._packed: torch.ScriptObject | None = None  # the dynamic kernel's copy of the weights, made on first use

    @classmethod
    def from_linear(cls, linear: nn.Linear, round_activations: bool = True) -> "Int8Linear":
        weight_int8, scales = quantize_weight(linear.weight)
        return cls(weight_int8, scales, linear.bias, round_activations)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, round_activations={self.round_activations}"

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight_int8.to(dtype) * self.scales.to(dtype)[:, None]

    def _kernel_takes(self, rows: torch.Tensor) -> bool:
        if self.in_features % KERNEL_IN_FEATURES_MULTIPLE:
            return False
        return self._dynamic() or (rows.shape[0] <= KERNEL_MAX_ROWS and self.scales.dtype == KERNEL_DTYPE)

    def _dynamic(self) -> bool:
        return dynamic_int8.AVAILABLE and self.round_activations

    def pack(self) -> bool:
        """Make the dynamic kernel's packed copy of the weights now (else the first product makes it); whether
        this layer has one."""
        if self._packed is None and self._dynamic() and not self.in_features % KERNEL_IN_FEATURES_MULTIPLE:
            self._packed = dynamic_int8.pack_weight(self.weight_int8, self.scales)
        return self._packed is not None

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        if self._dynamic():
            self.pack()
            return dynamic_int8.dynamic_int8_product(rows, self._packed)
        return torch.ops.aten._weight_int8pack_mm(rows.to(KERNEL_DTYPE), self.weight_int8, self.scales)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        return {**state, "_packed": None}  # the kernel's packed copy is rebuilt from the buffers on first use


def quantize_weight_int4(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise 4-bit rounding of a weight matrix.

    ``weight``: [out, in] float, ``in`` a multiple of :data:`INT4_GROUP`.
    Returns ``(codes, scales, zeros)``: uint8 codes [out, in] in [0, 15], and
    scales and zeros [out, in / INT4_GROUP] in ``dtype`` with
    ``weight ~= (codes - 8) * scale + zero`` per group (the CPU kernel's
    convention). Scales and zeros are rounded to ``dtype`` before the codes
    are computed from them, so the error per entry is at most scale / 2 in
    float32, plus the rounding of scale and zero to a narrower ``dtype``.
    """
    out_features, in_features = weight.shape
    grouped = weight.detach().float().reshape(out_features, -1, INT4_GROUP)  # [out, g, group]
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)  # [out, g]
    scales = ((high - low) / 15).clamp(min=torch.finfo(dtype).tiny).to(dtype)  # [out, g]
    zeros = (low + 8 * scales.float()).to(dtype)  # [out, g]
    codes = torch.round((grouped - zeros.float()[..., None]) / scales.float()[..., None] + 8).clamp(0, 15)
    return codes.to(torch.uint8).reshape(out_features, in_features), scales, zeros


def int4_fits(linear: nn.Linear) -> bool:
    """Whether ``linear`` has the widths int4 layers need (else it gets int8)."""
    return linear.in_features % INT4_GROUP == 0 and linear.out_features % INT4_OUT_FEATURES_MULTIPLE == 0


class Int4Linear(_LowBitLinear):
    """``nn.Linear`` with 4-bit weights, a scale and a zero point per group of input columns.

    ``W = (codes - 8) * scale + zero``. The kernel is PyTorch's int4 CPU
    product on its own packed copy of the codes; the dequantised weights are
    unpacked from the portable copy (two codes per byte, even column in the
    low nibble). Long inputs (prefill chunks) take the dequantised product:
    there the kernel is slower than a float product.
    """

    def __init__(
        self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: nn.Parameter | None,
        group: int = INT4_GROUP,
    ) -> None:
        """``codes`` [out, in] in [0, 15]; ``scales`` and ``zeros`` [out, in / group]; ``group`` 32, 64, 128 or 256."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group = group
        self.register_buffer("codes_packed", codes[:, 0::2] | (codes[:, 1::2] << 4))  # [out, in / 2] uint8
        self.register_buffer("scales_and_zeros", torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous())  # [g, out, 2]
        kernel_weight = None
        if codes.device.type == "cpu":
            kernel_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        self.register_buffer("kernel_weight", kernel_weight)  # opaque CPU layout, or None
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int4Linear":
        codes, scales, zeros = quantize_weight_int4(linear.weight, KERNEL_DTYPE)
        return cls(codes, scales, zeros, linear.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={self.group}"

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        codes = torch.stack([self.codes_packed & 15, self.codes_packed >> 4], dim=-1)  # [out, in / 2, 2]
        codes = codes.reshape(self.out_features, -1, self.group).to(dtype)  # [out, g, group]
        scales_and_zeros = self.scales_and_zeros.to(dtype).transpose(0, 1)  # [out, g, 2]
        weight = (codes - 8) * scales_and_zeros[..., :1] + scales_and_zeros[..., 1:]  # [out, g, group]
        return weight.reshape(self.out_features, self.in_features)

    def _kernel_takes(self, rows: torch.Tensor) -> bool:
        fits = self.kernel_weight is not None and self.scales_and_zeros.dtype == KERNEL_DTYPE
        return fits and rows.shape[0] <= KERNEL_MAX_ROWS

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows.to(KERNEL_DTYPE), self.kernel_weight, self.group,
                                                          self.scales_and_zeros)


def quantize_linears(model: nn.Module, method: str = "int8") -> int:
    """Replace every ``nn.Linear`` (or prepacked layer, :mod:`rapidspec.runtime.packed`) of ``model`` by an
    int8 or int4 layer, in place.

    ``method``: ``"int8"`` or ``"int4"`` (layers whose widths int4 cannot
    take get int8). Tied weights (an output layer sharing the input
    embedding) stay shared in float for the embedding lookup; the output layer
    gets its own quantised copy. Returns the number of layers replaced;
    :class:`QuantizationError` for any other ``method``.
    """
    if method not in ROUNDED_QUANTIZATIONS:
        raise QuantizationError(f"cannot quantize linear layers with {method!r}; use one of {', '.join(ROUNDED_QUANTIZATIONS)}")
    replaced = 0
    for parent in list(model.modules()):
        if isinstance(parent, (ProductSlice, SharedProduct)):
            continue  # a slice is quantised as a whole: its rows of the shared weight
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Linear or isinstance(child, (PackedLinear, ProductSlice)):
                if method == "int4" and int4_fits(child):
                    setattr(parent, child_name, Int4Linear.from_linear(child))
                else:
                    setattr(parent, child_name, Int8Linear.from_linear(child, rounds_activations(child_name)))
                replaced += 1
    return replaced


def pack_kernels(*modules: nn.Module) -> int:
    """Pack the weights of every int8 layer in ``modules`` for the dynamic kernel now, when the model is loaded,
    so that the first request does not (about 2 s for the default model on 2 cores); how many have a packed copy."""
    return sum(m.pack() for module in modules for m in module.modules() if isinstance(m, Int8Linear))


def quantized_copy(model: nn.Module, method: str = "int8") -> nn.Module:
    """A copy of ``model`` with int8 or int4 linear layers; every other tensor is shared.

    The original is left untouched (its float linear weights are only read).
    """
    shared = {id(tensor): tensor for tensor in (*model.parameters(), *model.buffers())}
    clone = copy.deepcopy(model, memo=shared)
    quantize_linears(clone, method)
    return clone

