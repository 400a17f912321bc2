"""``rapidspec demo``: lc vs rapid on the built-in model and the built-in long document."""

from __future__ import annotations

import argparse
import json

from rich.columns import Columns
from rich.console import Console
from rich.panel import Panel

from rapidspec.cli.options import (CHAT_FREQUENCY_PENALTY, add_decode_options, add_model_options, add_retrieval_options,
                                   decode_config, load_engine)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="compare plain long-context decoding with RAPID on a built-in document",
        description=(
            "Runs mode lc and mode rapid on a built-in document of about 7K tokens (Python's own "
            "reference documentation with one planted fact in the middle) and shows both answers, "
            "their statistics and the speedup, measured in this process."
        ),
    )
    parser.add_argument("--document-tokens", type=int, default=None, help="length of the demo document (default: about 7K)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    add_model_options(parser)
    add_decode_options(parser, modes=False)
    add_retrieval_options(parser)
    # The drafter: llama.cpp on the built-in GGUF where it is installed (the fastest measured on CPU,
    # docs/speed.md), else torch with int8 weights.
    parser.set_defaults(handler=run, max_new_tokens=48, frequency_penalty=CHAT_FREQUENCY_PENALTY)


def run(args: argparse.Namespace) -> int:
    from rapidspec.demo_document import demo_document

    rapid_config = decode_config(args, mode="rapid")
    lc_config = rapid_config.with_mode("lc")
    console = Console(stderr=True)
    with console.status("loading the models"):
        engine = load_engine(args)  # lc's prefill is stored in the prefix cache and rapid's starts from it
        engine.retriever.warm_up()  # loading the embedder is model loading, not a request's retrieval
    kwargs = {} if args.document_tokens is None else {"target_tokens": args.document_tokens}
    item = demo_document(tokenizer=engine.tokenizer, **kwargs)
    outputs = {}
    for config in (lc_config, rapid_config):
        with console.status(f"mode {config.mode}: prefill and decode"):
            outputs[config.mode] = engine.generate(item.document, item.question, config=config)
    lc, rapid = outputs["lc"].stats, outputs["rapid"].stats
    decode_speedup = (rapid.decode_tokens_per_second or 0) / (lc.decode_tokens_per_second or 1)
    # Both are credited with lc's one measured target prefill (rapid reused it from the prefix cache).
    rapid_total = rapid.total_seconds - rapid.target_prefill_seconds + lc.target_prefill_seconds
    end_to_end = lc.total_seconds / rapid_total if rapid_total else float("nan")
    if args.json:
        print(json.dumps({
            "question": item.question,
            "expected_answer": item.answer,
            "outputs": {mode: out.to_dict() for mode, out in outputs.items()},
            "decode_speedup": decode_speedup,
            "end_to_end_speedup": end_to_end,
        }, ensure_ascii=False))
        return 0
    from rapidspec.cli.render import stats_table

    out = Console()
    out.print(f"[bold]Document[/bold]: {rapid.prompt_tokens_target} prompt tokens ({item.source});"
              f" [dim]decode steps: {engine.target.runtime} forward[/dim]")
    out.print(f"[bold]Question[/bold]: {item.question}   [dim](expected: {item.answer})[/dim]")
    out.print(Columns([
        Panel(outputs["lc"].text.strip() or "(empty)", title="lc: target reads everything", width=60),
        Panel(outputs["rapid"].text.strip() or "(empty)", title=f"rapid: eta={rapid.eta:g}, gamma={rapid.gamma} ({rapid.gamma_schedule})",
              width=60),
    ]))
    out.print(stats_table([("lc", lc), ("rapid", rapid)]))
    out.print(f"[dim]drafter: {rapid.drafter or engine.drafter_label}; rapid's target prefill came from lc's (prefix cache), so both "
              f"count lc's {lc.target_prefill_seconds:.2f} s[/dim]")
    out.print(
        f"[bold]Speedup of rapid over lc[/bold] (same process, same input): "
        f"decode {decode_speedup:.2f}x, end to end {end_to_end:.2f}x"
    )
    out.print(f"[dim]{join_note(rapid)}[/dim]")
    return 0


def join_note(rapid) -> str:
    """One line on when rapid's drafter joined the answer (rapidspec.drafting.join), from its statistics."""
    if rapid.drafter_error:
        return f"rapid answered without its drafter: {rapid.drafter_error}"
    if rapid.drafter_joined_at is None:
        return (f"rapid's first token came from the target ({rapid.time_to_first_token:.2f} s) and its drafter never "
                f"joined: for a {rapid.new_tokens}-token answer retrieval and the drafter's prefill would have cost "
                f"more than they save, so it answered as lc does (--max-new-tokens or a longer answer changes that)")
    return (f"rapid's first token came from the target ({rapid.time_to_first_token:.2f} s); retrieval "
            f"({rapid.retrieval_seconds:.2f} s) and the drafter's prefill ({rapid.drafter_prefill_seconds:.2f} s) ran "
            f"between the next rounds and the drafter joined after {rapid.drafter_joined_at} tokens")
