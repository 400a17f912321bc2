"""``rapidspec bench``: decode speed of every mode against context length, speedups vs ``lc``.

Prints a table per run (and a profile table with ``--profile``) on stdout, then
one JSON object as the last stdout line; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rapidspec.cli.options import add_decode_options, add_model_options, add_retrieval_options, decode_config, load_engine
from rapidspec.cli.prefill_bar import prefill_bar
from rapidspec.errors import RapidspecError
from rapidspec.bench import speed
from rapidspec.bench.tables import profile_table, results_table

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure decode speed of each mode against context length ('bench serve': a server under load)",
        description=(
            "Runs every mode on the same inputs (the demo document at each --lengths, or --data records) "
            "and reports prefill times, decode tokens/s, acceptance, and decode and end-to-end speedups "
            "against lc measured in the same run; greedy outputs are compared with lc token for token. "
            "hf-assisted is transformers' own assisted generation with the same drafter on the full prompt; "
            "llama.cpp is plain greedy decoding of the target's GGUF file on llama.cpp (the CPU peer); "
            "lookup drafts by n-gram match over the retrieved text and the answer (no drafter model)."
        ),
        epilog=(
            "rapidspec bench serve [options]: an online serving benchmark of rapidspec serve (or any "
            "OpenAI-compatible server), as vllm bench serve: TTFT, TPOT, ITL, latency and throughput under a "
            "request rate and concurrency; see rapidspec bench serve --help."
        ),
    )
    parser.add_argument("--lengths", default=None,
                        help="target prompt lengths in tokens, comma-separated (default: 1024,2048,4096,8192 up to the window)")
    parser.add_argument("--modes", default=",".join(speed.DEFAULT_MODES),
                        help=f"comma-separated, from {','.join(speed.BENCH_MODES)} (default: %(default)s; lc is always run)")
    parser.add_argument("--data", default=None, help="JSON list or JSONL of {document, question} records instead of the demo document")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode and input; medians are reported (default: 3)")
    parser.add_argument("--sweep", default=None, help="run rapid at each value: eta=0,1,2,5,10, gamma=2,4,6,8 or draft_confidence=0,0.2,0.4 (replaces --modes)")
    parser.add_argument("--share-prefill", action="store_true",
                        help="prefill the target once per input and let every run start from a copy "
                             "(each run is credited with that one measured prefill); makes repeats on long inputs cheap")
    parser.add_argument("--profile", action="store_true", help="split decode time into draft, verify, accept and bookkeeping")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="write a figure of throughput and speedup against length")
    add_model_options(parser)
    add_decode_options(parser, modes=False)
    add_retrieval_options(parser)
    # 256-token chunks: the default 512 exceeds the default budget (doc/16, at least 256) below ~8K tokens.
    # Fixed answer lengths (as vLLM's benchmarks): decode speed is measured over max_new_tokens, not a short answer.
    parser.set_defaults(handler=run, max_new_tokens=64, chunk_tokens=256, ignore_eos=True)


def run(args: argparse.Namespace) -> int:
    # Validate everything that does not need the model before loading it.
    base = decode_config(args, mode="rapid")
    modes = speed.parse_modes(args.modes)
    sweep = speed.parse_sweep(args.sweep) if args.sweep else None
    if args.repeats < 1:
        raise RapidspecError(f"--repeats must be >= 1, got {args.repeats}")
    peers = [m for m in modes if m in (speed.HF_ASSISTED, speed.LLAMA_CPP)]
    if peers and base.with_(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0) != base:
        raise RapidspecError(f"the penalties apply to rapidspec's modes only; {', '.join(peers)} would run without them "
                             "(give --modes without them)")
    lengths = speed.parse_lengths(args.lengths, max_context=1 << 30) if args.lengths else None
    if args.data and args.lengths:
        raise RapidspecError("--lengths applies to the demo document; --data records are used as they are")
    items = speed.load_items(args.data) if args.data else None

    err = Console(stderr=True)
    with err.status("loading the model"):
        engine = load_engine(args, reuse_document_cache=args.share_prefill)
    window = engine.target.max_context
    if items is None:
        if lengths is None:
            lengths = tuple(n for n in DEFAULT_LENGTHS if n <= window) or (window,)
        lengths = speed.parse_lengths(lengths, window)
        items = speed.demo_items(engine.tokenizer, lengths, window, base.max_new_tokens)

    columns = speed.variants(modes, base, sweep)
    total = speed.count_generations(len(items), len(columns), args.repeats)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task("bench", total=total)
        first = [True]

        def note(message: str) -> None:
            if not first[0]:
                progress.advance(task)
            first[0] = False
            progress.update(task, description=message)

        report = speed.run_benchmark(
            engine, items, modes, base, args.repeats, sweep, args.profile, progress=note, share_prefill=args.share_prefill,
            prefill_progress=prefill_bar(args.quiet, progress),
        )
        progress.advance(task)

    out = Console(width=None if Console().is_terminal else 160)  # do not squeeze the table when piped
    out.print(results_table(report))
    if args.profile:
        out.print(profile_table(report))
    if args.plot:
        from rapidspec.bench.plot import plot_report

        err.print(f"figure written to {plot_report(report, args.plot)}")
    print(json.dumps(report.to_dict(), ensure_ascii=False))
    return 0
