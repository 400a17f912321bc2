"""Rankings and reciprocal-rank fusion (RRF, Cormack et al. 2009).

A ranking is a sequence of item indices, best first; ranks are 1-based.
RRF gives item ``i`` the score ``sum over rankings r of 1 / (k + rank_r(i))``,
counting only the rankings that contain ``i``.

Worked example (k = 60, 3 items)::

    bm25  ranking [2, 0]      (item 1 shares no query word, so it is absent)
    dense ranking [0, 1, 2]
    score[0] = 1/62 + 1/61 = 0.03252      score[1] = 1/62 = 0.01613
    score[2] = 1/61 + 1/63 = 0.03227      fused ranking [0, 2, 1]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def rank_by_score(scores: np.ndarray, keep: np.ndarray | None = None) -> np.ndarray:
    """Indices of ``scores`` best first; ties keep index (document) order.

    ``keep``, a boolean mask, drops items from the ranking.
    """
    scores = np.asarray(scores)  # [n]
    order = np.argsort(-scores, kind="stable")
    if keep is not None:
        order = order[np.asarray(keep)[order]]
    return order


def reciprocal_rank_fusion(rankings: Sequence[Sequence[int]], num_items: int, k: int = 60) -> np.ndarray:
    """RRF score of each of ``num_items`` items.  # [num_items] float64"""
    fused = np.zeros(num_items, dtype=np.float64)
    for ranking in rankings:
        ranking = np.asarray(ranking, dtype=np.int64)
        fused[ranking] += 1.0 / (k + np.arange(1, len(ranking) + 1))
    return fused
