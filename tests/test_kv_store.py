"""Key/value blocks on disk (rapidspec.runtime.kv_store): exact reads, prefixes shared, and every fault ignored.

Each fault (a truncated file, a flipped byte, another model's or dtype's file, two writers at once, a folder that
cannot be written, a full disk) leaves the store serving: nothing corrupt is loaded, the prompt is prefilled from
where the good blocks end.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

from rapidspec import Rapid
from rapidspec.engine.spec import EngineSpec
from rapidspec.errors import RapidspecError
from rapidspec.retrieval import RetrievalConfig
from rapidspec.runtime import kv_blocks, kv_store
from rapidspec.runtime.cache import KVCache
from rapidspec.runtime.kv_blocks import BLOCK_TOKENS, SUFFIX, block_name, prefix_hashes
from rapidspec.runtime.kv_store import for_model, list_files
from rapidspec.runtime.lean import LeanModel
from rapidspec.runtime.lean_cache import LeanKVCache
from tests.conftest import make_tiny_model
from tests.specs import spec_of

TOKENS = [int(t) for t in torch.randint(0, 200, (1100,), generator=torch.Generator().manual_seed(0))]  # 4 blocks + 76


def names(store, tokens) -> list[str]:
    """The file names of the blocks of ``tokens`` in ``store``."""
    return [block_name(prefix, tokens[j * BLOCK_TOKENS : (j + 1) * BLOCK_TOKENS])
            for j, prefix in enumerate(prefix_hashes(store.key, tokens))]


class Subject(NamedTuple):
    loaded: object
    empty: Callable


@pytest.fixture(params=["transformers", "lean"])
def model(request, tiny_model):
    """The tiny model on either runtime (``model.loaded``) and a factory of its empty caches (``model.empty()``)."""
    if request.param == "lean":
        loaded = dataclasses.replace(tiny_model, lean=LeanModel(tiny_model.model))
        return Subject(loaded, lambda: LeanKVCache(loaded.lean, 64))
    return Subject(tiny_model, lambda: KVCache(tiny_model.model, 64))


def filled(model, tokens):
    cache = model.empty()
    with torch.inference_mode():
        cache.prefill(tokens)
    return cache


def block_files(store) -> list:
    return sorted(store.folder.glob(f"*{SUFFIX}"))


def test_blocks_read_back_give_the_logits_of_a_fresh_prefill(model, tmp_path):
    store = for_model(model.loaded, 1 << 30, tmp_path)
    assert store.write(filled(model, TOKENS)).result() == 5 and len(block_files(store)) == 5  # 4 whole, 1 of 76
    wanted = TOKENS + [7, 8]
    reader = for_model(model.loaded, 1 << 30, tmp_path)  # another process: the same key from the same weights
    assert reader.key == store.key
    cache = model.empty()
    with torch.inference_mode():
        assert reader.extend(cache, wanted) == len(TOKENS) and cache.token_ids == TOKENS
        read = cache.forward(wanted[cache.length :], num_logits=1)
        fresh = filled(model, wanted[:-1]).forward(wanted[-1:], num_logits=1)
    torch.testing.assert_close(read, fresh, atol=1e-5, rtol=1e-5)


def test_a_prompt_that_goes_on_differently_reads_up_to_where_it_differs(model, tmp_path):
    """The blocks before the difference whole, then the first tokens of the block it differs in (a new question
    after the same document); its own blocks are written beside the first prompt's."""
    store = for_model(model.loaded, 1 << 30, tmp_path)
    store.write(filled(model, TOKENS)).result()
    other = TOKENS[:600] + [5] * 700  # differs inside block 2
    cache = model.empty()
    with torch.inference_mode():
        assert store.extend(cache, other) == 600 and cache.token_ids == other[:600]
        read = cache.forward(other[600:], num_logits=1)
        fresh = filled(model, other[:-1]).forward(other[-1:], num_logits=1)
        torch.testing.assert_close(read, fresh, atol=1e-5, rtol=1e-5)
        assert store.write(filled(model, other)).result() == 4  # blocks 2-5 are its own: 0-1 are the first's
        cache = model.empty()
        assert store.extend(cache, other + [1]) == len(other)
        cache = model.empty()
        assert store.extend(cache, TOKENS + [1]) == len(TOKENS)  # the first prompt's blocks are all there still


def test_a_longer_answer_replaces_the_partial_block_it_extends(tiny_model, tmp_path):
    store = for_model(tiny_model, 1 << 30, tmp_path)
    short, longer = KVCache(tiny_model.model, 64), KVCache(tiny_model.model, 64)
    with torch.inference_mode():
        short.prefill(TOKENS[:1050])
        longer.prefill(TOKENS)
    store.write(short).result()
    store.write(longer).result()
    last = sorted(p.name for p in store.folder.glob(f"{prefix_hashes(store.key, TOKENS)[4]}-*"))
    assert last == [names(store, TOKENS)[4]]  # 26 tokens replaced by 76
    assert len(block_files(store)) == 5


def test_a_cache_from_memory_is_continued_from_its_last_block_boundary(model, tmp_path):
    store = for_model(model.loaded, 1 << 30, tmp_path)
    store.write(filled(model, TOKENS)).result()
    cache = filled(model, TOKENS[:300])  # what a prefix cache in memory held: one block and 44 tokens
    with torch.inference_mode():
        assert store.extend(cache, TOKENS[:-1]) == len(TOKENS) - 1 - 300 and cache.length == len(TOKENS) - 1
        read = cache.forward(TOKENS[-1:], num_logits=1)
        fresh = filled(model, TOKENS[:-1]).forward(TOKENS[-1:], 1)
        torch.testing.assert_close(read, fresh, atol=1e-5, rtol=1e-5)
        further = filled(model, TOKENS[:1000])  # the disk adds fewer than MIN_READ_TOKENS: left as it is
        assert store.extend(further, TOKENS[:1000 + kv_store.MIN_READ_TOKENS - 1]) == 0 and further.length == 1000
        assert store.extend(further, TOKENS[:1000 + kv_store.MIN_READ_TOKENS]) == kv_store.MIN_READ_TOKENS


def test_short_prompts_are_neither_written_nor_read(tiny_model, tmp_path):
    store = for_model(tiny_model, 1 << 30, tmp_path)
    short = KVCache(tiny_model.model, 64)
    with torch.inference_mode():
        short.prefill(TOKENS[:kv_store.MIN_TOKENS - 1])
    assert store.write(short) is None and not list_files(tmp_path)


def damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "flipped byte":
        data[-100] ^= 0x01  # inside the values
        path.write_bytes(bytes(data))
    elif how == "empty":
        path.write_bytes(b"")


@pytest.mark.parametrize("how", ["truncated", "flipped byte", "empty"])
def test_a_damaged_block_is_logged_once_removed_and_never_loaded(model, tmp_path, how, caplog):
    store = for_model(model.loaded, 1 << 30, tmp_path)
    store.write(filled(model, TOKENS)).result()
    blocks = names(store, TOKENS)
    damage(store.folder / blocks[2], how)
    damage(store.folder / blocks[3], how)
    cache = model.empty()
    kv_store._warned.clear()
    with caplog.at_level(logging.DEBUG, logger="rapidspec.runtime.kv_store"), torch.inference_mode():
        assert store.extend(cache, TOKENS) == 2 * BLOCK_TOKENS  # the good blocks before it
        assert not (store.folder / blocks[2]).exists()  # removed
        cache.crop(0)
        assert store.extend(cache, TOKENS[:900] + [1] * 200) == 2 * BLOCK_TOKENS
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "is not loaded" in warnings[0].getMessage(), caplog.text
    with torch.inference_mode():
        assert store.write(filled(model, TOKENS)).result() == 1  # block 2 written again; 3 is still there, bad
        cache.crop(0)
        assert store.extend(cache, TOKENS) == 3 * BLOCK_TOKENS  # block 3 read, found bad, removed
        assert store.write(filled(model, TOKENS)).result() == 1
        cache.crop(0)
        assert store.extend(cache, TOKENS) == len(TOKENS)


@pytest.mark.parametrize("other", ["weights", "dtype"])
def test_a_file_of_another_model_or_dtype_is_never_loaded(tiny_model, tmp_path, other):
    theirs = make_tiny_model(seed=5) if other == "weights" else dataclasses.replace(
        tiny_model, model=make_tiny_model().model.to(torch.float64), dtype=torch.float64)
    ours_store, their_store = for_model(tiny_model, 1 << 30, tmp_path), for_model(theirs, 1 << 30, tmp_path)
    assert ours_store.key != their_store.key
    with torch.inference_mode():
        written = KVCache(theirs.model, 64)
        written.prefill(TOKENS)
        their_store.write(written).result()
    # their files, put where ours would be: the names our store looks for
    ours_store.folder.mkdir(parents=True)
    mine = names(ours_store, TOKENS)
    for name, theirs_name in zip(mine, names(their_store, TOKENS)):
        (ours_store.folder / name).write_bytes((their_store.folder / theirs_name).read_bytes())
    cache = KVCache(tiny_model.model, 64)
    assert ours_store.extend(cache, TOKENS) == 0 and cache.length == 0
    assert not (ours_store.folder / mine[0]).exists()  # the first was read, refused and removed
    with torch.inference_mode():
        cache.prefill(TOKENS[:300])  # a cache from memory holding block 0: block 1 is the next one read
        assert ours_store.extend(cache, TOKENS) == 0 and cache.length == 300
    assert not (ours_store.folder / mine[1]).exists()


def test_two_writers_at_once_leave_one_good_file_per_block(tiny_model, tmp_path):
    stores = [for_model(tiny_model, 1 << 30, tmp_path) for _ in range(4)]
    caches = []
    with torch.inference_mode():
        for _ in stores:
            cache = KVCache(tiny_model.model, 64)
            cache.prefill(TOKENS)
            caches.append(cache)
    start = threading.Barrier(len(stores))

    def write(store, cache):
        start.wait(timeout=30)
        store._write(cache)

    threads = [threading.Thread(target=write, args=pair) for pair in zip(stores, caches)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    files = sorted(p.name for p in stores[0].folder.iterdir())
    assert files == sorted(names(stores[0], TOKENS) + ["model.json"])
    assert stores[0].extend(KVCache(tiny_model.model, 64), TOKENS) == len(TOKENS)  # all five read back whole


@pytest.mark.parametrize("fault", ["not a folder", "full disk"])
def test_a_folder_that_cannot_take_blocks_keeps_serving_from_memory(tiny_model, tmp_path, monkeypatch, caplog, fault):
    if fault == "not a folder":
        (tmp_path / "kv").write_text("a file where the folder should be")
        root = tmp_path / "kv"
    else:
        root = tmp_path / "roomy"

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(kv_blocks, "save", full)
    store = for_model(tiny_model, 1 << 30, root)
    engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25"), kv_cache_dir=str(root)), target=tiny_model)
    engine._disk = store
    document = "The lighthouse keeper counted the boats of the bay. " * 40
    with caplog.at_level(logging.WARNING):
        first = engine.generate(document, "How many boats?", mode="lc", max_new_tokens=8)
        store.flush()
        second = engine.generate(document, "How many boats?", mode="lc", max_new_tokens=8)
        store.flush()
    assert first.token_ids == second.token_ids and second.stats.target_prefill_reused_tokens > 0  # from memory
    assert second.stats.target_prefill_disk_tokens == 0
    assert sum("cannot store key/value blocks" in r.getMessage() for r in caplog.records) == 1, caplog.text
    leftovers = [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    assert not leftovers


def test_the_least_recently_used_blocks_go_first_when_over_the_bound(tiny_model, tmp_path):
    big = for_model(tiny_model, 1 << 30, tmp_path)
    with torch.inference_mode():
        one, two = KVCache(tiny_model.model, 64), KVCache(tiny_model.model, 64)
        one.prefill(TOKENS)
        two.prefill([3] * 1100)
    big.write(one).result()
    size = sum(s for _, s, _ in list_files(tmp_path))
    old = time.time() - 100
    for path, _, _ in list_files(tmp_path):
        os.utime(path, (old, old))
    big.extend(KVCache(tiny_model.model, 64), TOKENS[:600] + [0] * 500)  # blocks 0-2 used now (2 in part)
    bound = size + size * 4 // 5  # as much again is over it; the two blocks not used since written make room
    small = for_model(tiny_model, bound, tmp_path)
    small.write(two).result()
    left = {p.name for p, _, _ in list_files(tmp_path)}
    blocks = names(big, TOKENS)
    assert {blocks[0], blocks[1], blocks[2]} <= left and set(names(small, [3] * 1100)) <= left
    assert not {blocks[3], blocks[4]} <= left  # at least one of the two unused since written is gone
    assert sum(s for _, s, _ in list_files(tmp_path)) <= bound


def test_a_second_engine_answers_from_the_blocks_the_first_wrote(tiny_model, tmp_path):
    document = " ".join(f"Line {i}: the keeper logged {i * 3} gulls." for i in range(60))
    question = "How many gulls on line 17?"
    first = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25"), kv_cache_dir=str(tmp_path)), target=tiny_model)
    one = first.generate(document, question, mode="rapid", max_new_tokens=24, temperature=0.0)
    first.disk_store.flush()
    assert one.stats.target_prefill_disk_tokens == 0 and list_files(tmp_path)
    second = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25"), kv_cache_dir=str(tmp_path)), target=tiny_model)
    two = second.generate(document, question, mode="rapid", max_new_tokens=24, temperature=0.0)
    prompt = two.stats.prompt_tokens_target
    assert two.stats.target_prefill_disk_tokens == prompt - 1  # the whole prompt but its last token (the first step)
    assert two.stats.target_prefill_reused_tokens == two.stats.target_prefill_disk_tokens
    assert two.token_ids == one.token_ids and two.text == one.text
    off = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25"), kv_cache_gib=0, kv_cache_dir=str(tmp_path)),
                target=tiny_model)
    assert off.disk_store is None
    assert off.generate(document, question, mode="lc", max_new_tokens=4).stats.target_prefill_disk_tokens == 0


def test_bad_settings_are_refused_in_one_line(tiny_model):
    with pytest.raises(RapidspecError, match="kv_cache_gib must be a number >= 0"):
        Rapid(spec_of(kv_cache_gib=-1), target=tiny_model)
    with pytest.raises(RapidspecError, match="kv_cache_gib must be a number >= 0"):
        EngineSpec(kv_cache_gib=float("nan"))
    with pytest.raises(RapidspecError, match="kv_cache_dir must be a folder's path"):
        EngineSpec(kv_cache_dir=" ")


def test_a_slow_disk_skips_writes_instead_of_holding_caches(tiny_model, tmp_path, monkeypatch):
    store = for_model(tiny_model, 1 << 30, tmp_path)
    gate = threading.Event()
    write = store._write

    def slow(cache):
        gate.wait(timeout=30)
        return write(cache)

    monkeypatch.setattr(store, "_write", slow)
    with torch.inference_mode():
        caches = [KVCache(tiny_model.model, 64) for _ in range(4)]
        for n, cache in enumerate(caches):
            cache.prefill(TOKENS[: 1024 + 10 * n])
    futures = [store.write(cache) for cache in caches]
    assert [f is not None for f in futures] == [True] * kv_store.MAX_PENDING_WRITES + [False] * 2
    gate.set()
    assert all(f.result(timeout=30) >= 0 for f in futures if f is not None)
    assert store.write(caches[3]).result(timeout=30) >= 1  # the line is free again


def test_the_writer_thread_runs_torch_on_itself_alone(tiny_model, tmp_path):
    """A writer copying blocks with torch's threads would give the process a second OpenMP team: every later decode
    step took 2x as long on 2 cores (rapidspec.runtime.threads)."""
    store = for_model(tiny_model, 1 << 30, tmp_path)
    assert store._writer.submit(torch.get_num_threads).result(timeout=30) == 1
