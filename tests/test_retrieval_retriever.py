"""Retriever end to end: needle finding, budgets, order, caching, dense and hybrid paths."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rapidspec.errors import RapidspecError
from tests.conftest import train_bpe_tokenizer
from tests.retrieval_stand_ins import NEEDLE, WORDS, BagOfWordsEmbedder, haystack
from rapidspec.retrieval import RetrievalConfig, Retriever, build_query


def tiny_tokenizer():
    """A byte-level BPE tokenizer trained here in milliseconds."""
    return train_bpe_tokenizer([" ".join(WORDS)] * 20 + [NEEDLE], 500)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_bm25_finds_the_needle(tok):
    doc = haystack(400, needle_at=317)
    r = Retriever(RetrievalConfig(method="bm25", chunk_tokens=64, budget_tokens=64), tokenizer=tok)
    result = r.retrieve(doc, "What is the secret password for the vault?")
    assert NEEDLE in result.text
    assert result.chunks[0].rank == 1 and result.chunks[0].score > 0
    assert r._embedder is None  # BM25 never loads an embedder


@pytest.mark.parametrize("document", ["!!! ??? ...", "the a an of", "\U0001F600 \U0001F680"])
def test_bm25_over_a_text_without_indexable_words_scores_zero(tok, document):
    """Punctuation, stopwords or emoji only: no vocabulary to index, every chunk scores 0 (no error)."""
    r = Retriever(RetrievalConfig(method="bm25", chunk_tokens=16, budget_tokens=16), tokenizer=tok)
    result = r.retrieve(document * 20, "hi there")
    assert all(chunk.score == 0 for chunk in result.chunks)


def test_result_contract(tok):
    doc = haystack(300, needle_at=5)
    r = Retriever(RetrievalConfig(method="bm25", chunk_tokens=48, budget_tokens=300), tokenizer=tok)
    result = r.retrieve(doc, "secret password vault river")
    assert result.num_tokens == sum(c.num_tokens for c in result.chunks) <= 300
    assert [c.char_start for c in result.chunks] == sorted(c.char_start for c in result.chunks)
    assert result.text == "\n\n".join(doc[a:b] for a, b in result.spans)
    assert all(doc[c.char_start : c.char_end] == c.text for c in result.chunks)
    d = json.loads(json.dumps(result.to_dict()))
    assert d["method"] == "bm25" and d["budget_tokens"] == 300 and d["num_tokens"] == result.num_tokens
    assert {"char_start", "char_end", "score", "rank", "num_tokens", "text", "index"} <= set(d["chunks"][0])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget=st.integers(40, 2000), chunk_tokens=st.integers(24, 120), method=st.sampled_from(["bm25", "dense", "hybrid"]))
def test_budget_never_exceeded(tok, budget, chunk_tokens, method):
    doc = haystack(60, seed=budget)
    config = RetrievalConfig(method=method, chunk_tokens=chunk_tokens, budget_tokens=budget)
    r = Retriever(config, tokenizer=tok, embedder=BagOfWordsEmbedder())
    try:
        result = r.retrieve(doc, "winter harbor lantern")
    except RapidspecError:
        assert min(c.num_tokens for c in r.chunks(doc)) > budget
        return
    assert 0 < result.num_tokens <= budget
    assert [c.index for c in result.chunks] == sorted(c.index for c in result.chunks)


def test_default_budget_and_min_score(tok):
    doc = haystack(400)
    r = Retriever(RetrievalConfig(method="bm25", chunk_tokens=64), tokenizer=tok)
    result = r.retrieve(doc, "harbor")
    assert result.budget_tokens == max(256, min(4096, result.document_tokens // 16))
    strict = Retriever(RetrievalConfig(method="bm25", chunk_tokens=64, min_score=1e9), tokenizer=tok)
    assert strict.retrieve(doc, "harbor").chunks == ()


def test_hybrid_scores_are_rrf_of_bm25_and_dense(tok):
    doc = haystack(80, needle_at=40)
    embedder = BagOfWordsEmbedder()
    make = lambda m: Retriever(RetrievalConfig(method=m, chunk_tokens=64), tokenizer=tok, embedder=embedder)  # noqa: E731
    query = "secret vault password"
    bm25, dense, hybrid = (make(m).scores(doc, query) for m in ("bm25", "dense", "hybrid"))
    n = len(bm25)
    expected = np.zeros(n)
    bm25_order = [i for i in np.argsort(-bm25, kind="stable") if bm25[i] > 0]
    for rank, i in enumerate(bm25_order, 1):
        expected[i] += 1 / (60 + rank)
    for rank, i in enumerate(np.argsort(-dense, kind="stable"), 1):
        expected[i] += 1 / (60 + rank)
    assert hybrid == pytest.approx(expected)
    assert NEEDLE in make("hybrid").retrieve(doc, query).text


def test_auto_is_bm25_over_conversation_turns_and_hybrid_over_documents(tok):
    doc = haystack(80, needle_at=40)
    query = "secret vault password"
    embedder = BagOfWordsEmbedder()
    auto = Retriever(RetrievalConfig(chunk_tokens=64), tokenizer=tok, embedder=embedder)  # method="auto", the default
    hybrid = Retriever(RetrievalConfig(method="hybrid", chunk_tokens=64), tokenizer=tok, embedder=embedder)
    assert auto.scores(doc, query) == pytest.approx(hybrid.scores(doc, query))
    assert auto.retrieve(doc, query).method == "hybrid"
    turns = [f"turn {i}: the weather was mild and the garden quiet." for i in range(30)]
    turns[17] = NEEDLE
    lazy = Retriever(RetrievalConfig(chunk_tokens=64, budget_tokens=64), tokenizer=tok)
    result = lazy.retrieve_segments(turns, "What is the secret password for the vault?")
    assert result.method == "bm25" and NEEDLE in result.text
    assert lazy._embedder is None  # a conversation never loads the embedder under auto


def test_document_work_is_cached(tok):
    doc = haystack(100)
    embedder = BagOfWordsEmbedder()
    r = Retriever(RetrievalConfig(method="hybrid", chunk_tokens=64), tokenizer=tok, embedder=embedder)
    first = r.retrieve(doc, "winter")
    calls_after_first = embedder.calls  # chunk embeddings + one query
    r.retrieve(doc, "summer garden")
    assert embedder.calls == calls_after_first + 1  # only the new query is embedded
    assert r.chunks(doc) is r.chunks(doc)
    assert first.num_document_chunks == len(r.chunks(doc))


def test_cache_is_bounded(tok):
    r = Retriever(RetrievalConfig(method="bm25", chunk_tokens=64, max_cached_documents=2), tokenizer=tok)
    for seed in range(4):
        r.retrieve(haystack(5, seed=seed), "river")
    assert len(r._documents) == 2


@pytest.mark.parametrize("document, query, message", [
    ("", "q", "document is empty"),
    (" \n\r\n\t", "q", "document is empty"),
    ("some text here", "  ", "query is empty"),
])
def test_empty_inputs_are_errors(tok, document, query, message):
    r = Retriever(RetrievalConfig(method="bm25"), tokenizer=tok)
    with pytest.raises(RapidspecError, match=message):
        r.retrieve(document, query)


def test_budget_below_every_chunk_is_an_error(tok):
    r = Retriever(RetrievalConfig(method="bm25", chunk_tokens=200, budget_tokens=3), tokenizer=tok)
    with pytest.raises(RapidspecError, match="smaller than every candidate chunk"):
        r.retrieve(haystack(10), "river")


def test_unknown_embedding_model_is_a_clear_error(tok, tmp_path):
    missing = str(tmp_path / "no-such-model")
    r = Retriever(RetrievalConfig(method="dense", embedding_model=missing), tokenizer=tok)
    with pytest.raises(RapidspecError, match="not available offline"):
        r.retrieve(haystack(5), "river")


def test_build_query():
    assert build_query("Who?") == "Who?"
    assert build_query("Who?", ["A. Ann", "B. Bob"]) == "Who?\nA. Ann\nB. Bob"


def test_dense_with_the_builtin_offline_model(tok):
    doc = "\n\n".join([
        "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar and oxygen.",
        "The stock market fell sharply on Tuesday after the central bank raised interest rates.",
        "Our football team won the championship final with a late goal in extra time.",
        "Volcanoes erupt when molten rock from deep underground reaches the surface.",
    ] * 3)
    r = Retriever(RetrievalConfig(method="dense", chunk_tokens=32, budget_tokens=32), tokenizer=tok)
    result = r.retrieve(doc, "How do green plants make their food from light?")
    assert "Photosynthesis" in result.text
    assert -1.0 <= result.chunks[0].score <= 1.0 and result.chunks[0].score > 0.3
    hybrid = Retriever(RetrievalConfig(method="hybrid", chunk_tokens=32, budget_tokens=32), tokenizer=tok, embedder=r.embedder)
    assert "The stock market" in hybrid.retrieve(doc, "Why did share prices drop after the interest rate decision?").text


@pytest.mark.slow
def test_long_chunks_are_embedded_in_windows():
    from rapidspec.retrieval.dense import load_embedder, split_windows

    embedder = load_embedder()
    long_text = " ".join(["lantern"] * 600) + " the final window mentions a volcano"
    windows, owners = split_windows(embedder, ["short text", long_text])
    assert owners.tolist()[0] == 0 and owners.tolist().count(1) >= 3
    assert windows[0] == "short text" and "volcano" in windows[-1]


@pytest.mark.slow
def test_builtin_tokenizer_counts_match():
    from rapidspec.retrieval import resolve_tokenizer

    tok = resolve_tokenizer("builtin")
    doc = haystack(50, needle_at=20)
    result = Retriever(RetrievalConfig(method="bm25", chunk_tokens=128, budget_tokens=128), tokenizer=tok).retrieve(doc, "secret password")
    assert NEEDLE in result.text
    assert all(c.num_tokens == len(tok.encode(c.text, add_special_tokens=False)) <= 128 for c in result.chunks)


def test_default_budget_cuts_chunks_to_fit():
    """A document just over the 256-token minimum budget, in one long paragraph:
    with the default budget the chunks are cut to fit it (never an error)."""
    tok = tiny_tokenizer()
    document = " ".join(random.Random(3).choices(WORDS, k=400)) + " " + NEEDLE
    document_tokens = len(tok(document, add_special_tokens=False)["input_ids"])
    assert 256 < document_tokens < 512
    result = Retriever(RetrievalConfig(method="bm25", chunk_tokens=512), tokenizer=tok).retrieve(
        document, "What is the secret password for the vault?"
    )
    assert result.budget_tokens == 256
    assert 0 < result.num_tokens <= 256
    assert NEEDLE in result.text
    # An explicit budget smaller than every chunk is still refused.
    with pytest.raises(RapidspecError, match="budget"):
        Retriever(RetrievalConfig(method="bm25", chunk_tokens=512, budget_tokens=100), tokenizer=tok).retrieve(
            document, "password?"
        )


@pytest.mark.parametrize(("dtype", "expected"), [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_the_embedder_loads_in_the_configured_dtype(tok, dtype, expected):
    config = RetrievalConfig(method="dense", chunk_tokens=32, budget_tokens=32, embedding_dtype=dtype)
    r = Retriever(config, tokenizer=tok)
    r.warm_up()
    assert next(r.loaded_embedder.parameters()).dtype == expected
    doc = "Photosynthesis turns light into sugar in the leaves.\n\n" + "The stock market fell after the rate decision. " * 8
    assert "Photosynthesis" in r.retrieve(doc, "How do plants make sugar from light?").text


def test_auto_embedding_dtype_follows_the_hardware(tok):
    from rapidspec.runtime.native_dtype import native_dtype

    r = Retriever(RetrievalConfig(method="dense"), tokenizer=tok)
    r.warm_up()
    assert next(r.loaded_embedder.parameters()).dtype == native_dtype(r.loaded_embedder.device)


def test_embedding_dtype_is_validated():
    with pytest.raises(RapidspecError, match="embedding_dtype must be one of auto, float32, bfloat16, float16"):
        RetrievalConfig(embedding_dtype="int8")


def test_chunkers_of_every_size_share_one_tokenizer_copy(tok):
    """warm_up builds the chunker of chunk_tokens; a budget-sized one reuses its private tokenizer copy."""
    r = Retriever(RetrievalConfig(method="bm25", chunk_tokens=64), tokenizer=tok)
    r.warm_up()
    assert list(r._chunkers) == [64] and r.loaded_embedder is None  # bm25: no embedder
    r._chunker(48)
    assert {id(c._backend) for c in r._chunkers.values()} == {id(r._private_tokenizer)}
    assert r._private_tokenizer.tokenizer is not tok.backend_tokenizer  # a copy: the caller's is never modified
