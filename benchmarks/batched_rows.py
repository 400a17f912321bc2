"""What a batched forward saves: N requests' rows in one lean forward against the same rows one by one.

The server's batched steps (docs/scaling.md) run the running requests'
target forwards as one ``LeanModel.forward_rows``: the linear layers read the
weights once for all rows, and attention runs per row over that row's own
key/value cache. This script prefills one cache of ``--context`` tokens,
copies it for every row (as the prefix cache hands each request a copy of a
shared document), and times, for each row count in ``--rows`` and each new
token count in ``--tokens``, one batched forward against the same rows
forwarded one by one (medians of ``--repeats``, the two taking turns). What
batching cannot save is each row's attention over its own cache, which
grows with the context.

    python benchmarks/batched_rows.py --rows 1,2,4,8 --tokens 1,4 --context 7000

Token ids are random. Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from rapidspec.bench.inputs import positive_ints
from rapidspec.errors import RapidspecError
from rapidspec.models import load_model
from rapidspec.runtime import new_kv_cache
from rapidspec.runtime.lean import Row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="builtin")
    parser.add_argument("--context", type=int, default=7000, help="tokens in each row's cache (default: %(default)s)")
    parser.add_argument("--rows", type=positive_ints, default=[1, 2, 4, 8])
    parser.add_argument("--tokens", type=positive_ints, default=[1, 4], help="new tokens per row (1: a plain step)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    try:
        if args.context < 1 or args.repeats < 1:
            raise RapidspecError("--context and --repeats must be >= 1")
        loaded = load_model(args.target, dtype=args.dtype)
        if getattr(loaded, "lean", None) is None:
            raise RapidspecError(f"{args.target} has no lean forward: nothing is batched for it")
    except RapidspecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    generator = torch.Generator().manual_seed(0)
    vocab = len(loaded.tokenizer)
    room = args.context + max(args.tokens)
    results = []
    with torch.inference_mode():
        first = new_kv_cache(loaded)
        first.reserve(room)
        first.prefill(torch.randint(vocab, (args.context,), generator=generator).tolist())
        caches = [first] + [first.clone(room) for _ in range(max(args.rows) - 1)]
        lean = first.lean

        def rows(count: int, tokens: int) -> list[Row]:
            ids = torch.randint(vocab, (tokens,), generator=generator)
            return [Row(ids, c._keys, c._values, c.length, tokens) for c in caches[:count]]

        for tokens in args.tokens:
            for count in args.rows:
                batched, alone = [], []
                for _ in range(args.repeats + 1):  # the first of each is a warm-up
                    started = time.perf_counter()
                    lean.forward_rows(rows(count, tokens))
                    batched.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    for row in rows(count, tokens):
                        lean.forward_rows([row])
                    alone.append(time.perf_counter() - started)
                results.append({"tokens": tokens, "rows": count, "batched_ms": 1000 * statistics.median(batched[1:]),
                                "one_by_one_ms": 1000 * statistics.median(alone[1:])})
    table = Table(title=f"{args.target}: {args.context}-token caches, {torch.get_num_threads()} threads")
    for column in ("new tokens per row", "rows", "one batched forward (ms)", "rows one by one (ms)", "saved"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(str(r["tokens"]), str(r["rows"]), f"{r['batched_ms']:.1f}", f"{r['one_by_one_ms']:.1f}",
                      f"{1 - r['batched_ms'] / r['one_by_one_ms']:.0%}")
    Console().print(table)
    print(json.dumps({"target": args.target, "context": args.context, "threads": torch.get_num_threads(),
                      "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
