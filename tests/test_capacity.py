"""How many requests one server engine runs at once: max_num_seqs bounded by the memory its windows need."""

from __future__ import annotations

import torch

from rapidspec.runtime import new_kv_cache
from rapidspec.server.capacity import concurrent_sequences, kv_bytes_per_token


def test_bytes_per_token_match_a_real_cache(tiny_model):
    with torch.inference_mode():
        cache = new_kv_cache(tiny_model)
        cache.reserve(4096)
        cache.prefill(list(range(1, 41)))
    assert cache.memory_bytes() == 4096 * kv_bytes_per_token(tiny_model)


def test_slots_are_what_fits_and_at_least_one():
    window, per_token = 1000, 10  # 10 kB a window
    assert concurrent_sequences(4, window, per_token, free=100_000, prefix_cache_bytes=0) == 4
    assert concurrent_sequences(4, window, per_token, free=35_000, prefix_cache_bytes=0) == 3
    assert concurrent_sequences(4, window, per_token, free=35_000, prefix_cache_bytes=20_000) == 1
    assert concurrent_sequences(4, window, per_token, free=5_000, prefix_cache_bytes=0) == 1  # today's one at a time
