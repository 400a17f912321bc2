"""``rapidspec demo``: lc vs rapid on the default model and the built-in long document, a question and a follow-up."""

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
            "reference documentation with one planted fact in the middle): first the question about the "
            "planted fact (a short answer, with the expected one beside it), then a follow-up whose "
            "answer is long and copies the text, the kind of answer RAPID's drafter is for. Shows both "
            "answers to each, their statistics, the speedups measured in this process, and whether "
            "rapid's drafter joined and why."
        ),
    )
    parser.add_argument("--document-tokens", type=int, default=None, help="length of the demo document (default: about 7K)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    add_model_options(parser)
    add_decode_options(parser, modes=False)
    add_retrieval_options(parser)
    # The drafter: llama.cpp on the built-in GGUF where it is installed (the fastest measured on CPU,
    # docs/speed.md), else torch.
    parser.set_defaults(handler=run, max_new_tokens=128, frequency_penalty=CHAT_FREQUENCY_PENALTY)


def run(args: argparse.Namespace) -> int:
    from rapidspec.prompting.demo_document import FOLLOW_UP, demo_document

    rapid_config = decode_config(args, mode="rapid")
    lc_config = rapid_config.with_mode("lc")
    console = Console(stderr=True)
    with console.status("loading the models"):
        engine = load_engine(args)  # lc's prefill is stored in the prefix cache and rapid's starts from it
        engine.retriever.warm_up()  # loading the embedder is model loading, not a request's retrieval
    with console.status("measuring the drafter's step costs (once per machine)"):
        engine.calibrate(rapid_config)  # what rapid's first answer would otherwise spend (seconds on a new machine)
    kwargs = {} if args.document_tokens is None else {"target_tokens": args.document_tokens}
    item = demo_document(tokenizer=engine.tokenizer, **kwargs)
    asked = []
    for number, (question, expected) in enumerate(((item.question, item.answer), (FOLLOW_UP, None)), start=1):
        outputs = {}
        for config in (lc_config, rapid_config):
            with console.status(f"question {number} of 2, mode {config.mode}"):
                outputs[config.mode] = engine.generate(item.document, question, config=config)
            if config is lc_config and number == 1:  # the target's verification at this length, on lc's cache
                with console.status("measuring the target's verification at this length (once per machine)"):
                    engine.calibrate(rapid_config, contexts=[outputs["lc"].stats.prompt_tokens_target])
        asked.append({"question": question, "expected_answer": expected, "outputs": outputs,
                      **speedups(outputs["lc"].stats, outputs["rapid"].stats)})
    if args.json:
        print(json.dumps({"prompt_tokens": asked[0]["outputs"]["lc"].stats.prompt_tokens_target, "questions": [
            {**entry, "outputs": {mode: out.to_dict() for mode, out in entry["outputs"].items()}} for entry in asked
        ]}, ensure_ascii=False))
        return 0
    show(engine, item, asked)
    return 0


def speedups(lc, rapid) -> dict:
    """rapid over lc: decode tokens/s, and end to end with both credited with lc's measured target prefill (rapid
    reused it from the prefix cache)."""
    rapid_total = rapid.total_seconds - rapid.target_prefill_seconds + lc.target_prefill_seconds
    return {"decode_speedup": (rapid.decode_tokens_per_second or 0) / (lc.decode_tokens_per_second or 1),
            "end_to_end_speedup": lc.total_seconds / rapid_total if rapid_total else float("nan")}


def show(engine, item, asked: list[dict]) -> None:
    from rapidspec.cli.render import stats_table

    out = Console()
    first = asked[0]["outputs"]["lc"].stats
    out.print(f"[bold]Document[/bold]: {first.prompt_tokens_target} prompt tokens ({item.source});"
              f" [dim]model {engine.target.name}, decode steps: {engine.target.runtime} forward[/dim]")
    for number, entry in enumerate(asked, start=1):
        lc, rapid = entry["outputs"]["lc"], entry["outputs"]["rapid"]
        expected = f"   [dim](expected: {entry['expected_answer']})[/dim]" if entry["expected_answer"] else ""
        kind = "" if number == 1 else " [dim](a follow-up: the document's prefill is reused)[/dim]"
        out.print(f"\n[bold]Question {number}[/bold]{kind}: {entry['question']}{expected}")
        out.print(Columns([
            Panel(lc.text.strip() or "(empty)", title="lc: target reads everything", width=60),
            Panel(rapid.text.strip() or "(empty)",
                  title=f"rapid: eta={rapid.stats.eta:g}, gamma={rapid.stats.gamma} ({rapid.stats.gamma_schedule})",
                  width=60),
        ]))
    columns = [(f"{mode} {number}", entry["outputs"][mode].stats) for number, entry in enumerate(asked, start=1)
               for mode in ("lc", "rapid")]
    out.print(stats_table(columns))
    drafter = next((e["outputs"]["rapid"].stats.drafter for e in asked if e["outputs"]["rapid"].stats.drafter), "")
    out.print(f"[dim]drafter: {drafter or engine.drafter_label}; rapid's target prefill came from lc's (prefix "
              f"cache), so both count lc's[/dim]")
    for number, entry in enumerate(asked, start=1):
        out.print(f"[bold]Question {number}, rapid over lc[/bold] (same process, same input): decode "
                  f"{entry['decode_speedup']:.2f}x, end to end {entry['end_to_end_speedup']:.2f}x. "
                  f"[dim]{join_note(entry['outputs']['rapid'].stats)}[/dim]")


def join_note(rapid) -> str:
    """One line on when rapid's drafter joined the answer (rapidspec.drafting.join), from its statistics."""
    if rapid.drafter_error:
        return f"rapid answered without its drafter: {rapid.drafter_error}"
    lookup = (f"rounds drafted by prompt lookup over the target's text, {rapid.lookup_accepted_tokens} of "
              f"{rapid.lookup_drafted_tokens} drafts kept (each token the target's)")
    if rapid.drafter_joined_at is None:
        return (f"rapid's first token came from the target ({rapid.time_to_first_token:.2f} s) and its drafter never "
                f"joined: by this machine's measured step costs, retrieval and the drafter's prefill would not have "
                f"paid for themselves within this {rapid.new_tokens}-token answer"
                + (f"; its {lookup}" if rapid.lookup_drafted_tokens else ", so it answered as lc does"))
    return (f"rapid's first token came from the target ({rapid.time_to_first_token:.2f} s); retrieval "
            f"({rapid.retrieval_seconds:.2f} s) and the drafter's prefill ({rapid.drafter_prefill_seconds:.2f} s) ran "
            f"between the next rounds and the drafter joined after {rapid.drafter_joined_at} tokens"
            + (f"; before it, {lookup}" if rapid.lookup_drafted_tokens else ""))
