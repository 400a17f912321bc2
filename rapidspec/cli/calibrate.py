"""``rapidspec calibrate``: measure the machine's step costs on purpose, and show or forget what is kept.

    rapidspec calibrate [MODEL OPTIONS] [--contexts 1024,8192] [--json]
    rapidspec calibrate --show [--json]
    rapidspec calibrate --clear

The costs decide when the drafter joins and how many tokens a round drafts
(:mod:`rapidspec.drafting.calibration`). Measured on first use, they are kept
per machine; this command measures them again now, for the models the options
name: the drafter's step and prefill, the embedder's cost per token (dense or
hybrid retrieval) and, with ``--contexts``, the target's verification at those
context lengths. Each entry says when it was measured, the load average then
and the share of the CPUs other processes took meanwhile; a measurement beside
busy processes does not replace a quiet one (the listing says so).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.markup import escape

from rapidspec.cli.options import add_model_options, add_retrieval_options, decode_config, load_engine
from rapidspec.cli.prefill_bar import prefill_bar
from rapidspec.errors import RapidspecError

FIGURES = ("base", "per_token", "step", "prefill_per_token", "value")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure the step costs the drafter's join and gamma schedule read; show or forget them",
        description="Measure this machine's step costs for the models the options name (kept for every later "
                    "process), or show (--show) or forget (--clear) what is kept.",
    )
    parser.add_argument("--contexts", default="", metavar="N,N,...",
                        help="also the target's verification cost at these context lengths in tokens, e.g. "
                             "1024,8192 (each prefills that many filler tokens first; default: none)")
    parser.add_argument("--show", action="store_true", help="show this machine's kept costs; measure nothing")
    parser.add_argument("--clear", action="store_true", help="forget this machine's kept costs (measured again on "
                        "first use)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the listing")
    add_model_options(parser)
    add_retrieval_options(parser)
    parser.set_defaults(handler=run)


def contexts(text: str) -> list[int]:
    """``"1024,8192"`` -> [1024, 8192]; a RapidspecError for anything else."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = [0]
    if any(v < 2 for v in values):  # before any model loads (the upper bound is the target's window)
        raise RapidspecError(f"--contexts takes token counts of at least 2 separated by commas, e.g. 1024,8192; "
                             f"got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    from rapidspec.drafting.calibration import CostBook

    if args.show and args.clear:
        raise RapidspecError("--show and --clear do not go together")
    lengths = contexts(args.contexts)
    book = CostBook()
    if args.clear:
        removed = book.clear()
        Console().print(f"forgot {removed} kept step cost(s) of this machine in {book.file()}")
        return 0
    if args.show:
        entries = [{"key": key, **entry} for key, entry in book.stored().items()]
        return show(entries, [], book, args.json)
    config = decode_config(args)
    engine = load_engine(args)
    engine.costs = book
    entries = engine.calibrate(config, contexts=lengths, again=True, embedder=True, progress=prefill_bar(args.quiet))
    return show(entries, [{"key": key, **fresh} for key, fresh in book.not_kept.items()], book, args.json)


def show(entries: list[dict], not_kept: list[dict], book, as_json: bool) -> int:
    """One block per entry: its key, then its figures and the conditions of its measurement."""
    if as_json:
        print(json.dumps({"file": str(book.file()), "entries": entries, "not_kept": not_kept}))
        return 0
    console = Console(highlight=False)
    if not entries:
        console.print(f"{book.file()} holds no step costs of this machine")
        return 0
    console.print(f"step costs ({book.file()}), seconds:")
    for entry in entries:
        console.print(f"[bold]{escape(entry['key'])}[/]\n    {describe(entry)}")
    for fresh in not_kept:
        console.print(f"[yellow]not kept[/]: {escape(fresh['key'])}\n    {describe(fresh)}; the earlier quiet entry "
                      "stays")
    return 0


def describe(entry: dict) -> str:
    """``base 0.0623, per_token 0.0183; measured 2026-11-28T23:47:50+00:00, load 2.02, others took 39% of the CPUs
    (busy: measured again 10 minutes after it was measured or last checked)``."""
    from rapidspec.drafting.calibration import RECHECK_S

    figures = ", ".join(f"{name} {entry[name]:.3g}" for name in FIGURES if name in entry)
    others = entry.get("others")
    share = "others' share unknown" if others is None else f"others took {others:.0%} of the CPUs"
    checked = f", last checked {entry['checked_at']}" if entry.get("checked_at") else ""
    busy = f" (busy{checked}: measured again {RECHECK_S / 60:g} minutes after it was measured or last checked)" \
        if entry.get("busy") else ""
    return f"{figures}; measured {entry.get('measured_at', '?')}, load {entry.get('load', '?')}, {share}{busy}"
