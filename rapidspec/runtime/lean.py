"""A lean forward for llama and qwen2 models, on the loaded model's own weights.

transformers' forward pays per-module Python costs on every decode step
(hooks, keyword plumbing, mask construction, cache objects, output classes)
that on small models cost more than the arithmetic. :class:`LeanModel` runs
the same computation as a short sequence of tensor operations over the
modules it takes from the loaded model (no weights copied, nothing of
transformers patched or copied): for each layer

    h  = x + o_proj(attention(rope(q_proj(norm(x))), rope(k_proj(..)), v_proj(..)))
    x' = h + down_proj(silu(gate_proj(norm(h))) * up_proj(norm(h)))

The key/value cache is owned by :class:`rapidspec.runtime.lean_cache.LeanKVCache`;
this module only reads and writes the buffers it is handed. The linear layers
are called as they are, so int8/int4 drafters
(:mod:`rapidspec.runtime.quantization`) run their weight-only kernels here too. Architectures or options it does not
know (sliding windows, dynamic rope, other activations) are refused by
:func:`lean_unsupported_reason`, and the model keeps the transformers path.
Checked against transformers in ``tests/test_lean_runtime.py`` (logits close,
fp32 greedy tokens equal).
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from rapidspec.runtime.attention import aligned_key_rows, causal_attention
from rapidspec.runtime.quantization import Int8Linear
from rapidspec.runtime.packed import pack_fused, pack_linears, release_checkpoint

#: model_type values of transformers configs the lean forward implements.
LEAN_ARCHITECTURES = ("llama", "qwen2")
#: Rope types whose tables do not depend on the sequence length.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def lean_unsupported_reason(model) -> str | None:
    """Why ``model`` cannot take the lean forward, or None when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in LEAN_ARCHITECTURES:
        return f"architecture {model_type!r} (lean forward: {', '.join(LEAN_ARCHITECTURES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types) or getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        return "no rotary embedding module"
    if getattr(rotary, "rope_type", "default") not in _STATIC_ROPE_TYPES:
        return f"rope type {rotary.rope_type!r}"
    return None


def _view_parameter(fused: torch.Tensor, start: int, stop: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(fused[start:stop], requires_grad=False)


def fuse_linears(modules: list[torch.nn.Module]) -> torch.nn.Module | None:
    """One layer computing ``cat([m(x) for m in modules], -1)``, or None when they cannot be fused.

    Plain ``nn.Linear`` layers and int8 layers of equal input width fuse; the
    originals then hold views of the fused weights (same values, no second
    copy in memory, transformers' forward unchanged). One product instead of
    three (q, k, v) or two (gate, up) saves a kernel launch each, which on
    small models costs about as much as the product. On CPU the lean runtime
    then packs the fused product (:func:`rapidspec.runtime.packed.pack_fused`).
    """
    kind = type(modules[0])
    if kind not in (torch.nn.Linear, Int8Linear) or any(type(m) is not kind for m in modules):
        return None
    if len({m.in_features for m in modules}) != 1 or len({m.bias is None for m in modules}) != 1:
        return None
    if kind is Int8Linear and len({m.round_activations for m in modules}) != 1:
        return None
    widths = [m.out_features for m in modules]
    bias = None if modules[0].bias is None else torch.cat([m.bias.detach() for m in modules])
    if kind is torch.nn.Linear:
        weight = torch.cat([m.weight.detach() for m in modules])  # [sum(out), in]
        fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
        fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    else:
        weight = torch.cat([m.weight_int8 for m in modules])  # [sum(out), in] int8
        fused = Int8Linear(weight, torch.cat([m.scales for m in modules]), None, modules[0].round_activations)
    if bias is not None:
        fused.bias = torch.nn.Parameter(bias, requires_grad=False)
    start = 0
    for module, width in zip(modules, widths):
        stop = start + width
        if kind is torch.nn.Linear:
            module.weight = _view_parameter(fused.weight, start, stop)
        else:
            module.weight_int8, module.scales = fused.weight_int8[start:stop], fused.scales[start:stop]
        if bias is not None:
            module.bias = _view_parameter(fused.bias, start, stop)
        start = stop
    return fused


@dataclass(frozen=True, eq=False)
class LeanLayer:
    """The modules and norm weights of one decoder layer (shared with the loaded model).

    ``qkv`` and ``gate_up`` are the fused projections when :func:`fuse_linears`
    could build them, else None (the separate modules run).
    """

    input_norm: torch.Tensor  # [D]
    q_proj: torch.nn.Module
    k_proj: torch.nn.Module
    v_proj: torch.nn.Module
    o_proj: torch.nn.Module
    post_norm: torch.Tensor  # [D]
    gate_proj: torch.nn.Module
    up_proj: torch.nn.Module
    down_proj: torch.nn.Module
    qkv: torch.nn.Module | None = None
    gate_up: torch.nn.Module | None = None

    def project_qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys, values of ``h`` [T, D]: [T, H*d], [T, KV*d], [T, KV*d]."""
        if self.qkv is None:
            return self.q_proj(h), self.k_proj(h), self.v_proj(h)
        widths = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
        return self.qkv(h).split(widths, dim=-1)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate(h)) * up(h))`` for ``h`` [T, D]."""
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` in float32, rounded to ``x``'s dtype as transformers does ([T, D] -> [T, D])."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` [heads, T, d] with tables [T, d] (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [heads, T, d]
    return x * cos + rotated * sin


class LeanModel:
    """The lean forward of one loaded llama/qwen2 causal LM: one or several sequences (rows), each with its own cache.

    Built by :func:`rapidspec.models.load_model` where
    :func:`lean_unsupported_reason` allows; caches come from
    :class:`~rapidspec.runtime.lean_cache.LeanKVCache`.
    """

    def __init__(self, model, pack: bool = False) -> None:
        """``pack``: keep float linear weights prepacked on CPU (:mod:`rapidspec.runtime.packed`; q/k/v and
        gate/up fused first, transformers' forward then shares the fused products)."""
        reason = lean_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"no lean forward for this model: {reason}")
        config = model.config
        base = model.model
        self.model = model
        self.embed = base.embed_tokens
        fused = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj])
            if pack:
                qkv = pack_fused(qkv, attn, ["q_proj", "k_proj", "v_proj"]) or qkv
                gate_up = pack_fused(gate_up, mlp, ["gate_proj", "up_proj"]) or gate_up
            fused.append((qkv, gate_up))
        if pack:
            pack_linears(model)  # o_proj, down_proj, the output layer
            release_checkpoint(model)
        self.layers = [
            LeanLayer(
                input_norm=layer.input_layernorm.weight,
                q_proj=layer.self_attn.q_proj,
                k_proj=layer.self_attn.k_proj,
                v_proj=layer.self_attn.v_proj,
                o_proj=layer.self_attn.o_proj,
                post_norm=layer.post_attention_layernorm.weight,
                gate_proj=layer.mlp.gate_proj,
                up_proj=layer.mlp.up_proj,
                down_proj=layer.mlp.down_proj,
                qkv=qkv,
                gate_up=gate_up,
            )
            for layer, (qkv, gate_up) in zip(base.layers, fused)
        ]
        self.eps = float(config.rms_norm_eps)
        self.final_norm = base.norm.weight
        self.lm_head = model.lm_head
        self.rotary = base.rotary_emb
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.scaling = self.head_dim**-0.5
        self.dtype = self.final_norm.dtype
        self.device = self.embed.weight.device
        empty = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.device)
        self._rope = (empty, empty)  # (cos, sin) [positions, d], replaced whole (readers on other threads)
        self._rope_lock = threading.Lock()

    def fused_linears(self) -> list[torch.nn.Module]:
        """The fused q/k/v and gate/up projections, which are not modules of the transformers model."""
        return [m for layer in self.layers for m in (layer.qkv, layer.gate_up) if m is not None]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def rope_tables(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [length, d] for positions ``start .. start + length - 1`` (grown on demand, by one thread
        at a time; a reader takes the pair as it stands)."""
        end = start + length
        cos, sin = self._rope
        if end > cos.shape[0]:
            with self._rope_lock:
                cos, sin = self._rope
                if end > cos.shape[0]:
                    size = max(end, 2 * cos.shape[0], 256)
                    positions = torch.arange(size, device=self.device)[None]  # [1, size]
                    probe = torch.empty(0, dtype=self.dtype, device=self.device)
                    cos, sin = (t[0] for t in self.rotary(probe, positions))  # [size, d], float32 then rounded
                    self._rope = (cos, sin)
        return cos[start:end], sin[start:end]

    @torch.inference_mode()  # never a training forward: its tables and caches are inference tensors
    def forward_rows(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """One forward for several sequences, each with its own cache, start and number of new tokens.

        The linear layers run once over all rows' new tokens [sum T, D] (the
        weights are read once for every row: batching); attention runs per
        row over that row's own keys and values. Returns each row's logits
        [num_logits, V] (model dtype), in order.
        """
        layers = self._forward(rows)
        while True:
            try:
                next(layers)
            except StopIteration as done:
                return done.value

    @torch.inference_mode()  # entered around each step of the generator, on whichever thread runs it
    def forward_rows_by_layer(self, rows: Sequence[Row]) -> Generator[None, None, list[torch.Tensor]]:
        """:meth:`forward_rows` a layer at a time: yields after each layer, returns the logits.

        The same operations in the same order (the same logits); between two layers the caller may run other
        work, as long as nothing else writes ``rows``' buffers. Closed early, the rows' positions past their
        ``start`` hold some layers' keys and values, which the next forward from ``start`` overwrites.
        """
        return (yield from self._forward(rows))

    def _forward(self, rows: Sequence[Row]) -> Generator[None, None, list[torch.Tensor]]:
        lengths = [row.token_ids.shape[0] for row in rows]
        tables = [self.rope_tables(row.start, n) for row, n in zip(rows, lengths)]  # [T_r, d] each
        x = self.embed(torch.cat([row.token_ids for row in rows]) if len(rows) > 1 else rows[0].token_ids)  # [sum T, D]
        for index, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, self.eps)
            queries, keys, values = (part.split(lengths) for part in layer.project_qkv(h))
            attended = []
            for row, n, (cos, sin), query, key, value in zip(rows, lengths, tables, queries, keys, values):
                end = row.start + n
                query = query.reshape(n, self.heads, self.head_dim).transpose(0, 1)  # [H, T, d]
                key = key.reshape(n, self.kv_heads, self.head_dim).transpose(0, 1)  # [KV, T, d]
                value = value.reshape(n, self.kv_heads, self.head_dim).transpose(0, 1)  # [KV, T, d]
                row.keys[index, :, row.start : end] = apply_rope(key, cos, sin)
                row.values[index, :, row.start : end] = value
                scored = aligned_key_rows(end, row.keys.shape[2])  # the room after `end` is scored and masked
                out = causal_attention(
                    apply_rope(query, cos, sin)[None], row.keys[None, index, :, :scored], row.values[None, index, :, :end],
                    self.scaling,
                )[0]  # [H, T, d]
                attended.append(out.transpose(0, 1).reshape(n, -1))
            x = x + layer.o_proj(torch.cat(attended) if len(rows) > 1 else attended[0])
            h = rms_norm(x, layer.post_norm, self.eps)
            x = x + layer.mlp(h)
            yield
        ends = list(accumulate(lengths))
        last = [x[end - row.num_logits : end] for row, end in zip(rows, ends)]  # [num_logits_r, D] each
        logits = self.lm_head(rms_norm(torch.cat(last) if len(rows) > 1 else last[0], self.final_norm, self.eps))
        return list(logits.split([row.num_logits for row in rows]))  # [num_logits_r, V] each


@dataclass(frozen=True, eq=False)
class Row:
    """One sequence of :meth:`LeanModel.forward_rows`: new tokens, its cache buffers and where they go."""

    token_ids: torch.Tensor  # [T] long
    keys: torch.Tensor  # [layers, kv_heads, capacity, d]; positions < start hold the past
    values: torch.Tensor  # [layers, kv_heads, capacity, d]
    start: int
    num_logits: int
