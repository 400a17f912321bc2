"""Chunk embeddings on disk, keyed by content, so another process embedding the same text reads them.

A :class:`~rapidspec.retrieval.dense.DenseIndex` asks the store before it
embeds: the key is a SHA-256 over the embedder's fingerprint and the exact
window texts it would embed, so a second ``rapidspec generate`` on the same
document, a restarted server or another replica on the machine reuses the
vectors, and a changed document, chunking or embedder is a different key
(nothing to invalidate by hand). The embedder's fingerprint is its own
embedding of a fixed probe text (rounded to 4 decimals): other weights give
another fingerprint; how it cuts long chunks is in the window texts.

The store also keeps each document's chunk boundaries (``[chunks, 3]``
int64: start, end, tokens), keyed by the tokenizer (a hash of its
serialisation), the chunking settings, the splitter's version and the text,
so a later process neither builds a splitter nor chunks the document again.

Files live under ``<cache>/embeddings/`` (``$RAPIDSPEC_CACHE``, see
:mod:`rapidspec.runtime.cache_dir`; ``$RAPIDSPEC_EMBEDDING_STORE`` names
another folder), one ``.npy`` each, written to a
temporary name and renamed (a reader never sees half a file); beyond
``max_bytes`` the least recently used are removed. A file that cannot be
read is removed and the text embedded again. A store that cannot be
written (a read-only folder, a full disk) is logged once per folder and cause
and the run goes on without it, reading what the folder holds already
(:func:`~rapidspec.runtime.cache_dir.cache_write`: no partial file is left).
"""

from __future__ import annotations

import hashlib
import logging
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rapidspec.runtime.cache_dir import cache_root, cache_write, remove_quietly

logger = logging.getLogger(__name__)

#: Text whose embedding fingerprints an embedder's weights.
PROBE = "rapidspec embedding store probe: the quick brown fox jumps over the lazy dog."
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def embedder_fingerprint(embedder: Any) -> str:
    """A short hash naming what ``embedder`` computes (computed once per embedder object)."""
    try:
        return _FINGERPRINTS[embedder]
    except (KeyError, TypeError):
        pass
    probe = np.asarray(embedder.encode([PROBE], normalize_embeddings=True, convert_to_numpy=True,
                                       show_progress_bar=False), dtype=np.float32)  # [1, dim]
    digest = hashlib.sha256(f"{probe.shape}\0".encode())
    digest.update(np.round(probe, 4).tobytes())  # rounding: the same weights on another device agree
    fingerprint = digest.hexdigest()[:16]
    try:
        _FINGERPRINTS[embedder] = fingerprint
    except TypeError:  # not weakly referenceable: computed again next time
        pass
    return fingerprint


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash naming what ``tokenizer`` (a ``tokenizers.Tokenizer``) computes: its serialisation."""
    return hashlib.sha256(tokenizer.to_str().encode("utf-8", "surrogatepass")).hexdigest()[:16]


def default_directory() -> Path:
    """``$RAPIDSPEC_EMBEDDING_STORE`` if set, else ``<cache>/embeddings`` (read on every call)."""
    if os.environ.get("RAPIDSPEC_EMBEDDING_STORE"):
        return Path(os.environ["RAPIDSPEC_EMBEDDING_STORE"]).expanduser()
    return cache_root() / "embeddings"


class EmbeddingStore:
    """Embeddings by key in ``directory`` (None: :func:`default_directory`), at most ``max_bytes`` of them."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, max_bytes: int = 1 << 30) -> None:
        self.directory = Path(directory) if directory is not None else default_directory()
        self.max_bytes = max_bytes

    @staticmethod
    def key(fingerprint: str, windows: Sequence[str]) -> str:
        digest = hashlib.sha256(fingerprint.encode())
        for window in windows:
            digest.update(len(window).to_bytes(8, "little"))
            digest.update(window.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.npy"

    @staticmethod
    def chunks_key(tokenizer_fingerprint: str, settings: str, document: str) -> str:
        """The key of a document's chunk boundaries: the tokenizer, the chunking settings and the text."""
        digest = hashlib.sha256(f"chunks\0{tokenizer_fingerprint}\0{settings}\0".encode())
        digest.update(document.encode("utf-8", "surrogatepass"))
        return f"chunks-{digest.hexdigest()}"

    def load(self, key: str, rows: int | None = None, dtype: type = np.float32) -> np.ndarray | None:
        """The stored ``[rows, dim]`` array of ``key`` (``rows`` None: any), or None (a miss, or a file that does
        not fit: removed). Embeddings are float32; chunk boundaries (:meth:`chunks_key`) int64."""
        path = self._path(key)
        try:
            vectors = np.load(path, allow_pickle=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ValueError) as err:
            logger.warning("ignoring an unreadable embedding file %s (%s)", path, err)
            remove_quietly(path)
            return None
        if vectors.ndim != 2 or (rows is not None and vectors.shape[0] != rows) or vectors.dtype != dtype:
            remove_quietly(path)
            return None
        try:
            os.utime(path)  # recently used
        except OSError:
            pass
        return vectors

    def save(self, key: str, vectors: np.ndarray) -> None:
        """Store ``vectors`` (float32, or int64 chunk boundaries) under ``key``; never raises (a full or read-only
        folder is logged once per cause and the run goes on without the file)."""
        kept = vectors if vectors.dtype == np.int64 else np.asarray(vectors, dtype=np.float32)

        def write(temporary: Path) -> None:
            with open(temporary, "xb") as file:
                np.save(file, np.ascontiguousarray(kept), allow_pickle=False)

        if cache_write(self._path(key), write, "embeddings", "embedding without the disk store"):
            self._prune()

    def _prune(self) -> None:
        """Remove the least recently used files beyond ``max_bytes``."""
        files = []
        for path in self.directory.glob("*.npy"):
            try:
                stat = path.stat()
            except OSError:
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            remove_quietly(path)
            total -= size
