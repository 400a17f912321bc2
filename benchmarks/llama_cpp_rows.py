"""What one llama.cpp decode of several requests' draft steps costs: N sequences in one ``llama_batch``.

The server's batched steps (docs/scaling.md) batch the target's forwards but
let each request's llama.cpp drafter step in a context of its own, on one
thread. The alternative is every running request as a sequence of one shared
context (one sequence id each, ``kv_unified`` off) and each drafting step
one ``llama_decode`` of a batch holding one token per request. This script
times, for a GGUF file and each row count in ``--rows`` and thread count in
``--threads``:

* ``own contexts``: N contexts each decoding one token, one after another
  (what the server does now, on one thread per step; spread over the cores);
* ``one batch``: the N sequences of a shared context decoding one token each
  in one ``llama_decode``;
* ``one sequence``: one context decoding N tokens of one sequence at once (a
  prefill of N tokens: the same matrix shapes without several sequences).

Each sequence first holds ``--context`` tokens (the retrieved text a drafter
reads). Medians of ``--repeats`` decodes, each cropped back afterwards.

    python benchmarks/llama_cpp_rows.py --target builtin --rows 1,2,4,8 --threads 1,2

``--target`` names a model whose GGUF file drafts for it (``builtin``, a
``builtin:`` name, or a .gguf path); ``--copy auto`` reads the copy the
drafter reads by default (rapidspec.runtime.gguf_copy), ``as-is`` the file.
Token ids are random. Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rapidspec.bench.inputs import positive_ints
from rapidspec.errors import RapidspecError
from rapidspec.models.backend import gguf_file
from rapidspec.runtime.gguf_copy import copy_type, fast_prefill_copy
from rapidspec.runtime.llama_cpp import LlamaCppModel, llama_cpp_available


class SharedSequences:
    """``count`` sequences of one llama.cpp context, each holding ``context`` random tokens."""

    def __init__(self, model: LlamaCppModel, count: int, context: int, rng: random.Random) -> None:
        ll = self._ll = model._ll
        params = ll.llama_context_default_params()
        per_sequence = -(-(context + 64) // 256) * 256
        params.n_ctx, params.n_seq_max, params.kv_unified = count * per_sequence, count, False
        params.n_batch = params.n_ubatch = max(512, count)
        params.n_threads = params.n_threads_batch = model.threads
        params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        self._ctx = ll.llama_init_from_model(model._model, params)
        if not self._ctx:
            raise RapidspecError(f"llama.cpp could not make a context of {count} sequences")
        self._memory = ll.llama_get_memory(self._ctx)
        self._batch = ll.llama_batch_init(max(512, count), 0, 1)
        self.count, self.context, self.vocab = count, context, model.vocab_size
        for seq in range(count):
            for start in range(0, context, 512):
                tokens = [rng.randrange(self.vocab) for _ in range(min(512, context - start))]
                self.decode([(seq, start + i, t) for i, t in enumerate(tokens)])

    def decode(self, cells: list[tuple[int, int, int]]) -> None:
        """One ``llama_decode`` of (sequence, position, token) cells; logits for the last cell of each sequence."""
        batch, last = self._batch, {seq: n for n, (seq, _, _) in enumerate(cells)}
        for n, (seq, pos, token) in enumerate(cells):
            batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
            batch.seq_id[n][0] = seq
            batch.logits[n] = last[seq] == n
        batch.n_tokens = len(cells)
        if self._ll.llama_decode(self._ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def step(self, rng: random.Random) -> float:
        """Seconds of one decode of a token for every sequence (then cropped back)."""
        cells = [(seq, self.context, rng.randrange(self.vocab)) for seq in range(self.count)]
        started = time.perf_counter()
        self.decode(cells)
        seconds = time.perf_counter() - started
        for seq in range(self.count):
            self._ll.llama_memory_seq_rm(self._memory, seq, self.context, -1)
        return seconds

    def close(self) -> None:
        self._ll.llama_batch_free(self._batch)
        self._ll.llama_free(self._ctx)


def own_contexts(model: LlamaCppModel, count: int, context: int, repeats: int, rng: random.Random) -> float:
    """Median seconds of ``count`` contexts each decoding one token in turn."""
    contexts = [model.new_context(context + 64) for _ in range(count)]
    for c in contexts:
        c.prefill([rng.randrange(model.vocab_size) for _ in range(context)])
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        started = time.perf_counter()
        for c in contexts:
            c.forward([rng.randrange(model.vocab_size)])
        times.append(time.perf_counter() - started)
        for c in contexts:
            c.crop(context)
    return statistics.median(times[1:])


def one_sequence(model: LlamaCppModel, tokens: int, context: int, repeats: int, rng: random.Random) -> float:
    """Median seconds of one context decoding ``tokens`` tokens at once."""
    c = model.new_context(context + tokens + 64)
    c.prefill([rng.randrange(model.vocab_size) for _ in range(context)])
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        c.forward([rng.randrange(model.vocab_size) for _ in range(tokens)])
        times.append(time.perf_counter() - started)
        c.crop(context)
    return statistics.median(times[1:])


def one_batch(model: LlamaCppModel, count: int, context: int, repeats: int, rng: random.Random) -> float:
    shared = SharedSequences(model, count, context, rng)
    try:
        return statistics.median([shared.step(rng) for _ in range(repeats + 1)][1:])
    finally:
        shared.close()


def resolve_gguf(target: str, copy: str, threads: int) -> Path:
    path = Path(target) if target.lower().endswith(".gguf") else gguf_file(target)
    if path is None or not path.is_file():
        raise RapidspecError(f"{target} has no GGUF file to draft with")
    if copy == "auto":
        kind = copy_type(LlamaCppModel(path, threads=threads).description)
        if kind is not None:
            path = fast_prefill_copy(path, kind, threads)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="builtin", help="a model whose GGUF drafts for it, or a .gguf path")
    parser.add_argument("--copy", choices=("auto", "as-is"), default="auto")
    parser.add_argument("--context", type=int, default=430, help="tokens each sequence holds (default: %(default)s)")
    parser.add_argument("--rows", type=positive_ints, default=[1, 2, 4, 8])
    parser.add_argument("--threads", type=positive_ints, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    try:
        if args.context < 1 or args.repeats < 1:
            raise RapidspecError("--context and --repeats must be >= 1")
        if not llama_cpp_available():
            raise RapidspecError("llama-cpp-python is not installed (pip install 'rapidspec[llama]')")
        path = resolve_gguf(args.target, args.copy, max(args.threads))
    except (RapidspecError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rng = random.Random(0)
    results = []
    for threads in args.threads:
        model = LlamaCppModel(path, threads=threads)
        for rows in args.rows:
            results.append({
                "threads": threads, "rows": rows,
                "own_contexts_ms": 1000 * own_contexts(model, rows, args.context, args.repeats, rng),
                "one_batch_ms": 1000 * one_batch(model, rows, args.context, args.repeats, rng),
                "one_sequence_ms": 1000 * one_sequence(model, rows, args.context, args.repeats, rng),
            })
    table = Table(title=f"{path.name}: one token for each of N sequences holding {args.context} tokens")
    for column in ("threads", "N", "own contexts, in turn (ms)", "one llama_batch (ms)", "one sequence, N tokens (ms)"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(str(r["threads"]), str(r["rows"]), f"{r['own_contexts_ms']:.2f}", f"{r['one_batch_ms']:.2f}",
                      f"{r['one_sequence_ms']:.2f}")
    Console().print(table)
    print(json.dumps({"gguf": path.name, "context": args.context, "repeats": args.repeats, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
