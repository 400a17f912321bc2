"""Time to first token and end to end, lc against rapid, on a first question and on follow-up questions.

    python benchmarks/first_token.py --target builtin --max-new-tokens 8,128 --ignore-eos
    python benchmarks/first_token.py --target builtin:qwen2.5-coder-0.5b --max-new-tokens 8,128 --ignore-eos

Two engines over the same models, one answering in lc and one in rapid,
answer the built-in questions about the demo document (those of ``rapidspec
bench serve``), as a chat with the document, through the Python API (two, so
that neither finds the other's answer to the same question in its prefix cache):

* first question: each engine's caches are cleared first, so both prefill the
  whole document (lc first, then rapid; the first question of a model on a
  machine also measures its step costs once: rapidspec.drafting.calibration);
* follow-up questions: each engine has read the document (an untimed lc
  answer to the first question), then each question is asked in lc and in
  rapid, in turn, the order alternating from one question to the next; rapid
  keeps its drafter caches across questions, as a server does.

Times are wall-clock seconds around each call; TTFT is the engine's
``time_to_first_token`` plus the time before the generation started (the
prompt's tokenization). Prints a table of medians per answer length, then one
JSON object as the last line (every measurement in it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from rich.console import Console
from rich.table import Table

from rapidspec.bench.inputs import positive_ints
from rapidspec.bench.serve.dataset import builtin_requests
from rapidspec.cli.options import add_model_options, add_retrieval_options, load_engine
from rapidspec.config import DecodeConfig
from rapidspec.errors import RapidspecError
from rapidspec.outputs import timed_output


def ask(engine, request, config: DecodeConfig) -> dict:
    output, first, total = timed_output(
        engine.stream_chat(list(request.messages), documents=list(request.documents), config=config))
    stats = output.stats
    return {"mode": config.mode, "ttft": first, "total": total, "new_tokens": stats.new_tokens,
            "joined_at": stats.drafter_joined_at, "drafted": stats.drafted_tokens, "accepted": stats.accepted_tokens,
            "retrieval_s": stats.retrieval_seconds, "drafter_prefill_s": stats.drafter_prefill_seconds,
            "reused_drafter_tokens": stats.drafter_prefill_reused_tokens, "text": output.text[:60]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=positive_ints, default=[8, 128], help="answer lengths (comma list)")
    parser.add_argument("--ignore-eos", action="store_true", help="answers of exactly --max-new-tokens tokens")
    parser.add_argument("--questions", type=int, default=8,
                        help="built-in questions used (the first opens, the others follow up; at most 8)")
    add_model_options(parser)
    add_retrieval_options(parser)
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    try:
        with console.status("loading the models"):
            engines = {mode: load_engine(args) for mode in ("lc", "rapid")}
            for engine in engines.values():
                engine.retriever.warm_up()
        requests = builtin_requests()[: args.questions]
        runs = []
        for length in args.max_new_tokens:
            configs = {mode: DecodeConfig(mode=mode, max_new_tokens=length, ignore_eos=args.ignore_eos)
                       for mode in ("lc", "rapid")}
            for mode in ("lc", "rapid"):  # a first question: everything from scratch
                engines[mode].clear_document_cache()
                with console.status(f"{length} tokens: first question, {mode}"):
                    runs.append({"length": length, "case": "first", "question": 0,
                                 **ask(engines[mode], requests[0], configs[mode])})
            for engine in engines.values():  # the document read, the first question answered (lc, untimed)
                ask(engine, requests[0], configs["lc"])
            for index, request in enumerate(requests[1:], start=1):
                for mode in (("lc", "rapid") if index % 2 == 0 else ("rapid", "lc")):
                    with console.status(f"{length} tokens: follow-up {index}/{len(requests) - 1}, {mode}"):
                        runs.append({"length": length, "case": "follow-up", "question": index,
                                     **ask(engines[mode], request, configs[mode])})
    except RapidspecError as err:
        print(f"first_token: error: {err}", file=sys.stderr)
        return 2
    engine = engines["rapid"]
    table = Table(title=f"{engine.target.name}: medians (first question: one run each)")
    for name in ("tokens", "case", "lc TTFT s", "rapid TTFT s", "rapid - lc TTFT ms", "lc total s", "rapid total s",
                 "lc / rapid total", "rapid joined (of answers)"):
        table.add_column(name, justify="right")
    summary = []
    for length in args.max_new_tokens:
        for case in ("first", "follow-up"):
            rows = {m: [r for r in runs if r["length"] == length and r["case"] == case and r["mode"] == m]
                    for m in ("lc", "rapid")}
            med = {m: {k: statistics.median(r[k] for r in rows[m]) for k in ("ttft", "total")} for m in rows}
            joined = sum(r["joined_at"] is not None for r in rows["rapid"])
            row = {"length": length, "case": case, "n": len(rows["rapid"]), "lc_ttft": med["lc"]["ttft"],
                   "rapid_ttft": med["rapid"]["ttft"], "lc_total": med["lc"]["total"],
                   "rapid_total": med["rapid"]["total"], "end_to_end": med["lc"]["total"] / med["rapid"]["total"],
                   "rapid_joined": joined}
            summary.append(row)
            table.add_row(str(length), case, f"{row['lc_ttft']:.3f}", f"{row['rapid_ttft']:.3f}",
                          f"{1e3 * (row['rapid_ttft'] - row['lc_ttft']):+.0f}", f"{row['lc_total']:.2f}",
                          f"{row['rapid_total']:.2f}", f"{row['end_to_end']:.2f}x", f"{joined}/{row['n']}")
    Console().print(table)
    print(json.dumps({"target": engine.target.name, "drafter": engine.drafter_label, "summary": summary,
                      "runs": runs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
