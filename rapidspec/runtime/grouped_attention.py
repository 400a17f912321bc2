"""Grouped-query attention as matrix products: the short-query CPU paths of :mod:`rapidspec.runtime.attention`.

Pure functions over tensors. The query heads of each key/value group are
stacked into one matrix, so attention is two matrix products per key/value
head straight on the cached keys and values, with no repetition of heads and
no upcast of the cache. :mod:`~rapidspec.runtime.attention` measures which of
these paths (or PyTorch's SDPA) is fastest for a shape on the machine at hand.
"""

from __future__ import annotations

import math

import torch

#: The paths of :func:`grouped_matmul_attention`.
PATHS = ("matmul", "split", "batched", "keys")


def grouped_matmul_attention(
    query: torch.Tensor,  # [batch, heads, q_len, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, rows >= kv_len, head_dim]; rows past kv_len are ignored
    value: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    attention_mask: torch.Tensor | None,  # bool (True = attend) or additive float, broadcastable to [batch, 1, q_len, kv_len]
    scaling: float,
    path: str = "matmul",
    causal_tail: bool = False,
) -> torch.Tensor:
    """Attention [batch, heads, q_len, head_dim] as two matrix products per key/value group.

    Query heads ``h`` of group ``j`` are ``j * groups .. (j + 1) * groups - 1``
    (the layout of transformers' ``repeat_kv``). ``path``, which
    :func:`~rapidspec.runtime.attention.short_query_path` picks:

    * ``matmul``: one 2-D product per (sequence, key/value head): each head's
      [kv_len, d] block of a cache is contiguous, while batched products over
      views of longer buffers may copy them first;
    * ``split``: the same, with the second product in :func:`key_parts` parts
      of the keys (:func:`split_product`);
    * ``batched``: one product over all heads, fewer calls, which pays on
      short caches;
    * ``keys``: batched products over all heads with the scores computed as
      keys x queries ([kv, n, g*q], then laid out as [kv, g*q, n] by one copy):
      with the long cache on the left, oneDNN reads it faster for a few query
      rows (a plain step over a long cache) than in the other order.

    ``causal_tail``: lower-right causality without a mask (only the last
    ``q_len`` keys are masked, by a [q_len, q_len] triangle).

    ``key`` may hold more rows than ``value`` (a cache's room ahead, see
    :func:`~rapidspec.runtime.attention.aligned_key_rows`): without a mask,
    the ``matmul`` and ``split`` paths score the queries against all of them
    (a count oneDNN's products run faster on) and mask the extra scores
    before the softmax, so whatever those rows hold never reaches the output;
    the other paths ignore them.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    batched = path in ("batched", "keys")
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = value.shape[1], value.shape[2]
    if batched or attention_mask is not None:
        key = key[:, :, :kv_len]
    rows = key.shape[2]  # keys scored: kv_len, and any room after them
    groups = heads // kv_heads
    # A power-of-two scale (head_dim 64: 1/8) is exact in any float format, so it goes on the few query
    # rows instead of the [g*q, n] scores (the same numbers, one pass over the scores less).
    on_query = math.frexp(scaling)[0] == 0.5
    stacked = (query * scaling if on_query else query).reshape(batch, kv_heads, groups * q_len, head_dim)  # [b, kv, g*q, d]
    if path == "keys":  # torch.stack lays the transposed scores out as [b, kv, g*q, n]
        scores = torch.stack([torch.bmm(key[b], stacked[b].transpose(1, 2)).transpose(1, 2)  # [kv, n, g*q] -> T
                              for b in range(batch)])
    elif batched:  # torch.bmm per sequence: 4-D matmul would copy the strided cache views
        scores = torch.stack([torch.bmm(stacked[b], key[b].transpose(1, 2)) for b in range(batch)])  # [b, kv, g*q, n]
    else:
        scores = query.new_empty(batch, kv_heads, groups * q_len, rows)
        for b in range(batch):
            for j in range(kv_heads):
                torch.matmul(stacked[b, j], key[b, j].transpose(0, 1), out=scores[b, j])  # [g*q, rows]
    scores = (scores if on_query else scores.mul_(scaling)).view(batch, kv_heads, groups, q_len, rows)  # [b, kv, g, q, rows]
    mask_scores(scores, kv_len, causal_tail, attention_mask)
    # PyTorch's CPU softmax computes in float32 for bfloat16/float16 inputs and
    # rounds once, like softmax(dtype=float32).to(dtype) but without the two
    # extra passes over [g*q, n] that cost more than the products at 16K keys.
    probs = scores.softmax(dim=-1).flatten(2, 3)[..., :kv_len]  # [b, kv, g*q, n]: the room's zeros left out
    if batched:
        output = torch.stack([torch.bmm(probs[b], value[b]) for b in range(batch)])  # [b, kv, g*q, d]
        return output.view(batch, heads, q_len, head_dim)  # [b, h, q, d]
    output = query.new_empty(batch, kv_heads, groups * q_len, head_dim)
    parts = key_parts() if path == "split" else 1
    for b in range(batch):
        for j in range(kv_heads):
            if parts > 1:
                output[b, j] = split_product(probs[b, j], value[b, j], parts)
            else:
                torch.matmul(probs[b, j], value[b, j], out=output[b, j])  # [g*q, d]
    return output.view(batch, heads, q_len, head_dim)  # [b, h, q, d]


def mask_scores(
    scores: torch.Tensor,  # [b, kv, g, q, rows], rows >= kv_len; masked in place
    kv_len: int,
    causal_tail: bool,
    attention_mask: torch.Tensor | None,  # bool (True = attend) or additive, broadcastable to [b, 1, q, kv_len]
) -> None:
    """Set to minus infinity (or add) what the queries may not see: the room after the keys, the future of a
    lower-right causal query (``causal_tail``: only the last ``q`` keys, by a [q, q] triangle), the mask."""
    q_len = scores.shape[-2]
    if scores.shape[-1] > kv_len:
        scores[..., kv_len:].fill_(float("-inf"))  # the room's scores: exp gives 0, whatever its rows held
    if causal_tail and q_len > 1:
        future = torch.ones(q_len, q_len, dtype=torch.bool, device=scores.device).triu_(1)  # [q, q]
        scores[..., kv_len - q_len : kv_len].masked_fill_(future, float("-inf"))
    if attention_mask is None:
        return
    mask = attention_mask[:, :, None]  # [b|1, 1, 1, q, n]
    if mask.dtype != torch.bool:
        scores.add_(mask.to(scores.dtype))
        return
    tail = max(kv_len - q_len, 0)
    if tail and bool(mask[..., :tail].all()):
        scores[..., tail:].masked_fill_(~mask[..., tail:], float("-inf"))
    else:
        scores.masked_fill_(~mask, float("-inf"))


def key_parts() -> int:
    """Parts of the keys on the ``split`` path: one per thread, at least 2."""
    return max(2, torch.get_num_threads())


def split_product(
    probs: torch.Tensor,  # [rows, n]
    value: torch.Tensor,  # [n, d]
    parts: int,
) -> torch.Tensor:
    """``probs @ value`` [rows, d] as one batched product over ``parts`` runs of the keys, summed.

    The batch of parts gives every thread a share of the long sum over n (the
    2-D product's [rows, d] result is one block to a library, so one thread
    summed all n). The sum runs in another order, so the result may differ in
    the last bits; keys left over when ``parts`` does not divide n are added
    by a product of their own.
    """
    size = probs.shape[-1] // parts
    bulk = size * parts
    out = torch.matmul(probs[:, :bulk].unflatten(-1, (parts, size)).transpose(0, 1),  # [parts, rows, size]
                       value[:bulk].unflatten(0, (parts, size))).sum(0)  # [parts, size, d] -> [rows, d]
    if bulk < probs.shape[-1]:
        out += probs[:, bulk:] @ value[bulk:]  # [rows, d]
    return out
