"""Mode magicdec: the drafter reads a StreamingLLM view (sinks + recent tokens) of the target's prompt."""

from __future__ import annotations

import pytest
import torch

from rapidspec import DecodeConfig, Rapid
from rapidspec.drafting import streaming_view
from rapidspec.errors import RapidspecError
from rapidspec.retrieval import RetrievalConfig
from tests.specs import spec_of

# the rounds' math from the first round (drafter_start="first"; the default join: test_drafter_join.py)
pytestmark = pytest.mark.usefixtures("drafter_from_the_first_round")

DOCUMENT = "\n\n".join(f"Entry {i}: the ferry left pier {i % 9} at {i} minutes past noon." for i in range(60))
QUESTION = "When did the ferry of entry 41 leave?"


def test_streaming_view_keeps_sinks_and_the_most_recent_tokens():
    ids = list(range(100))
    assert streaming_view(ids, 4, 20) == (0, 1, 2, 3, *range(84, 100))
    assert streaming_view(ids, 0, 10) == tuple(range(90, 100))
    assert streaming_view(ids, 4, 100) == tuple(ids)  # it fits: the whole prompt
    assert streaming_view(ids[:5], 4, 20) == tuple(range(5))
    assert streaming_view(ids, 20, 20) == tuple(range(20))
    with pytest.raises(ValueError):
        streaming_view(ids, 21, 20)


def test_the_drafter_prompt_is_the_view_of_the_target_prompt(tiny_model):
    engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25")), target=tiny_model)
    config = DecodeConfig(mode="magicdec", sink_tokens=4, streaming_tokens=256, max_new_tokens=8)
    prompts = engine.document_prompts(DOCUMENT, QUESTION, config)
    assert len(prompts.target_ids) > 1000 and prompts.retrieval is None
    assert prompts.drafter_ids == prompts.target_ids[:4] + prompts.target_ids[-252:]
    messages = [{"role": "user", "content": DOCUMENT}, {"role": "assistant", "content": "Noted."},
                {"role": "user", "content": QUESTION}]
    chat = engine.chat_prompts(messages, config, raw=True)
    assert chat.drafter_ids == chat.target_ids[:4] + chat.target_ids[-252:]


@pytest.mark.parametrize("drafter", ["self", "other"])
def test_greedy_magicdec_equals_lc_and_drafts_from_the_short_view(tiny_model, other_tiny_model, drafter):
    engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25")),
                   target=tiny_model, drafter=other_tiny_model if drafter == "other" else None)
    expected = engine.generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=24, ignore_eos=True)
    got = engine.generate(DOCUMENT, QUESTION, mode="magicdec", streaming_tokens=128, gamma=4, max_new_tokens=24,
                          ignore_eos=True)
    assert got.token_ids == expected.token_ids
    assert got.stats.prompt_tokens_drafter == 128 < got.stats.prompt_tokens_target
    assert got.stats.rounds > 0 and got.stats.retrieved_tokens == 0


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(mode="magicdec", eta=1.0), "eta applies to mode 'rapid' only"),
        (dict(mode="magicdec", sink_tokens=-1), "sink_tokens must be"),
        (dict(mode="magicdec", sink_tokens=64, streaming_tokens=70), "streaming_tokens must be"),
    ],
)
def test_bad_streaming_options_are_clear_errors(options, message):
    with pytest.raises(RapidspecError, match=message):
        DecodeConfig(**options)


def test_bad_retrieval_on_purpose_random_chunks_and_another_corpus(tiny_model):
    engine = Rapid(spec_of(retrieval=RetrievalConfig(method="random", chunk_tokens=64, budget_tokens=192)),
                   target=tiny_model)
    first = engine.generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=4)
    again = engine.generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=4)
    spans = [c.span for c in first.retrieval.chunks]
    assert spans == [c.span for c in again.retrieval.chunks]  # reproducible
    assert 0 < first.retrieval.num_tokens <= 192
    bm25 = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25", chunk_tokens=64, budget_tokens=192)),
                 target=tiny_model)
    assert spans != [c.span for c in bm25.generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=4).retrieval.chunks]
    other = "\n\n".join(f"Orchard row {i} grew {i * 3} pears." for i in range(40))
    unrelated = bm25.generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=4, corpus=other)
    assert all(chunk.text in other for chunk in unrelated.retrieval.chunks)
    assert unrelated.stats.prompt_tokens_target == first.stats.prompt_tokens_target  # the target reads the document
    with pytest.raises(RapidspecError, match="corpus is empty"):
        bm25.generate(DOCUMENT, QUESTION, mode="rapid", corpus="  ")


def test_lookup_proposes_the_continuation_of_the_latest_match():
    from rapidspec.drafting.lookup import LookupDrafter

    a, b, c, d = 1, 2, 3, 4
    drafter = LookupDrafter([a, b, c, d, a, b], vocab_size=10, target_device=torch.device("cpu"))
    assert drafter.continuation(3) == [c, d, a]  # the docstring's worked example
    drafter.commit([c, 9])  # ... a b c 9: no earlier "c 9" or "9"
    assert drafter.continuation(3) == []
    drafter.commit([a, b])  # "9 a b" unseen; "a b" last seen before "c 9"
    assert drafter.continuation(2) == [c, 9]


def test_lookup_with_a_longer_shortest_match_proposes_nothing_on_a_one_token_match():
    from rapidspec.drafting.lookup import MAX_NGRAM, LookupDrafter

    a, b, c, d = 1, 2, 3, 4
    sequence, cpu = [a, b, c, d, 9, c], torch.device("cpu")  # "c" was seen before (then "d 9"); "9 c" was not
    assert LookupDrafter(sequence, vocab_size=10, target_device=cpu).continuation(2) == [d, 9]
    longer = LookupDrafter(sequence, vocab_size=10, target_device=cpu, min_ngram=2)
    assert longer.continuation(2) == []
    longer.commit([d])  # "c d" was seen before, followed by "9 c"
    assert longer.continuation(2) == [9, c]
    for bad in (0, MAX_NGRAM + 1):
        with pytest.raises(ValueError, match="min_ngram"):
            LookupDrafter(sequence, vocab_size=10, target_device=cpu, min_ngram=bad)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_lookup_mode_is_lossless(tiny_model, temperature):
    """Mode lookup drafts from the retrieved text and the answer; greedy equals lc, a seed gives the same run."""
    engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25", chunk_tokens=64, budget_tokens=256)),
                   target=tiny_model)
    options = {"max_new_tokens": 40, "gamma": 4, "temperature": temperature, "seed": 7}
    out = engine.generate(DOCUMENT, QUESTION, mode="lookup", **options)
    assert out.stats.rounds > 0 and out.stats.drafter == "lookup"
    if temperature == 0:
        assert out.token_ids == engine.generate(DOCUMENT, QUESTION, mode="lc", **options).token_ids
    with pytest.raises(RapidspecError, match="eta applies to mode 'rapid' only"):
        DecodeConfig(mode="lookup", eta=1.0)
