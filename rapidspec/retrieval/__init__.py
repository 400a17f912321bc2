"""Retrieval for RAPID: build the drafter's short context C^S from a long document.

>>> from rapidspec.retrieval import Retriever, RetrievalConfig
>>> r = Retriever(RetrievalConfig(method="hybrid", budget_tokens=1024), tokenizer=tok)  # doctest: +SKIP
>>> result = r.retrieve(document, question)  # doctest: +SKIP

See :mod:`rapidspec.retrieval.retriever` for the contract and the score
definitions, :mod:`.chunking` for spans, :mod:`.selection` for the budget.
"""

import importlib

_EXPORTS = {
    "BUILTIN_EMBEDDER": "rapidspec.retrieval.config",
    "CHUNK_SEPARATOR": "rapidspec.retrieval.retriever",
    "METHODS": "rapidspec.retrieval.config",
    "Chunk": "rapidspec.retrieval.chunking",
    "Chunker": "rapidspec.retrieval.chunking",
    "RetrievalConfig": "rapidspec.retrieval.config",
    "RetrievalResult": "rapidspec.retrieval.retriever",
    "RetrievedChunk": "rapidspec.retrieval.retriever",
    "Retriever": "rapidspec.retrieval.retriever",
    "build_query": "rapidspec.retrieval.retriever",
    "default_budget": "rapidspec.retrieval.selection",
    "load_builtin_tokenizer": "rapidspec.retrieval.tokenizers",
    "resolve_tokenizer": "rapidspec.retrieval.tokenizers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):  # the retriever (torch, the embedder) loads on first use of its names
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rapidspec.retrieval' has no attribute {name!r}")
