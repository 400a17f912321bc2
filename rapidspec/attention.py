"""Grouped-query attention without repeating key/value heads.

transformers' ``sdpa`` attention repeats key/value heads (``repeat_kv``) for
every layer whenever an attention mask is present, which is the case when the
target verifies several drafted tokens against a cache: at 8K tokens that copy
costs a large share of a verify forward on CPU. PyTorch's
``scaled_dot_product_attention(..., enable_gqa=True)`` reads the grouped heads
directly. This module registers such an attention function under the name
:data:`ATTENTION` through transformers' public ``AttentionInterface`` (and the
same masks as ``sdpa`` through ``AttentionMaskInterface``); load a model with
``attn_implementation=ATTENTION`` to use it. Nothing of transformers is
patched.

A second CPU detail: PyTorch's bfloat16 kernel for a *single* query against a
long cache is several times slower than the float32 one (measured at 8K keys:
about 4 ms vs 1.4 ms per layer including the upcast), so one-token steps on CPU
attend in float32 and cast the result back.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

ATTENTION = "rapidspec_sdpa_gqa"


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, heads, q_len, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    value: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    attention_mask: torch.Tensor | None,  # [batch, 1, q_len, kv_len] or None
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention output [batch, q_len, heads, head_dim], computed with native GQA."""
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # Without a mask, a multi-token query attends causally aligned to the
    # *end* of the keys only when q_len == kv_len (a prefill without cache).
    use_causal_flag = bool(causal and attention_mask is None and q_len > 1 and q_len == key.shape[2])
    if causal and attention_mask is None and q_len > 1 and not use_causal_flag:
        kv_len = key.shape[2]
        positions = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]  # [q_len, 1]
        attention_mask = torch.arange(kv_len, device=query.device)[None, :] <= positions  # [q_len, kv_len]
    out_dtype = query.dtype
    if q_len == 1 and query.device.type == "cpu" and query.dtype == torch.bfloat16:
        query, key, value = query.float(), key.float(), value.float()
    output = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
        is_causal=use_causal_flag,
        enable_gqa=query.shape[1] != key.shape[1],
    )  # [batch, heads, q_len, head_dim]
    return output.to(out_dtype).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the attention function (idempotent); returns its name."""
    AttentionInterface.register(ATTENTION, gqa_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION
