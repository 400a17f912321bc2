"""Linear layers at a GGUF file's own precision: the target reads the weights the file stores.

transformers de-quantises a GGUF file into float weights, so a CPU step reads
4 bytes (float32) or 2 (bfloat16) for each weight the file keeps in about half
a byte. :func:`file_layers` builds low-bit layers for the model's linear
layers, output layer included, from the file's own blocks, and
:func:`replace_layers` puts them in place
(:mod:`rapidspec.runtime.quantization`, PyTorch's CPU kernels):

* 4-bit blocks (Q4_0, Q4_1, Q4_K) become :class:`~rapidspec.runtime.quantization.Int4Linear`
  with groups of :data:`FILE_INT4_GROUP` input columns, the file's own codes,
  and a scale and zero point per group that give the file's de-quantised
  values: ``(c - 8) * scale + zero`` is llama.cpp's ``d * c + m`` (Q4_1),
  ``d * (c - 8)`` (Q4_0) and ``d * sc * c - dmin * m`` (Q4_K), computed in
  float32. The kernel takes them in bfloat16
  (:data:`~rapidspec.runtime.quantization.KERNEL_DTYPE`), so each scale and
  zero point is rounded once more (a relative error of at most 2^-9); the
  codes are the file's.
* Every other quantised block (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, ...) becomes
  :class:`~rapidspec.runtime.quantization.Int8Linear`: the file's de-quantised
  values rounded again to int8 with one scale per output channel (PyTorch's
  int8 kernel has no per-block scales), so each weight moves by at most half
  an int8 step of its row. Not exact; the greedy agreement with the float
  copy is measured in docs/speed.md.
* Float tensors (F32, F16, BF16) keep the float layer.

Each layer is checked against the float weights transformers loaded from the
same file (rows compared in the model's dtype) before it replaces them, so a
name or layout this module misreads is refused (:class:`GGUFLayoutError`),
never computed with.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from rapidspec.runtime.errors import QuantizationError
from rapidspec.runtime.quantization import (
    INT4_OUT_FEATURES_MULTIPLE,
    KERNEL_DTYPE,
    Int4Linear,
    Int8Linear,
    quantize_weight,
    rounds_activations,
)

#: Input columns per group of a file's 4-bit layer: the block (Q4_0, Q4_1) or sub-block (Q4_K) size.
FILE_INT4_GROUP = 32
#: GGUF tensor names of a llama/qwen2 decoder layer's projections, by the module path under ``model.layers[i]``.
LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
FOUR_BIT_KINDS = ("Q4_0", "Q4_1", "Q4_K")
FLOAT_KINDS = ("F32", "F16", "BF16")
#: Rows compared with the loaded float weights per layer (spread over the layer) before it is replaced.
CHECKED_ROWS = 64


class GGUFLayoutError(QuantizationError):
    """A file's tensor does not hold the weights of the layer it was read for."""


def _half(raw: np.ndarray) -> np.ndarray:
    """Half-precision numbers stored as 2 bytes each ([..., 2k] uint8 -> [..., k] float32)."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """llama.cpp's 4-bit layout: bytes [..., 16] -> codes [..., 32] (low nibbles first, then the high ones)."""
    return np.concatenate([raw & 0x0F, raw >> 4], axis=-1)


def four_bit_groups(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes, scales and zero points of a 4-bit tensor in groups of :data:`FILE_INT4_GROUP` columns.

    ``blocks``: the tensor's bytes [rows, bytes per row] as the file stores
    them. Returns codes uint8 [rows, in] in [0, 15], scales and zeros float32
    [rows, in / 32] with ``value = (code - 8) * scale + zero`` per group.
    """
    rows = blocks.shape[0]
    if kind == "Q4_0":  # block: d (f16), 16 bytes of codes; value = d * (c - 8)
        b = blocks.reshape(rows, -1, 18)
        scales = _half(b[..., 0:2])[..., 0]  # [rows, blocks]
        return _nibbles(b[..., 2:]).reshape(rows, -1), scales, np.zeros_like(scales)
    if kind == "Q4_1":  # block: d, m (f16), 16 bytes of codes; value = d * c + m
        b = blocks.reshape(rows, -1, 20)
        scales, mins = _half(b[..., 0:2])[..., 0], _half(b[..., 2:4])[..., 0]  # [rows, blocks]
        return _nibbles(b[..., 4:]).reshape(rows, -1), scales, mins + 8 * scales
    if kind == "Q4_K":  # super-block of 8 x 32: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of codes
        from gguf.quants import Q4_K

        b = blocks.reshape(rows, -1, 144)
        supers = b.shape[1]
        d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])  # [rows, supers, 1]
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))  # [rows * supers, 8] each
        scales = d * sc.reshape(rows, supers, 8).astype(np.float32)  # [rows, supers, 8]
        offsets = dmin * m.reshape(rows, supers, 8).astype(np.float32)  # value = scale * c - offset
        codes = _nibbles(b[..., 16:].reshape(rows, supers, 4, 32))  # [rows, supers, 4, 64]: sub-blocks 2j, 2j + 1
        return codes.reshape(rows, -1), scales.reshape(rows, -1), (8 * scales - offsets).reshape(rows, -1)
    raise QuantizationError(f"{kind} is not a 4-bit block format ({', '.join(FOUR_BIT_KINDS)})")


def _tensor_kind(tensor) -> str:
    return tensor.tensor_type.name


def _checked_rows(rows: int) -> torch.Tensor:
    return torch.linspace(0, rows - 1, min(rows, CHECKED_ROWS)).round().long()


def rotary_rows(rows: int, heads: int) -> torch.Tensor:
    """Which row of a llama GGUF's query or key tensor holds each of transformers' rows ([rows] long).

    llama.cpp's converter reorders each head's rows from the rotate-half layout
    to interleaved pairs (``reshape(heads, 2, d / 2, -1).swapaxes(1, 2)``);
    transformers undoes it on loading.
    """
    file_order = torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
    return torch.argsort(file_order)


def file_layer(tensor, linear: nn.Module, dtype: torch.dtype, rows: torch.Tensor | None = None) -> nn.Module | None:
    """The low-bit layer for ``linear`` from the file's ``tensor`` (a gguf ``ReaderTensor``), or None to keep it.

    ``rows``: the file's row of each of the layer's output rows (None: the
    same order). :class:`GGUFLayoutError` when the tensor's values are not
    ``linear``'s weights in ``dtype``.
    """
    from gguf.quants import dequantize

    kind = _tensor_kind(tensor)
    if kind in FLOAT_KINDS:
        return None
    blocks = np.asarray(tensor.data)  # [out, bytes per row], the file's row order
    if rows is not None:
        blocks = blocks[rows.numpy()]
    weight = linear.weight.detach()  # [out, in]
    sample = _checked_rows(weight.shape[0])
    expected = torch.from_numpy(dequantize(blocks[sample.numpy()], tensor.tensor_type)).to(dtype)  # [s, in]
    if expected.shape != weight[sample].shape or not torch.equal(expected, weight[sample].to(dtype)):
        raise GGUFLayoutError(f"{tensor.name} ({kind}) does not hold the weights transformers loaded for this layer")
    out_features = weight.shape[0]
    if kind in FOUR_BIT_KINDS and out_features % INT4_OUT_FEATURES_MULTIPLE == 0:
        codes, scales, zeros = (torch.from_numpy(a) for a in four_bit_groups(kind, blocks))
        return Int4Linear(codes, scales.to(KERNEL_DTYPE), zeros.to(KERNEL_DTYPE), linear.bias, group=FILE_INT4_GROUP)
    weight_int8, scales = quantize_weight(torch.from_numpy(dequantize(blocks, tensor.tensor_type)))
    return Int8Linear(weight_int8, scales, linear.bias)


def file_precision_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot take :func:`file_layers`, or None when it can."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ("llama", "qwen2"):
        return f"the GGUF's own precision is implemented for llama and qwen2 models, not {model_type!r}"
    if any(p.device.type != "cpu" for p in model.parameters()):
        return "the GGUF's own precision runs on the CPU"
    return None


def _module(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, name = path.rpartition(".")
    return (root.get_submodule(parent_path) if parent_path else root), name


def file_layers(model: nn.Module, gguf_path: str | Path) -> dict[str, nn.Module | None]:
    """The layers at the file's precision for ``model`` (a llama or qwen2 causal LM loaded from ``gguf_path``):
    module path -> low-bit layer, or None where the file holds floats (the layer stays).

    The output layer (``lm_head``) is read from ``output.weight``, or from
    ``token_embd.weight`` when the file ties it to the embedding (the
    embedding lookup keeps its float table). :class:`QuantizationError` for
    another architecture, a model off the CPU, or a file whose tensors cannot
    be read or do not hold the loaded weights.
    """
    from gguf import GGUFReader

    reason = file_precision_reason(model)
    if reason is not None:
        raise QuantizationError(reason)
    try:
        tensors = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}
    except (OSError, ValueError) as err:
        raise QuantizationError(f"cannot read the tensors of {Path(gguf_path).name}: {err}") from None
    places = {"lm_head": tensors.get("output.weight", tensors.get("token_embd.weight"))}
    for index in range(len(model.model.layers)):
        for path, short in LAYER_TENSORS.items():
            places[f"model.layers.{index}.{path}"] = tensors.get(f"blk.{index}.{short}.weight")
    config = model.config
    dtype = model.model.embed_tokens.weight.dtype
    layers = {}
    for path, tensor in places.items():
        parent, name = _module(model, path)
        linear = getattr(parent, name)
        if tensor is None:
            raise GGUFLayoutError(f"{Path(gguf_path).name} has no tensor for {path}")
        rows = None
        if config.model_type == "llama" and name in ("q_proj", "k_proj"):
            heads = config.num_attention_heads if name == "q_proj" else config.num_key_value_heads
            rows = rotary_rows(linear.out_features, heads)
        layers[path] = file_layer(tensor, linear, dtype, rows)
    return layers


def replace_layers(model: nn.Module, layers: dict[str, nn.Module | None]) -> dict[str, int]:
    """Put ``layers`` (:func:`file_layers`) into ``model``; returns how many became ``int4``, ``int8`` or stayed ``float``."""
    counts = {"int4": 0, "int8": 0, "float": 0}
    for path, layer in layers.items():
        if layer is None:
            counts["float"] += 1
            continue
        parent, name = _module(model, path)
        if isinstance(layer, Int8Linear):
            layer.round_activations = rounds_activations(name)
        setattr(parent, name, layer)
        counts["int4" if isinstance(layer, Int4Linear) else "int8"] += 1
    return counts


def layer_tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors that rebuild a low-bit ``layer`` (:func:`layer_from_tensors`), its bias excepted."""
    if isinstance(layer, Int4Linear):
        return {"codes_packed": layer.codes_packed, "scales_and_zeros": layer.scales_and_zeros}
    return {"weight_int8": layer.weight_int8, "scales": layer.scales}


def layer_from_tensors(tensors: dict[str, torch.Tensor], bias: nn.Parameter | None) -> nn.Module:
    """The low-bit layer :func:`layer_tensors` described, with ``bias``."""
    if "codes_packed" in tensors:
        packed, scales_and_zeros = tensors["codes_packed"], tensors["scales_and_zeros"]  # [out, in / 2], [g, out, 2]
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)  # [out, in]
        group = codes.shape[1] // scales_and_zeros.shape[0]
        return Int4Linear(codes, scales_and_zeros[..., 0].T, scales_and_zeros[..., 1].T, bias, group=group)
    return Int8Linear(tensors["weight_int8"], tensors["scales"], bias)
