"""Choose chunks under a token budget.

Policy (greedy, skip-and-continue):

1. drop chunks scoring below ``min_score`` (if given);
2. walk the remaining chunks best score first (ties: document order) and take
   each one whose tokens still fit in what is left of the budget; a chunk that
   does not fit is *skipped* and smaller, lower-ranked chunks are still tried,
   so the budget is used well but never exceeded;
3. the caller puts the chosen chunks back into document order.

The budget counts chunk tokens only: ``sum(chunk.num_tokens) <= budget``. The
``"\\n\\n"`` separators used to join chunks are not counted (they add about one
token per chunk with most tokenizers).

Worked example (budget 10)::

    ranked chunks (index: tokens)  3:6, 0:5, 7:4, 1:2
    take 3 (6 used), skip 0 (11 > 10), take 7 (10 used), skip 1 -> [3, 7]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rapidspec.errors import RapidspecError
from rapidspec.retrieval.fusion import rank_by_score

MIN_DEFAULT_BUDGET = 256
MAX_DEFAULT_BUDGET = 4096


def default_budget(document_tokens: int) -> int:
    """``clamp(document_tokens // 16, 256, 4096)``: the budget when none is given."""
    return max(MIN_DEFAULT_BUDGET, min(MAX_DEFAULT_BUDGET, document_tokens // 16))


def select_chunks(
    scores: np.ndarray,
    token_counts: Sequence[int],
    budget: int,
    *,
    min_score: float | None = None,
) -> list[tuple[int, int]]:
    """Chosen ``(chunk_index, rank)`` pairs, best first (rank 1 = best score).

    Ranks are positions in the ranking of *all* chunks by score, so they stay
    meaningful when lower-ranked chunks were taken instead of skipped ones.
    Returns ``[]`` when ``min_score`` removes every chunk.

    Raises:
        RapidspecError: no candidate chunk fits in ``budget``.
    """
    scores = np.asarray(scores)  # [num_chunks]
    if len(scores) != len(token_counts):
        raise ValueError(f"{len(scores)} scores for {len(token_counts)} chunks")
    chosen: list[tuple[int, int]] = []
    used = 0
    smallest: int | None = None
    for rank, index in enumerate(rank_by_score(scores).tolist(), start=1):
        if min_score is not None and not scores[index] >= min_score:
            continue
        tokens = int(token_counts[index])
        smallest = tokens if smallest is None else min(smallest, tokens)
        if used + tokens <= budget:
            chosen.append((index, rank))
            used += tokens
    if smallest is not None and not chosen:
        raise RapidspecError(
            f"budget of {budget} tokens is smaller than every candidate chunk (smallest: {smallest} tokens); "
            "raise the budget or lower chunk_tokens"
        )
    return chosen
