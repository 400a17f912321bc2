"""``rapidspec retrieve``: show which chunks of a document the drafter would read.

    rapidspec retrieve --document book.txt --question "Who is Ishmael?" --method hybrid --budget-tokens 1024
    cat book.txt | rapidspec retrieve --document - --question "..." --json

Prints the selected chunks (rank, score, character span, tokens, a preview) as
a table, or with ``--json`` one JSON object: ``RetrievalResult.to_dict()``
plus the question and the settings.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rapidspec.prompting.textio import read_text
from rapidspec.retrieval.config import BUILTIN_EMBEDDER, EMBEDDING_DTYPES, METHODS, RetrievalConfig
from rapidspec.retrieval.retriever import RetrievalResult, Retriever
from rapidspec.retrieval.tokenizers import BUILTIN, resolve_tokenizer

PREVIEW_CHARS = 120


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "retrieve",
        help="retrieve the drafter's short context from a long document",
        description="Chunk a document, score the chunks for a question and print the ones kept within the token budget.",
    )
    p.add_argument("--document", required=True, metavar="FILE", help="UTF-8 text file, or - for standard input")
    p.add_argument("--question", required=True, help="the question (append multiple-choice options if any)")
    p.add_argument("--method", choices=METHODS, default="auto",
                   help="retriever (default: auto, which is hybrid, RRF of bm25 and dense, on a document)")
    p.add_argument("--budget-tokens", type=int, default=None, metavar="N",
                   help="token budget (default: clamp(document_tokens // 16, 256, 4096))")
    p.add_argument("--chunk-tokens", type=int, default=512, metavar="N", help="tokens per chunk (default: 512)")
    p.add_argument("--overlap-tokens", type=int, default=0, metavar="N", help="tokens shared by neighbouring chunks (default: 0)")
    p.add_argument("--min-score", type=float, default=None, metavar="X", help="drop chunks scoring below X (method's own score)")
    p.add_argument("--embedding-model", default=BUILTIN_EMBEDDER, metavar="NAME",
                   help="sentence-transformers model name or path, available offline (default: builtin all-MiniLM-L6-v2)")
    p.add_argument("--embedding-dtype", default="auto", choices=EMBEDDING_DTYPES,
                   help="the embedder's dtype (default: auto, bfloat16 where the device computes in it natively)")
    p.add_argument("--tokenizer", default=BUILTIN, metavar="MODEL",
                   help="tokenizer counting tokens: builtin (SmolLM2) or a local/cached HF model (default: builtin)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # Validate cheap things first, so that mistakes fail before any model loads.
    config = RetrievalConfig(
        method=args.method,
        chunk_tokens=args.chunk_tokens,
        overlap_tokens=args.overlap_tokens,
        budget_tokens=args.budget_tokens,
        min_score=args.min_score,
        embedding_model=args.embedding_model,
        embedding_dtype=args.embedding_dtype,
    )
    document = read_text(args.document)
    retriever = Retriever(config, tokenizer=resolve_tokenizer(args.tokenizer))
    result = retriever.retrieve(document, args.question)
    if args.json:
        out = {"question": args.question, "document": args.document, "tokenizer": args.tokenizer,
               "chunk_tokens": config.chunk_tokens, "overlap_tokens": config.overlap_tokens,
               "min_score": config.min_score, "embedding_model": config.embedding_model, **result.to_dict()}
        sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
    else:
        _print_table(result, args.question)
    return 0


def _print_table(result: RetrievalResult, question: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{result.method}: {len(result.chunks)} of {result.num_document_chunks} chunks, "
        f"{result.num_tokens}/{result.budget_tokens} tokens, {result.seconds:.2f} s",
        caption=f"question: {question}",
    )
    table.add_column("rank", justify="right")
    table.add_column("score", justify="right")
    table.add_column("span (chars)", justify="right")
    table.add_column("tokens", justify="right")
    table.add_column("text")
    for c in result.chunks:
        preview = " ".join(c.text.split())
        if len(preview) > PREVIEW_CHARS:
            preview = preview[: PREVIEW_CHARS - 1] + "…"
        table.add_row(str(c.rank), f"{c.score:.4f}", f"{c.char_start}-{c.char_end}", str(c.num_tokens), preview)
    Console(file=sys.stdout).print(table)
