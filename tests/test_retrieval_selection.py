"""Selection under a budget, default budget, RRF and config validation (no models)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rapidspec.errors import RapidspecError
from rapidspec.retrieval import RetrievalConfig, default_budget
from rapidspec.retrieval.fusion import rank_by_score, reciprocal_rank_fusion
from rapidspec.retrieval.selection import select_chunks


def test_worked_example_skips_what_does_not_fit():
    scores = np.zeros(8)
    scores[[3, 0, 7, 1]] = [4.0, 3.0, 2.0, 1.0]
    counts = [5, 2, 1, 6, 1, 1, 1, 4]
    chosen = select_chunks(scores, counts, 10, min_score=0.5)
    assert [i for i, _ in chosen] == [3, 7]
    assert [r for _, r in chosen] == [1, 3]


@given(
    data=st.lists(st.tuples(st.floats(-5, 5), st.integers(1, 50)), min_size=1, max_size=40),
    budget=st.integers(1, 400),
)
def test_budget_never_exceeded_and_greedy(data, budget):
    scores = np.array([s for s, _ in data])
    counts = [n for _, n in data]
    try:
        chosen = select_chunks(scores, counts, budget)
    except RapidspecError:
        assert min(counts) > budget
        return
    used = sum(counts[i] for i, _ in chosen)
    assert used <= budget
    # Greedy: every unchosen chunk would overflow the budget at its turn, so at least now.
    picked = {i for i, _ in chosen}
    assert all(counts[i] > budget - used for i in range(len(counts)) if i not in picked)
    ranks = [r for _, r in chosen]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)


def test_min_score_can_leave_nothing():
    assert select_chunks(np.array([0.1, 0.2]), [1, 1], 10, min_score=0.5) == []


def test_budget_smaller_than_every_chunk_is_an_error():
    with pytest.raises(RapidspecError, match="smaller than every candidate chunk"):
        select_chunks(np.array([1.0, 2.0]), [30, 40], 20)


def test_ties_keep_document_order():
    assert rank_by_score(np.array([1.0, 2.0, 1.0, 2.0])).tolist() == [1, 3, 0, 2]
    assert rank_by_score(np.array([0.0, 2.0, 1.0]), keep=np.array([0.0, 2.0, 1.0]) > 0).tolist() == [1, 2]


def test_rrf_hand_made_example():
    fused = reciprocal_rank_fusion([[2, 0], [0, 1, 2]], 3, k=60)
    assert fused == pytest.approx([1 / 62 + 1 / 61, 1 / 62, 1 / 61 + 1 / 63])
    assert rank_by_score(fused).tolist() == [0, 2, 1]


@pytest.mark.parametrize("tokens, budget", [(0, 256), (4096, 256), (16 * 1000, 1000), (10**7, 4096)])
def test_default_budget(tokens, budget):
    assert default_budget(tokens) == budget


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"method": "tfidf"}, "unknown retrieval method"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"chunk_tokens": 64, "overlap_tokens": 64}, "overlap_tokens=64 must be smaller"),
        ({"overlap_tokens": -1}, "overlap_tokens"),
        ({"budget_tokens": 0}, "budget_tokens"),
        ({"min_score": float("nan")}, "min_score"),
        ({"embedding_model": " "}, "embedding_model"),
        ({"chunk_tokens": 1.5}, "chunk_tokens"),
        # bounded: a request may not ask for millions of chunks or a huge budget
        ({"chunk_tokens": 1}, "chunk_tokens must be an integer >= 16"),
        ({"chunk_tokens": 10**6}, "chunk_tokens must be at most 8192"),
        ({"budget_tokens": 10**12}, "budget_tokens must be at most"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(RapidspecError, match=message):
        RetrievalConfig(**kwargs)


def test_config_is_frozen():
    config = RetrievalConfig()
    assert (config.method, config.chunk_tokens, config.overlap_tokens, config.budget_tokens) == ("auto", 512, 0, None)
    with pytest.raises(AttributeError):
        config.method = "bm25"  # type: ignore[misc]
