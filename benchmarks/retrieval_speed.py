"""Retrieval speed on a ~1M-token document (built-in SmolLM2 tokenizer).

Builds the document from Python's own documentation (``pydoc_data.topics``),
each copy varied (numbered headings, shuffled topic order) so chunks are not
byte-identical, then measures, medians over ``--repeats`` fresh retrievers:

* chunking (semantic-text-splitter, parallel sections) + token counts,
* BM25 indexing, and one BM25 query on the indexed document,
* dense embedding throughput (chunks/s) on a ``--dense-chunks`` subset.

    python benchmarks/retrieval_speed.py [--tokens 1000000] [--repeats 3] [--dense-chunks 64]

Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from rapidspec.retrieval import RetrievalConfig, Retriever, resolve_tokenizer
from rapidspec.retrieval.dense import DenseIndex, load_embedder


def build_document(tokenizer, target_tokens: int, seed: int = 0) -> str:
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    names = sorted(topics)
    parts: list[str] = []
    tokens = 0
    copy = 0
    while tokens < target_tokens:
        copy += 1
        rng.shuffle(names)
        for name in names:
            text = f"Part {copy}, topic {name}\n\n{topics[name].strip()}"
            parts.append(text)
            tokens += len(tokenizer.encode(text, add_special_tokens=False))
            if tokens >= target_tokens:
                break
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dense-chunks", type=int, default=64)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    args = parser.parse_args()

    tokenizer = resolve_tokenizer("builtin")
    document = build_document(tokenizer, args.tokens)
    question = "How does the with statement call __enter__ and __exit__?"
    config = RetrievalConfig(method="bm25", chunk_tokens=args.chunk_tokens, budget_tokens=2048)

    Retriever(config, tokenizer=tokenizer).retrieve(document[:200_000], question)  # warm-up
    chunk_s, index_s, first_s, query_s = [], [], [], []
    for _ in range(args.repeats):
        r = Retriever(config, tokenizer=tokenizer)
        t0 = time.perf_counter()
        chunks = r.chunks(document)
        t1 = time.perf_counter()
        r._bm25(r._state(document))  # build the index (normally done by the first retrieve)
        t2 = time.perf_counter()
        r.retrieve(document, question)
        t3 = time.perf_counter()
        r.retrieve(document, "What does the global statement do?")
        t4 = time.perf_counter()
        chunk_s.append(t1 - t0)
        index_s.append(t2 - t1)
        first_s.append(t3 - t0)
        query_s.append(t4 - t3)
    document_tokens = sum(c.num_tokens for c in chunks)

    embedder = load_embedder()
    subset = [c.text for c in chunks[: args.dense_chunks]]
    DenseIndex(embedder, subset[:8])  # warm-up
    dense_s = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        index = DenseIndex(embedder, subset)
        dense_s.append(time.perf_counter() - t0)
    med = statistics.median
    result = {
        "document_tokens": document_tokens,
        "document_chars": len(document),
        "num_chunks": len(chunks),
        "chunk_tokens": args.chunk_tokens,
        "chunking_s": round(med(chunk_s), 3),
        "bm25_index_s": round(med(index_s), 3),
        "bm25_first_retrieve_s": round(med(first_s), 3),
        "bm25_cached_query_s": round(med(query_s), 4),
        "dense_chunks": len(subset),
        "dense_windows": index.num_windows,
        "dense_chunks_per_s": round(len(subset) / med(dense_s), 2),
        "dense_projected_full_document_s": round(len(chunks) / (len(subset) / med(dense_s)), 1),
        "repeats": args.repeats,
    }
    rows = [
        ("document", f"{document_tokens:,} tokens, {len(document):,} chars, {len(chunks):,} chunks"),
        ("chunking + token counts", f"{result['chunking_s']:.2f} s"),
        ("BM25 index", f"{result['bm25_index_s']:.2f} s"),
        ("first BM25 retrieve (chunk+index+query)", f"{result['bm25_first_retrieve_s']:.2f} s"),
        ("cached BM25 query", f"{result['bm25_cached_query_s'] * 1000:.1f} ms"),
        ("dense embedding", f"{result['dense_chunks_per_s']:.1f} chunks/s ({len(subset)} chunks, {index.num_windows} windows)"),
        ("dense, whole document (projected)", f"{result['dense_projected_full_document_s']:.0f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"{'measure'.ljust(width)}  median of {args.repeats}")
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
