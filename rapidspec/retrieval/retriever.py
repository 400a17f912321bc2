"""The retriever: document + query -> the drafter's short context.

``Retriever.retrieve`` chunks the document (:mod:`.chunking`), scores every
chunk for the query (:mod:`.bm25`, :mod:`.dense`, or both fused by
:mod:`.fusion`), keeps the best chunks within the token budget
(:mod:`.selection`) and returns them in document order, joined by blank lines.

Scores in results are the method's own: BM25 score (``bm25``), cosine
similarity (``dense``), reciprocal-rank-fusion score (``hybrid``, k = 60,
over the BM25 ranking of chunks sharing a query word and the full dense
ranking). ``min_score`` applies to that score. The default method, ``auto``,
is ``bm25`` over a conversation's turns (:meth:`Retriever.retrieve_segments`)
and ``hybrid`` over documents; results name the method actually used.

Per document (keyed by a SHA-256 of the chunking settings and the text) the
retriever caches the chunks, the BM25 index and the chunk embeddings, so more
questions on the same document only score and select; with the embedding
store on, chunk boundaries and embeddings are also kept on disk for other
processes (:mod:`.embedding_store`). The embedder is loaded
on first dense use, once per retriever; BM25-only use never loads it.
A retriever is not thread-safe.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rapidspec.errors import RapidspecError
from rapidspec.retrieval.bm25 import BM25Index
from rapidspec.retrieval.chunking import SECTION_CHARS, Chunk, Chunker, PrivateTokenizer, private_tokenizer, splitter_version
from rapidspec.retrieval.config import AUTO_METHOD, RetrievalConfig
from rapidspec.retrieval.dense import DenseIndex, load_embedder
from rapidspec.retrieval.embedding_store import EmbeddingStore, embedder_fingerprint, tokenizer_fingerprint
from rapidspec.retrieval.fusion import rank_by_score, reciprocal_rank_fusion
from rapidspec.retrieval.selection import default_budget, select_chunks

logger = logging.getLogger(__name__)

#: Separator between retrieved chunks in ``RetrievalResult.text``.
CHUNK_SEPARATOR = "\n\n"


def build_query(question: str, options: Sequence[str] | None = None) -> str:
    """The retrieval query: the question, then each multiple-choice option on its own line."""
    return "\n".join([question, *options]) if options else question


@dataclass(frozen=True)
class RetrievedChunk:
    """A selected chunk: ``document[char_start:char_end] == text``.

    ``rank`` is 1 for the best-scoring chunk of the whole document; ``index``
    is the chunk's position among all chunks of the document.
    """

    index: int
    text: str
    char_start: int
    char_end: int
    num_tokens: int
    score: float
    rank: int

    @property
    def span(self) -> tuple[int, int]:
        return (self.char_start, self.char_end)

    def to_dict(self, include_text: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": self.index,
            "rank": self.rank,
            "score": self.score,
            "char_start": self.char_start,
            "char_end": self.char_end,
            "num_tokens": self.num_tokens,
        }
        if include_text:
            out["text"] = self.text
        return out


@dataclass(frozen=True)
class RetrievalResult:
    """The short context and where it came from.

    ``num_tokens`` is the sum of the chunks' token counts (``<= budget_tokens``);
    the ``"\\n\\n"`` separators in ``text`` are not counted. ``document_tokens``
    is the sum over *all* chunks of the document. ``seconds`` is wall time of
    this call, including chunking/indexing/embedding when not cached.
    """

    method: str
    budget_tokens: int
    chunks: tuple[RetrievedChunk, ...]
    num_tokens: int
    document_tokens: int
    num_document_chunks: int
    seconds: float
    text: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", CHUNK_SEPARATOR.join(c.text for c in self.chunks))

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        return tuple(c.span for c in self.chunks)

    def to_dict(self, include_text: bool = True) -> dict[str, Any]:
        """A JSON-serialisable summary (plain ints, floats, strings, lists)."""
        return {
            "method": self.method,
            "budget_tokens": self.budget_tokens,
            "num_tokens": self.num_tokens,
            "num_chunks": len(self.chunks),
            "document_tokens": self.document_tokens,
            "num_document_chunks": self.num_document_chunks,
            "seconds": self.seconds,
            "chunks": [c.to_dict(include_text) for c in self.chunks],
        }


class _DocumentState:
    """What a retriever remembers about one document (built lazily)."""

    def __init__(self, chunks: tuple[Chunk, ...], kind: str = "document") -> None:
        self.chunks = chunks
        self.kind = kind  # "document", or "conversation" for the turns of retrieve_segments
        self.bm25: BM25Index | None = None
        self.dense: dict[str, DenseIndex] = {}  # embedding model -> index


class Retriever:
    """Builds short contexts from long documents; see the module docstring.

    Args:
        config: retrieval settings (default :class:`RetrievalConfig()`).
        tokenizer: the target model's Hugging Face tokenizer (token counts,
            chunk sizes and budgets are in its tokens).
        embedder: an already-loaded ``SentenceTransformer`` to use instead of
            loading ``config.embedding_model``.

    Example::

        r = Retriever(RetrievalConfig(method="bm25", budget_tokens=1024), tokenizer=tok)
        result = r.retrieve(document, "Who wrote the letter?")
        result.text, result.spans, result.num_tokens
    """

    def __init__(self, config: RetrievalConfig | None = None, *, tokenizer: Any, embedder: Any = None) -> None:
        if tokenizer is None:
            raise RapidspecError("a tokenizer is required to count tokens")
        self.config = config or RetrievalConfig()
        self.tokenizer = tokenizer
        self._chunkers: dict[int, Chunker] = {}
        self._private_tokenizer: Any = None
        self._tokenizer_fingerprint: str | None = None
        self._embedder = embedder
        self._embedder_lock = threading.Lock()  # loaded once, whichever thread asks first (a server's warm-up)
        self._documents: OrderedDict[str, _DocumentState] = OrderedDict()
        self._documents_lock = threading.Lock()  # a server prepares requests on several threads
        gib = self.config.embedding_store_gib
        self._store = EmbeddingStore(max_bytes=int(gib * 2**30)) if gib > 0 else None

    @property
    def embedder(self) -> Any:
        """The sentence-transformers model, loaded on first access."""
        if self._embedder is None:
            with self._embedder_lock:
                if self._embedder is None:
                    self._embedder = load_embedder(self.config.embedding_model, self.config.device,
                                                   self.config.embedding_dtype)
        return self._embedder

    def warm_up(self) -> None:
        """Load what a first query would: the chunker of ``chunk_tokens``, and the embedder (with its store
        fingerprint) when the method may use it, so a first query's time is retrieval alone."""
        self._chunker(self.config.chunk_tokens)
        self._chunks_key("", self.config.chunk_tokens)  # the tokenizer's fingerprint, once
        if self.config.method in ("dense", "hybrid", "auto"):
            embedder = self.embedder
            if self._store is not None:
                embedder_fingerprint(embedder)  # memoised per embedder

    @property
    def loaded_embedder(self) -> Any:
        """The sentence-transformers model if it is loaded already, else None (never loads it)."""
        return self._embedder

    def chunks(self, document: str) -> tuple[Chunk, ...]:
        """All chunks of ``document`` (cached)."""
        return self._state(document).chunks

    def scores(self, document: str, query: str) -> np.ndarray:
        """The method's score for every chunk of ``document``.  # [num_chunks]"""
        _check_text("query", query)
        return self._scores(self._state(document), query)

    def drafter_budget(self, document_tokens: int) -> int:
        """The token budget of a retrieval from a document of about ``document_tokens`` tokens."""
        return self.config.budget_tokens or default_budget(document_tokens)

    def tokens_to_embed(self, document: str, document_tokens: int, kind: str = "document") -> int:
        """About how many tokens retrieving from ``document`` embeds first: ``document_tokens`` when the method
        has a dense part and this retriever has not embedded the document yet, else 0 (a cheap query)."""
        if self.method_for(kind) not in ("dense", "hybrid"):
            return 0
        with self._documents_lock:
            state = self._documents.get(self._document_key(document, self.config.chunk_tokens))
        return 0 if state is not None and self.config.embedding_model in state.dense else document_tokens

    def retrieve(self, document: str, query: str) -> RetrievalResult:
        """The best chunks for ``query`` within the budget, in document order.

        The budget is ``config.budget_tokens`` or, when None,
        ``clamp(document_tokens // 16, 256, 4096)``. With that default budget,
        chunks are cut at ``min(chunk_tokens, budget)`` tokens so that the best
        chunk always fits (an explicit budget smaller than every chunk is an
        error instead).

        Raises:
            RapidspecError: empty document or query, no chunk fits the budget,
                or the embedding model is not available offline.
        """
        return self._retrieve(lambda chunk_tokens: self._state(document, chunk_tokens), query)

    def retrieve_segments(self, segments: Sequence[str], query: str) -> RetrievalResult:
        """Like :meth:`retrieve` over ``"\\n\\n".join(segments)``, never cutting across segments.

        Each segment (a turn of a conversation, say) is one chunk, or several
        when it is longer than ``chunk_tokens``; spans index the joined text.
        With the default budget, segments are cut at ``min(chunk_tokens,
        budget)`` tokens as in :meth:`retrieve`.
        """
        segments = list(segments)
        if not any(s.strip() for s in segments):
            raise RapidspecError("nothing to retrieve from: every segment is empty")
        return self._retrieve(lambda chunk_tokens: self._segment_state(segments, chunk_tokens), query)

    def _retrieve(self, state_for: Callable[[int], _DocumentState], query: str) -> RetrievalResult:
        """Budget and selection over the chunks ``state_for(chunk_tokens)`` makes (see :meth:`retrieve`)."""
        started = time.perf_counter()
        _check_text("query", query)
        state = state_for(self.config.chunk_tokens)
        document_tokens = sum(c.num_tokens for c in state.chunks)
        budget = self.config.budget_tokens or default_budget(document_tokens)
        if self.config.budget_tokens is None and budget < self.config.chunk_tokens:
            state = state_for(budget)
        return self._select(state, query, budget, document_tokens, started)

    def _select(
        self, state: _DocumentState, query: str, budget: int, document_tokens: int, started: float
    ) -> RetrievalResult:
        scores = self._scores(state, query)
        counts = [c.num_tokens for c in state.chunks]
        chosen = select_chunks(scores, counts, budget, min_score=self.config.min_score)
        if not chosen:
            logger.warning("no chunk scored at least min_score=%s; the context is empty", self.config.min_score)
        retrieved = tuple(
            RetrievedChunk(
                index=c.index,
                text=c.text,
                char_start=c.char_start,
                char_end=c.char_end,
                num_tokens=c.num_tokens,
                score=float(scores[c.index]),
                rank=rank,
            )
            for c, rank in sorted(((state.chunks[i], rank) for i, rank in chosen), key=lambda cr: cr[0].index)
        )
        return RetrievalResult(
            method=self.method_for(state.kind),
            budget_tokens=budget,
            chunks=retrieved,
            num_tokens=sum(c.num_tokens for c in retrieved),
            document_tokens=document_tokens,
            num_document_chunks=len(state.chunks),
            seconds=time.perf_counter() - started,
        )

    # -- internals -------------------------------------------------------

    def _chunker(self, chunk_tokens: int) -> Chunker:
        if chunk_tokens not in self._chunkers:
            overlap = min(self.config.overlap_tokens, chunk_tokens - 1)
            self._chunkers[chunk_tokens] = Chunker(self._tokenizer_copy(), chunk_tokens, overlap)
        return self._chunkers[chunk_tokens]

    def _tokenizer_copy(self) -> Any:
        """One private copy of the tokenizer for every chunk size (the tokenizer itself when it is a slow one)."""
        if self._private_tokenizer is None:
            self._private_tokenizer = private_tokenizer(self.tokenizer) or self.tokenizer
        return self._private_tokenizer

    def _state(self, document: str, chunk_tokens: int | None = None) -> _DocumentState:
        _check_text("document", document)
        chunk_tokens = chunk_tokens or self.config.chunk_tokens

        def build() -> _DocumentState:
            t0 = time.perf_counter()
            key = self._chunks_key(document, chunk_tokens)
            chunks = None if key is None else _stored_chunks(self._store.load(key, None, np.int64), document)
            if chunks is None:
                chunks = self._chunker(chunk_tokens).chunk(document)
                if key is not None:
                    self._store.save(key, np.array([[c.char_start, c.char_end, c.num_tokens] for c in chunks],
                                                   dtype=np.int64).reshape(-1, 3))
            logger.info("chunked %d chars into %d chunks in %.2f s", len(document), len(chunks), time.perf_counter() - t0)
            return _DocumentState(chunks)

        return self._cached(self._document_key(document, chunk_tokens), build)

    def _chunks_key(self, document: str, chunk_tokens: int) -> str | None:
        """The store's key of this document's chunks at ``chunk_tokens`` (None: no store, or a slow tokenizer)."""
        if self._store is None:
            return None
        copy = self._tokenizer_copy()
        if not isinstance(copy, PrivateTokenizer):
            return None
        if self._tokenizer_fingerprint is None:
            self._tokenizer_fingerprint = tokenizer_fingerprint(copy.tokenizer)
        overlap = min(self.config.overlap_tokens, chunk_tokens - 1)
        settings = f"{chunk_tokens}/{overlap}/{SECTION_CHARS}/semantic-text-splitter {splitter_version()}"
        return EmbeddingStore.chunks_key(self._tokenizer_fingerprint, settings, document)

    def _segment_state(self, segments: list[str], chunk_tokens: int) -> _DocumentState:
        """Chunks of each non-empty segment, with spans in ``"\\n\\n".join(segments)`` (cached)."""

        def build() -> _DocumentState:
            chunker = self._chunker(chunk_tokens)
            chunks: list[Chunk] = []
            offset = 0
            for segment, count in zip(segments, chunker.count_tokens(segments)):
                if segment.strip():
                    pieces = (
                        [Chunk(0, segment, 0, len(segment), count)] if count <= chunk_tokens else chunker.chunk(segment)
                    )
                    first = len(chunks)
                    chunks.extend(
                        Chunk(first + i, p.text, offset + p.char_start, offset + p.char_end, p.num_tokens)
                        for i, p in enumerate(pieces)
                    )
                offset += len(segment) + len(CHUNK_SEPARATOR)
            return _DocumentState(tuple(chunks), kind="conversation")

        joined = CHUNK_SEPARATOR.join(segments)
        return self._cached("segments:" + self._document_key(joined + "\0" + str([len(s) for s in segments]), chunk_tokens), build)

    def _cached(self, key: str, build: Callable[[], _DocumentState]) -> _DocumentState:
        """The state stored under ``key``, built on a miss (outside the lock: other documents do not wait);
        the least recently used beyond the bound are dropped."""
        with self._documents_lock:
            state = self._documents.get(key)
            if state is not None:
                self._documents.move_to_end(key)
                return state
        state = build()
        with self._documents_lock:
            state = self._documents.setdefault(key, state)
            self._documents.move_to_end(key)
            while len(self._documents) > self.config.max_cached_documents:
                self._documents.popitem(last=False)
        return state

    def _document_key(self, document: str, chunk_tokens: int) -> str:
        h = hashlib.sha256(f"{chunk_tokens}\0{self.config.overlap_tokens}\0".encode())
        h.update(document.encode("utf-8", "surrogatepass"))
        return h.hexdigest()

    def method_for(self, kind: str) -> str:
        """The method used on text of ``kind`` (``"document"`` or ``"conversation"``): ``auto`` resolved."""
        return AUTO_METHOD[kind] if self.config.method == "auto" else self.config.method

    def _scores(self, state: _DocumentState, query: str) -> np.ndarray:
        method = self.method_for(state.kind)
        if method == "bm25":
            return self._bm25(state).scores(query)
        if method == "dense":
            return self._dense(state).scores(query)
        if method == "random":
            return random_scores([c.text for c in state.chunks], query)
        bm25 = self._bm25(state).scores(query)
        dense = self._dense(state).scores(query)
        rankings = [rank_by_score(bm25, keep=bm25 > 0), rank_by_score(dense)]
        return reciprocal_rank_fusion(rankings, len(state.chunks), k=self.config.rrf_k)

    def _bm25(self, state: _DocumentState) -> BM25Index:
        if state.bm25 is None:
            state.bm25 = BM25Index([c.text for c in state.chunks])
        return state.bm25

    def _dense(self, state: _DocumentState) -> DenseIndex:
        model = self.config.embedding_model
        if model not in state.dense:
            state.dense[model] = DenseIndex(self.embedder, [c.text for c in state.chunks],
                                            batch_size=self.config.batch_size, store=self._store)
        return state.dense[model]


def random_scores(texts: Sequence[str], query: str) -> np.ndarray:
    """A uniform score in [0, 1) per chunk text, the same for the same chunks and query.  # [len(texts)]"""
    seed = hashlib.sha256("\0".join([query, *texts]).encode("utf-8", "surrogatepass")).digest()
    return np.random.default_rng(int.from_bytes(seed[:8], "little")).random(len(texts))


def _check_text(name: str, text: object) -> None:
    if not isinstance(text, str):
        raise RapidspecError(f"the {name} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise RapidspecError(f"the {name} is empty")


def _stored_chunks(spans: np.ndarray | None, document: str) -> tuple[Chunk, ...] | None:
    """Chunks of ``document`` from stored ``[chunks, 3]`` (start, end, tokens) rows; None unless they fit it."""
    if spans is None or spans.shape[1] != 3:
        return None
    rows = spans.tolist()
    previous_start = 0  # chunks may overlap (overlap_tokens), never go back
    for start, end, tokens in rows:
        if not previous_start <= start < end <= len(document) or tokens < 0:
            return None
        previous_start = start
    return tuple(Chunk(index=i, text=document[start:end], char_start=start, char_end=end, num_tokens=tokens)
                 for i, (start, end, tokens) in enumerate(rows))
