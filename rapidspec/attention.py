"""Grouped-query attention without repeating key/value heads.

transformers' ``sdpa`` attention repeats key/value heads (``repeat_kv``) for
every layer whenever an attention mask is present, which is the case when the
target verifies several drafted tokens against a cache: at 8K tokens that copy
costs a large share of a verify forward on CPU. This module registers an
attention function under the name :data:`ATTENTION` through transformers'
public ``AttentionInterface`` (and the same masks as ``sdpa`` through
``AttentionMaskInterface``); load a model with ``attn_implementation=ATTENTION``
to use it. Nothing of transformers is patched. Two paths:

* **Short queries on CPU over long caches of wide heads** (decode steps and
  verification, at most :data:`MATMUL_MAX_QUERY` tokens, see
  :func:`matmul_path_pays`): the query heads of each key/value group
  are stacked into one matrix, so attention is two matrix products per
  key/value head straight on the cached keys and values (no head repetition,
  no upcast of the cache), with the softmax computed in float32. On 2 CPU cores, per layer of Qwen2.5-1.5B
  at 16K keys in bfloat16, PyTorch's ``scaled_dot_product_attention`` took about
  19 ms for one query (12.7 ms for 7), this path 0.7 ms (3.2 ms): the SDPA CPU
  kernel is written for long queries. Scores and probabilities are held in the
  model's dtype (rounded where transformers' ``eager`` attention rounds them),
  which for 7 queries at 16K keys took 2-3 ms instead of 6-9 ms with float32
  copies of the scores.
  Only the last ``q_len`` keys can be masked by causality, so when the mask
  allows every earlier key, only that tail is masked.
* **Everything else** (prefill chunks, short caches, narrow heads, GPUs): PyTorch's
  ``scaled_dot_product_attention(..., enable_gqa=True)``, which reads the
  grouped heads directly.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

ATTENTION = "rapidspec_sdpa_gqa"
#: Longest query (tokens) that takes the matrix-product path on CPU.
MATMUL_MAX_QUERY = 32
#: The matrix-product path only pays on long caches of wide heads. Per 28-30
#: layers on 2 cores in bfloat16 (PyTorch 2.13), one query: head_dim 128
#: (Qwen2.5-1.5B) at 8K keys 33 ms vs 49 ms for SDPA, at 16K 64 vs 107 ms, but
#: at 4K 18 vs 15 ms; head_dim 64 (SmolLM2, Qwen2.5-0.5B) SDPA was as fast or
#: faster at every length from 528 keys (12.4 vs 1.9 ms) to 16K (66 vs 57 ms).
MATMUL_MIN_HEAD_DIM = 128
MATMUL_MIN_KEYS = 6144


def matmul_path_pays(query: torch.Tensor, kv_len: int) -> bool:
    """Whether a short query ([..., q_len, head_dim]) on CPU takes :func:`grouped_matmul_attention`."""
    return (
        query.device.type == "cpu"
        and query.shape[-2] <= MATMUL_MAX_QUERY
        and query.shape[-1] >= MATMUL_MIN_HEAD_DIM
        and kv_len >= MATMUL_MIN_KEYS
    )


def grouped_matmul_attention(
    query: torch.Tensor,  # [batch, heads, q_len, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    value: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    attention_mask: torch.Tensor | None,  # bool (True = attend) or additive float, broadcastable to [batch, 1, q_len, kv_len]
    scaling: float,
) -> torch.Tensor:
    """Attention [batch, heads, q_len, head_dim] as two matrix products per key/value group.

    Query heads ``h`` of group ``j`` are ``j * groups .. (j + 1) * groups - 1``
    (the layout of transformers' ``repeat_kv``).
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    stacked = query.reshape(batch, kv_heads, groups * q_len, head_dim)  # [b, kv, g*q, d]
    # One 2-D product per (sequence, key/value head): the cached keys and values
    # are views of longer buffers (rapidspec.cache), which batched products
    # would first copy, while each head's [kv_len, d] block is contiguous.
    scores = query.new_empty(batch, kv_heads, groups * q_len, kv_len)
    for b in range(batch):
        for j in range(kv_heads):
            torch.matmul(stacked[b, j], key[b, j].transpose(0, 1), out=scores[b, j])  # [g*q, n]
    scores = scores.mul_(scaling).view(batch, kv_heads, groups, q_len, kv_len)  # [b, kv, g, q, n]
    if attention_mask is not None:
        mask = attention_mask[:, :, None]  # [b|1, 1, 1, q, n]
        if mask.dtype == torch.bool:
            tail = max(kv_len - q_len, 0)
            if tail and bool(mask[..., :tail].all()):
                scores[..., tail:].masked_fill_(~mask[..., tail:], float("-inf"))
            else:
                scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask.to(scores.dtype))
    # PyTorch's CPU softmax computes in float32 for bfloat16/float16 inputs and
    # rounds once, like softmax(dtype=float32).to(dtype) but without the two
    # extra passes over [g*q, n] that cost more than the products at 16K keys.
    probs = scores.softmax(dim=-1).view(batch, kv_heads, groups * q_len, kv_len)
    output = query.new_empty(batch, kv_heads, groups * q_len, head_dim)
    for b in range(batch):
        for j in range(kv_heads):
            torch.matmul(probs[b, j], value[b, j], out=output[b, j])  # [g*q, d]
    return output.view(batch, heads, q_len, head_dim)  # [b, h, q, d]


def attend(
    query: torch.Tensor,  # [batch, heads, q_len, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    value: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    mask: torch.Tensor | None,  # bool (True = attend) or additive, broadcastable to [batch, 1, q_len, kv_len]
    is_causal: bool = False,  # causal without a mask (only for q_len == kv_len)
    scaling: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention [batch, heads, q_len, head_dim] on the path that pays for its shape (module docstring)."""
    if matmul_path_pays(query, key.shape[2]) and not is_causal and dropout_p == 0.0:
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        return grouped_matmul_attention(query, key, value, mask, scaling)
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scaling, is_causal=is_causal,
        enable_gqa=query.shape[1] != key.shape[1],
    )


def causal_attention(
    query: torch.Tensor,  # [batch, heads, q_len, head_dim], the last q_len positions of the keys
    key: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    value: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    scaling: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention of queries aligned to the *end* of the keys ([batch, heads, q_len, head_dim]).

    Without a cache (q_len == kv_len) SDPA's causal flag does it; with one, the
    causal mask of the last q_len positions is built here.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == 1 or q_len == kv_len:
        return attend(query, key, value, None, q_len > 1, scaling, dropout_p)
    positions = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]  # [q_len, 1]
    mask = (torch.arange(kv_len, device=query.device)[None, :] <= positions)[None, None]  # [1, 1, q, n]
    return attend(query, key, value, mask, False, scaling, dropout_p)


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
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    dropout_p = dropout if module.training else 0.0
    if causal and attention_mask is None:
        output = causal_attention(query, key, value, scaling, dropout_p)
    else:
        output = attend(query, key, value, attention_mask, False, scaling, dropout_p)
    return output.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the attention function (idempotent); returns its name."""
    AttentionInterface.register(ATTENTION, gqa_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION
