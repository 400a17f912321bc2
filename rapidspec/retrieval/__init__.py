"""Retrieval for RAPID: build the drafter's short context C^S from a long document.

>>> from rapidspec.retrieval import Retriever, RetrievalConfig
>>> r = Retriever(RetrievalConfig(method="hybrid", budget_tokens=1024), tokenizer=tok)  # doctest: +SKIP
>>> result = r.retrieve(document, question)  # doctest: +SKIP

See :mod:`rapidspec.retrieval.retriever` for the contract and the score
definitions, :mod:`.chunking` for spans, :mod:`.selection` for the budget.
"""

from rapidspec.retrieval.chunking import Chunk, Chunker
from rapidspec.retrieval.config import BUILTIN_EMBEDDER, METHODS, RetrievalConfig
from rapidspec.retrieval.retriever import (
    CHUNK_SEPARATOR,
    RetrievalResult,
    RetrievedChunk,
    Retriever,
    build_query,
)
from rapidspec.retrieval.selection import default_budget
from rapidspec.retrieval.tokenizers import load_builtin_tokenizer, resolve_tokenizer

__all__ = [
    "BUILTIN_EMBEDDER",
    "CHUNK_SEPARATOR",
    "METHODS",
    "Chunk",
    "Chunker",
    "RetrievalConfig",
    "RetrievalResult",
    "RetrievedChunk",
    "Retriever",
    "build_query",
    "default_budget",
    "load_builtin_tokenizer",
    "resolve_tokenizer",
]
