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


def test_a_lookup_takes_an_entry_when_another_shares_as_much_and_take_says_yes(tiny_model):
    """The entry itself (the least recently used of the longest), cropped and out of the store, while another
    entry stays for a request that comes meanwhile; with one entry left, or ``take`` saying no, a copy."""
    model = tiny_model.model
    older, newer = filled(model, [5] * 40 + [1, 1]), filled(model, [5] * 40 + [2, 2])
    store = PrefixCache(max_bytes=1 << 30, min_reused_tokens=8)
    store.store(older)
    store.store(newer)
    asked = []
    taken, reused = store.lookup([5] * 40 + [3], take=lambda: asked.append(1) or True)
    assert taken is older and reused == 40 and taken.token_ids == [5] * 40 and asked == [1]
    assert store.held_token_ids == [[5] * 40 + [2, 2]] and store.bytes_used == newer.memory_bytes()
    copy, reused = store.lookup([5] * 40 + [3], take=lambda: True)  # the last entry sharing 40 tokens: a copy
    assert copy is not newer and reused == 40 and store.held_token_ids == [[5] * 40 + [2, 2]]
    store.store(taken)
    refused, _ = store.lookup([5] * 40 + [3], take=lambda: False)
    assert refused is not taken and refused is not newer and len(store) == 2
    assert store.counters.hits == 3 and store.counters.reused_tokens == 120
    with torch.inference_mode():  # the taken cache computes as a copy would
        fresh = model(torch.tensor([[5] * 40 + [3]]), use_cache=False).logits[0, -1].float()
        torch.testing.assert_close(taken.forward([3], num_logits=1)[0], fresh, atol=1e-4, rtol=1e-4)


def test_the_engine_takes_entries_only_while_the_disk_writes_nothing(tiny_model, monkeypatch):
    """Follow-up questions about one document take the prefix cache's entries (no copy of the document's keys and
    values) and answer as with copies; while a disk write is pending, entries are copied (the writer reads them)."""
    from rapidspec import Rapid
    from rapidspec.runtime.kv_store import DiskKVStore

    document = " ".join(f"line {i} of the report." for i in range(60))

    def answers(engine):
        return [engine.generate(document, f"question {i}?", mode="lc", max_new_tokens=4).token_ids for i in range(4)]

    taking = Rapid(spec_of(prefix_cache_gib=1, kv_cache_gib=0), target=tiny_model)
    copying = Rapid(spec_of(prefix_cache_gib=1, kv_cache_gib=0), target=tiny_model)
    monkeypatch.setattr(copying, "_may_take", lambda: False)
    assert answers(taking) == answers(copying)
    assert len(copying.prefix_cache) == 4 and len(taking.prefix_cache) == 2  # the third and fourth took one
    writing = Rapid(spec_of(prefix_cache_gib=1), target=tiny_model)
    assert isinstance(writing.disk_store, DiskKVStore) and writing._may_take() == (not writing.disk_store.writing())
    monkeypatch.setattr(DiskKVStore, "writing", lambda self: True)
    assert answers(writing) == answers(copying) and len(writing.prefix_cache) == 4
