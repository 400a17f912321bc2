"""``rapidspec generate``: answer a question about a long document, streaming the answer."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from rapidspec.cli.options import (add_decode_options, add_kv_cache_options, add_model_options, add_retrieval_options,
                                   decode_config, load_engine)
from rapidspec.cli.prefill_bar import prefill_bar
from rapidspec.cli.render import stats_table
from rapidspec.errors import RapidspecError
from rapidspec.prompting.textio import read_text


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="answer a question about a long document",
        description="Stream the answer to stdout, then the statistics (a table on stderr, or JSON with --json).",
    )
    parser.add_argument("--document", required=True, help="document file (UTF-8), or - for stdin")
    parser.add_argument("--question", required=True, help="the question")
    parser.add_argument("--query", default=None, help="retrieval query (default: the question)")
    parser.add_argument("--retrieve-from", default=None, metavar="FILE",
                        help="retrieve the drafter's chunks from this file instead of the document (an unrelated "
                             "text, for robustness studies; the target still reads the document)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (answer, stats, retrieval) instead")
    add_kv_cache_options(parser)
    add_model_options(parser)
    add_decode_options(parser)
    add_retrieval_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    config = decode_config(args)  # validate options before loading any model
    document = read_text(args.document)
    if not document.strip():
        raise RapidspecError(f"the document {args.document} is empty")
    if not args.question.strip():
        raise RapidspecError("the question is empty")
    corpus = None
    if args.retrieve_from is not None:
        corpus = read_text(args.retrieve_from)
        if not corpus.strip():
            raise RapidspecError(f"the retrieval corpus {args.retrieve_from} is empty")
    engine = load_engine(args)
    output = None
    for chunk in engine.stream(document, args.question, query=args.query, corpus=corpus, config=config,
                               prefill_progress=prefill_bar(args.quiet)):
        if chunk.output is not None:
            output = chunk.output
        elif not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    assert output is not None
    if args.json:  # with the step costs the generation's choices read (rapidspec calibrate)
        print(json.dumps({**output.to_dict(), "calibration": engine.costs.entries()}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        Console(stderr=True).print(stats_table([(config.mode, output.stats)]))
    return 0
