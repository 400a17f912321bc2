"""A served prefill's piece on the lean runtime yields between its layers, so a request that arrives while a
long document is read waits for one layer of the piece, not the whole piece; what the cache reads is unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rapidspec import DecodeConfig, Rapid
from rapidspec.outputs import last_output
from rapidspec.prompting.prompts import PromptPair
from rapidspec.runtime.batching import ForwardBatcher, batching
from rapidspec.runtime.cache import KVCache
from rapidspec.runtime.lean import LeanModel
from rapidspec.runtime.lean_cache import LeanKVCache
from tests.conftest import make_tiny_model
from tests.test_lean_runtime import tiny_qwen2, token_ids


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, byte_tokenizer):
    return make_tiny_model(0, byte_tokenizer) if request.param == "llama" else tiny_qwen2(byte_tokenizer)


def _drain(steps) -> tuple[list, torch.Tensor]:
    yielded = []
    while True:
        try:
            yielded.append(next(steps))
        except StopIteration as done:
            return yielded, done.value


@torch.inference_mode()
def test_a_limited_chunk_yields_between_its_layers_and_reads_what_a_whole_one_reads(tiny):
    ids, layers = token_ids(150, seed=4), tiny.model.config.num_hidden_layers
    lean = LeanModel(tiny.model)
    whole = LeanKVCache(lean, prefill_chunk_tokens=64)
    want = whole.prefill(ids)
    cache = LeanKVCache(lean, prefill_chunk_tokens=64)
    yielded, logits = _drain(cache.prefill_chunks(ids, chunk_limit=lambda: 64))
    assert yielded == [None] * layers + [64] + [None] * layers + [128] + [None] * layers + [150]
    assert torch.equal(logits, want) and cache.token_ids == ids  # the same operations in the same order
    assert torch.equal(cache._keys[:, :, :150], whole._keys[:, :, :150])
    # no limit (whole chunks), or a cache over transformers' forward: no yields between layers
    assert _drain(LeanKVCache(lean, prefill_chunk_tokens=64).prefill_chunks(ids, chunk_limit=lambda: None))[0] \
        == [64, 128, 150]
    assert _drain(KVCache(tiny.model, prefill_chunk_tokens=64).prefill_chunks(ids, chunk_limit=lambda: 64))[0] \
        == [64, 128, 150]


@torch.inference_mode()
def test_a_chunk_closed_between_its_layers_leaves_the_cache_as_the_last_whole_chunk_left_it(tiny):
    ids, layers = token_ids(150, seed=5), tiny.model.config.num_hidden_layers
    lean = LeanModel(tiny.model)
    cache = LeanKVCache(lean, prefill_chunk_tokens=64)
    steps = cache.prefill_chunks(ids, chunk_limit=lambda: 64)
    for _ in range(layers + 2):  # the first chunk, and the second one's first layer
        next(steps)
    steps.close()  # a request cancelled while its piece ran
    assert cache.length == 64 and cache.token_ids == ids[:64]
    torch.testing.assert_close(cache.prefill(ids[64:]), LeanKVCache(lean).prefill(ids), atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_inside_a_batched_step_a_limited_chunk_runs_whole_as_one_row(tiny):
    ids = token_ids(100, seed=6)
    cache, batcher = LeanKVCache(LeanModel(tiny.model), prefill_chunk_tokens=64), ForwardBatcher(1)
    with batching(batcher):
        yielded, _ = _drain(cache.prefill_chunks(ids, chunk_limit=lambda: 64))
    assert yielded == [64, 100] and batcher.batches == [1, 1]


def test_the_engine_says_nothing_between_layers_and_answers_as_with_whole_chunks(tiny):
    lean = dataclasses.replace(tiny, lean=LeanModel(tiny.model))
    engine = Rapid(target=lean)
    prompt = tuple(token_ids(200, seed=7, vocab=250)) + (10,)
    config = DecodeConfig(mode="lc", temperature=0.0, max_new_tokens=8, ignore_eos=True)
    plain = last_output(engine.decode(PromptPair(prompt, prompt), config))
    with torch.inference_mode():
        chunks = list(Rapid(target=lean).decode(PromptPair(prompt, prompt), config, yield_prefill_chunks=True,
                                         prefill_chunk_limit=lambda: 64))
    news = [c.prefill for c in chunks if c.prefill is not None]
    between = [c for c in chunks if c.prefill is None and not c.text and not c.token_ids and c.output is None]
    assert [done for done, _ in news] == [64, 128, 192, 200]  # the prompt but its last token, in pieces
    assert len(between) >= 4 * tiny.model.config.num_hidden_layers  # a step between every two layers
    assert last_output(iter(chunks)).token_ids == plain.token_ids
