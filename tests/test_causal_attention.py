"""Lower-right causal attention (prefill chunks, verification) equals the dense-mask result and builds no mask."""

from __future__ import annotations

import pytest
import torch

from rapidspec.runtime import attention
from rapidspec.runtime.attention import causal_attention


def reference(query, key, value):
    """Lower-right causal attention written out with a dense mask, in float64 ([b, h, q, d])."""
    q_len, kv_len, groups = query.shape[2], key.shape[2], query.shape[1] // key.shape[1]
    key, value = key.double().repeat_interleave(groups, 1), value.double().repeat_interleave(groups, 1)
    scores = query.double() @ key.transpose(-1, -2) * query.shape[-1] ** -0.5  # [b, h, q, n]
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ value


@pytest.fixture
def no_mask_of_context_size(monkeypatch):
    """Fail if any SDPA or grouped-matmul call gets a boolean/additive mask tensor."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    grouped = attention.grouped_matmul_attention
    masks = []

    def sdpa_spy(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    def grouped_spy(query, key, value, attention_mask, *args, **kwargs):
        masks.append(attention_mask)
        return grouped(query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa_spy)
    monkeypatch.setattr(attention, "grouped_matmul_attention", grouped_spy)
    yield masks
    assert all(not isinstance(mask, torch.Tensor) for mask in masks), [getattr(m, "shape", m) for m in masks]


@pytest.mark.parametrize("path", ["sdpa", "matmul", "split", "batched", "keys"])
@pytest.mark.parametrize("q_len, kv_len", [(7, 300), (64, 64), (200, 1000), (1, 500)])
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4)])
def test_lower_right_causal_equals_the_dense_mask(monkeypatch, no_mask_of_context_size, path, q_len, kv_len,
                                                  heads, kv_heads):
    monkeypatch.setattr(attention, "SHORT_QUERY_PATH", path)
    generator = torch.Generator().manual_seed(q_len * kv_len)
    query = torch.randn(1, heads, q_len, 32, generator=generator)
    key = torch.randn(1, kv_heads, kv_len, 32, generator=generator)
    value = torch.randn(1, kv_heads, kv_len, 32, generator=generator)
    expected = reference(query, key, value)
    assert torch.allclose(causal_attention(query, key, value).double(), expected, atol=2e-5)
    bf16 = causal_attention(query.bfloat16(), key.bfloat16(), value.bfloat16())
    assert bf16.dtype == torch.bfloat16 and torch.allclose(bf16.double(), expected, atol=3e-2)


def test_a_chunked_lean_prefill_builds_no_mask_and_gives_the_unchunked_logits(tiny_model, no_mask_of_context_size):
    from rapidspec.runtime.lean import LeanModel
    from rapidspec.runtime.lean_cache import LeanKVCache

    lean = LeanModel(tiny_model.model)
    token_ids = [(7 * i) % 200 + 3 for i in range(300)]
    whole = LeanKVCache(lean, prefill_chunk_tokens=1000).prefill(token_ids)
    chunked_cache = LeanKVCache(lean, prefill_chunk_tokens=64)
    chunked = chunked_cache.prefill(token_ids)
    assert torch.allclose(chunked, whole, atol=1e-4)
    verified = chunked_cache.forward([5, 6, 7, 8], num_logits=4)  # a verification step over the cache
    again = LeanKVCache(lean, prefill_chunk_tokens=1000)
    again.prefill(token_ids)
    assert torch.allclose(verified, torch.cat([again.forward([t]) for t in (5, 6, 7, 8)]), atol=1e-4)



@pytest.mark.parametrize("path", ["sdpa", "matmul", "split", "keys"])
def test_a_long_cpu_query_is_attended_in_blocks_each_over_the_keys_up_to_its_last_row(monkeypatch, path):
    """A query longer than MATMUL_MAX_QUERY runs as blocks of at most that many rows, each a short query aligned to
    the end of its own keys (the SDPA path included: its blocks take the CPU flash kernel), even when the keys come
    with room after them; equal to the dense reference."""
    monkeypatch.setattr(attention, "SHORT_QUERY_PATH", path)
    shapes = []
    grouped, flash = attention.grouped_matmul_attention, attention._CPU_FLASH

    def grouped_spy(query, key, value, *args, **kwargs):
        shapes.append((query.shape[2], key.shape[2]))
        assert key.shape[2] == value.shape[2]  # a block gets no room after its keys, however long the buffer
        return grouped(query, key, value, *args, **kwargs)

    def flash_spy(query, key, *args, **kwargs):
        shapes.append((query.shape[2], key.shape[2]))
        return flash(query, key, *args, **kwargs)

    monkeypatch.setattr(attention, "grouped_matmul_attention", grouped_spy)
    monkeypatch.setattr(attention, "_CPU_FLASH", flash_spy)
    block = attention.MATMUL_MAX_QUERY
    q_len, kv_len = 2 * block + 5, 3 * attention.KEY_ALIGNMENT + 44
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(2, 6, q_len, 16, generator=generator)
    key, value = (torch.randn(2, 2, kv_len, 16, generator=generator) for _ in range(2))
    room = torch.full((2, 2, attention.KEY_ALIGNMENT, 16), float("nan"))
    out = causal_attention(query, torch.cat([key, room], dim=2), value)  # keys with room after them (lean caches)
    assert torch.allclose(out.double(), reference(query, key, value), atol=2e-5)
    ends = [kv_len - q_len + end for end in (block, 2 * block, q_len)]
    if path == "sdpa":  # each block: the keys before it, then its own keys with a causal mask
        assert shapes == [shape for n, end in zip((block, block, 5), ends) for shape in ((n, end - n), (n, n))]
    else:
        assert shapes == list(zip((block, block, 5), ends))

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_takes_the_flash_or_memory_efficient_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    query = torch.randn(1, 14, 512, 64, device="cuda", dtype=torch.bfloat16)
    key = torch.randn(1, 2, 4096, 64, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):  # the math kernel would fail
        out = causal_attention(query, key, value)
    assert torch.allclose(out.double().cpu(), reference(query.cpu(), key.cpu(), value.cpu()), atol=3e-2)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_len", [1, 7, 64])
def test_short_cuda_queries_never_take_cudnn_and_keep_the_numbers(monkeypatch, device, q_len):
    """cuDNN's SDPA builds a plan per new key count (every decode step): short CUDA queries run without it; CPU
    queries and long ones keep PyTorch's choice. The numbers equal the dense reference either way."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cudnn_allowed = []

    def spy(*args, **kwargs):
        cudnn_allowed.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention, "SHORT_QUERY_PATH", "sdpa")
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    generator = torch.Generator().manual_seed(q_len)
    query = torch.randn(1, 4, q_len, 16, generator=generator).to(device)
    key, value = (torch.randn(1, 2, 96, 16, generator=generator).to(device) for _ in range(2))
    out = causal_attention(query, key, value)
    assert torch.allclose(out.double().cpu(), reference(query.cpu(), key.cpu(), value.cpu()), atol=1e-4)
    restricted = device == "cuda" and q_len <= attention.MATMUL_MAX_QUERY
    assert cudnn_allowed or (device == "cpu" and q_len > 1)  # there, two calls of the CPU flash kernel
    assert all(allowed is not restricted for allowed in cudnn_allowed)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the restriction ends with the call
    assert attention.SDPBackend.CUDNN_ATTENTION not in attention.CUDA_SHORT_QUERY_BACKENDS
