"""The bounded prefix cache: longest-prefix lookup, ownership, LRU eviction by bytes."""

from __future__ import annotations

import pytest
import torch

from rapidspec.errors import RapidspecError
from rapidspec.runtime.prefix_cache import PrefixCache
from rapidspec.runtime.cache import KVCache
from tests.specs import spec_of


def filled(model, tokens) -> KVCache:
    cache = KVCache(model, prefill_chunk_tokens=64)
    with torch.inference_mode():
        cache.prefill(tokens)
    return cache


def test_docstring_example(tiny_model):
    store = PrefixCache(max_bytes=1 << 30, min_reused_tokens=2)
    store.store(filled(tiny_model.model, [1, 2, 3, 4]))
    copy, reused = store.lookup([1, 2, 3, 9, 9])
    assert reused == 3 and copy.token_ids == [1, 2, 3]
    store.store(filled(tiny_model.model, [1, 2, 3, 9, 9, 7]))
    assert store.held_token_ids == [[1, 2, 3, 4], [1, 2, 3, 9, 9, 7]]
    store.store(filled(tiny_model.model, [1, 2, 3, 4, 5]))
    assert store.held_token_ids == [[1, 2, 3, 9, 9, 7], [1, 2, 3, 4, 5]]
    assert store.counters.queries == 1 and store.counters.hits == 1 and store.counters.reused_tokens == 3


def test_lookup_returns_an_independent_copy_with_exact_logits(tiny_model):
    model = tiny_model.model
    tokens = list(range(10, 90))
    store = PrefixCache(max_bytes=1 << 30, min_reused_tokens=8)
    store.store(filled(model, tokens))
    wanted = tokens[:50] + [7, 7, 7]
    copy, reused = store.lookup(wanted)
    assert reused == 50
    with torch.inference_mode():
        cached = copy.forward(wanted[50:], num_logits=1)[0]
        fresh = model(torch.tensor([wanted]), use_cache=False).logits[0, -1].float()
    torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)
    assert store.held_token_ids == [tokens]  # the entry itself is untouched
    again, reused_again = store.lookup(tokens)
    assert reused_again == len(tokens) and again.token_ids == tokens


def test_short_prefixes_are_not_reused(tiny_model):
    store = PrefixCache(max_bytes=1 << 30, min_reused_tokens=16)
    store.store(filled(tiny_model.model, list(range(40))))
    assert store.lookup(list(range(10)) + [99] * 30) == (None, 0)
    assert store.counters.queries == 1 and store.counters.hits == 0


def test_least_recently_used_entries_are_evicted_to_fit_the_bound(tiny_model):
    model = tiny_model.model
    one = filled(model, [1] * 100)
    size = one.memory_bytes()
    store = PrefixCache(max_bytes=2 * size, min_reused_tokens=4)
    store.store(one)
    store.store(filled(model, [2] * 100))
    store.lookup([1] * 100)  # entry 1 is now the most recently used
    store.store(filled(model, [3] * 100))
    assert [seq[0] for seq in store.held_token_ids] == [1, 3]
    assert store.counters.evictions == 1
    assert store.bytes_used <= store.max_bytes


def test_a_cache_larger_than_the_bound_is_not_kept(tiny_model):
    store = PrefixCache(max_bytes=1000, min_reused_tokens=4)
    store.store(filled(tiny_model.model, list(range(200))))
    assert len(store) == 0


def test_negative_size_is_refused():
    with pytest.raises(ValueError, match="prefix cache"):
        PrefixCache(max_bytes=-1)


def test_the_engine_refuses_a_negative_prefix_cache_in_one_line(tiny_model):
    from rapidspec import Rapid

    with pytest.raises(RapidspecError, match="prefix_cache_gib must be a number >= 0"):
        Rapid(spec_of(prefix_cache_gib=-1), target=tiny_model)
    from rapidspec.engine.spec import EngineSpec

    for bad in (-1, float("nan"), True, "2"):  # the spec every command builds: in the engine's part, not the models'
        with pytest.raises(RapidspecError, match="prefix_cache_gib must be a number >= 0"):
            EngineSpec(prefix_cache_gib=bad)
