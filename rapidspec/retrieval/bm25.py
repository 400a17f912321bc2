"""BM25 over chunks with ``bm25s`` (lexical; no model).

Text is lower-cased, split into runs of two or more word characters, English
stop words are removed and, when PyStemmer is installed, words are reduced to
their Snowball English stem. Scores are bm25s' default BM25 (Lucene variant,
k1=1.5, b=0.75): non-negative, 0 when a chunk shares no query term.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import bm25s
import numpy as np

logger = logging.getLogger(__name__)

# bm25s sets its own logger to DEBUG when imported, so that every index build
# prints "Building index from IDs objects" as soon as an application calls
# logging.basicConfig(). Undo that import side effect: inherit the app's level.
logging.getLogger("bm25s").setLevel(logging.NOTSET)


def english_stemmer() -> Any | None:
    """A Snowball English stemmer if PyStemmer is installed, else None."""
    try:
        import Stemmer
    except ImportError:
        logger.info("PyStemmer not installed; BM25 runs without stemming")
        return None
    return Stemmer.Stemmer("english")


class BM25Index:
    """A BM25 index of a fixed list of texts.

    >>> index = BM25Index(["the cat sat", "dogs run fast", "the password is swordfish"])
    >>> int(index.scores("what is the password?").argmax())
    2
    """

    def __init__(self, texts: Sequence[str]) -> None:
        self._stemmer = english_stemmer()
        self._num_texts = len(texts)
        tokens = bm25s.tokenize(list(texts), stopwords="en", stemmer=self._stemmer, show_progress=False)
        self._bm25 = None  # texts without a single indexable word (punctuation, stopwords, emoji) score 0
        if tokens.vocab:
            self._bm25 = bm25s.BM25()
            self._bm25.index(tokens, show_progress=False)

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every text for ``query``.  # [num_texts] float32"""
        words = bm25s.tokenize(
            [query], stopwords="en", stemmer=self._stemmer, return_ids=False, show_progress=False
        )[0]
        known = [] if self._bm25 is None else [w for w in words if w in self._bm25.vocab_dict]
        if not known:
            return np.zeros(self._num_texts, dtype=np.float32)
        return np.asarray(self._bm25.get_scores(known), dtype=np.float32)
