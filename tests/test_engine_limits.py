"""What the server's limits rest on, in the engine: a window per request, a time limit, a prefill that can be
stopped between chunks, and log-probabilities of the distribution each token follows."""

from __future__ import annotations

import time

import pytest
import torch

from rapidspec import Rapid
from rapidspec.errors import RapidspecError
from rapidspec.outputs import last_output
from rapidspec.retrieval import RetrievalConfig
from rapidspec.runtime import new_kv_cache
from rapidspec.runtime.errors import PrefillStopped
from rapidspec.verification.logprobs import output_logprobs
from rapidspec.verification.sampling import SamplingParams
from tests.specs import spec_of

# the rounds' math from the first round (drafter_start="first"; the default join: test_drafter_join.py)
pytestmark = pytest.mark.usefixtures("drafter_from_the_first_round")

DOCUMENT = "\n\n".join(f"Entry {i}: the harbour logged {i} ships and a crane painted shade {i % 5}." for i in range(60))
QUESTION = "How many ships did the harbour log in entry 23?"
RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=300)


def engine(target, drafter=None, **options) -> Rapid:
    return Rapid(spec_of(retrieval=RETRIEVAL, **options), target=target, drafter=drafter)


def test_max_model_len_is_the_window_a_generation_may_use(tiny_model):
    out = engine(tiny_model).generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=4, max_model_len=512)
    assert out.stats.prompt_tokens_target <= 512 - 4 and out.stats.document_tokens_truncated > 0
    with pytest.raises(RapidspecError, match="only 363 fit"):
        engine(tiny_model).generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=4, max_model_len=512,
                                    truncate="error")


def test_prefill_stops_between_chunks_and_the_cache_store_stays_clean(tiny_model):
    cache = new_kv_cache(tiny_model, 64)
    asked = []
    with pytest.raises(PrefillStopped):
        cache.prefill(list(range(10, 300)), should_stop=lambda: asked.append(1) or len(asked) >= 2)
    assert cache.length == 128 and len(asked) == 2  # two chunks done, the third never started

    rapid = engine(tiny_model, prefill_chunk_tokens=256)
    prompts = rapid.document_prompts(DOCUMENT, QUESTION, rapid_config := rapid_config_of("lc"))
    assert len(prompts.target_ids) > 512
    with pytest.raises(PrefillStopped):
        next(rapid.decode(prompts, rapid_config, should_stop=lambda: True))
    # a stopped prefill keeps the chunk it read, exactly: a prefix of the prompt, which the next request reuses
    assert rapid.prefix_cache.held_token_ids == [list(prompts.target_ids[:256])]
    after = rapid.generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=8)
    assert after.stats.target_prefill_reused_tokens == 256
    fresh = engine(tiny_model, kv_cache_gib=0).generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=8)
    assert after.token_ids == fresh.token_ids


def rapid_config_of(mode: str):
    from rapidspec import DecodeConfig

    return DecodeConfig(mode=mode, max_new_tokens=8)


def test_time_limit_ends_the_answer_with_stop_reason_time(tiny_model):
    slow_round = lambda *caches: time.sleep(0.02)  # noqa: E731  20 ms per round: 0.3 s ends a 400-token answer early
    out = last_output(engine(tiny_model).stream(DOCUMENT[:400], QUESTION, mode="lc", max_new_tokens=400,
                                                ignore_eos=True, time_limit_s=0.3, observer=slow_round))
    assert out.stats.stop_reason == "time" and 0 < out.stats.new_tokens < 400
    with pytest.raises(RapidspecError, match="time_limit_s") as err:  # the prefill alone is longer
        engine(tiny_model, prefill_chunk_tokens=64).generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=4,
                                                            time_limit_s=1e-6)
    assert err.value.code == "time_limit_exceeded"


def test_logprobs_of_lc_are_the_target_log_softmax(tiny_model):
    rapid = engine(tiny_model)
    out = rapid.generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=12, ignore_eos=True, logprobs=3)
    prompts = rapid.document_prompts(DOCUMENT, QUESTION, rapid_config_of("lc"))
    ids = torch.tensor([list(prompts.target_ids) + list(out.token_ids)])
    with torch.no_grad():
        logits = tiny_model.model(ids).logits[0, len(prompts.target_ids) - 1 : -1].float()  # [12, V]
    expected = logits.log_softmax(-1)
    assert len(out.logprobs) == 12
    for row, entry in zip(expected, out.logprobs):
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
        assert entry.top[0][0] == entry.token_id  # greedy picks the most likely token


@pytest.mark.parametrize("drafter_kind", ["self", "random"])
def test_greedy_rapid_reports_the_augmented_distribution_it_took_the_argmax_of(tiny_model, other_tiny_model,
                                                                               drafter_kind):
    """With eta > 0 the token is argmax p^ at every position (drafted, recovered or bonus), so it is p^'s top 1."""
    drafter = None if drafter_kind == "self" else other_tiny_model
    out = engine(tiny_model, drafter).generate(DOCUMENT, QUESTION, mode="rapid", eta=5.0, gamma=4, max_new_tokens=24,
                                               ignore_eos=True, logprobs=1)
    assert out.stats.drafted_tokens > 0 and len(out.logprobs) == len(out.token_ids) == 24
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry.token_id == token and entry.top[0] == (token, pytest.approx(entry.logprob))


def test_output_logprobs_worked_example():
    """eta = 0: log p; eta > 0 with q on the drafted row only: log p^ there, log p after (shapes [2, 3])."""
    target_logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    plain = output_logprobs(target_logits, None, SamplingParams())
    assert torch.allclose(plain, target_logits.log_softmax(-1))
    draft_logits = torch.tensor([[0.0, 5.0, 0.0]])
    augmented = output_logprobs(target_logits, draft_logits, SamplingParams(eta=2.0))
    p, q = target_logits[0].softmax(-1), draft_logits[0].softmax(-1)
    gate = q >= 0.1 * q.max()
    expected = (target_logits[0] + 2.0 * torch.where(gate, q - p, torch.zeros(3))).log_softmax(-1)
    assert torch.allclose(augmented[0], expected) and torch.allclose(augmented[1], plain[1])
    sampled = output_logprobs(target_logits, None, SamplingParams(temperature=0.5, top_k=2))
    assert sampled[0, 2] == float("-inf") and torch.allclose(sampled[0, :2], (target_logits[0, :2] / 0.5).log_softmax(-1))


@pytest.mark.parametrize("runtime", ["lean", "transformers"])
def test_a_generation_allocates_its_target_cache_once(tiny_model, runtime):
    """Reserved for prompt + max_new_tokens + max_gamma + 1 before the prefill: no growth copy in any round,
    also when the cache starts as a copy of a stored prefix."""
    from dataclasses import replace

    from rapidspec.runtime.lean import LeanModel

    def buffers(cache):
        if runtime == "lean":
            return cache._keys.data_ptr()
        return tuple(layer._key_room.data_ptr() for layer in cache._cache.layers)

    target = replace(tiny_model, lean=LeanModel(tiny_model.model) if runtime == "lean" else None)
    rapid = engine(target, prefill_chunk_tokens=256)
    for question in (QUESTION, QUESTION + " Say it again."):
        seen = []
        out = last_output(rapid.stream(DOCUMENT, question, mode="rapid", gamma=4, max_new_tokens=200, ignore_eos=True,
                                       observer=lambda target_cache, *rest: seen.append(buffers(target_cache))))
        assert out.stats.new_tokens == 200 and len(seen) == out.stats.rounds > 10
        assert len(set(seen)) == 1  # the same buffers from the first round to the last
    assert out.stats.target_prefill_reused_tokens > 0


def test_a_prefix_cache_copy_allocates_what_it_holds_or_the_room_asked_for(tiny_model):
    from rapidspec.runtime.lean import LeanModel
    from rapidspec.runtime.lean_cache import LeanKVCache

    cache = LeanKVCache(LeanModel(tiny_model.model))
    cache.reserve(2000)
    cache.prefill([3 + i % 200 for i in range(300)])
    assert cache.capacity >= 2000
    assert cache.clone().capacity == 300 and cache.clone(capacity=1000).capacity == 1000
    assert torch.equal(cache.clone()._keys[:, :, :300], cache._keys[:, :, :300])
