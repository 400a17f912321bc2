"""A user's own documents: open questions about real texts, lc against rapid at the defaults, right or wrong and how fast.

    python benchmarks/own_documents.py --target builtin:smollm2-135m
    python benchmarks/own_documents.py --target builtin:qwen2.5-coder-0.5b

The documents are the license texts Debian ships in ``/usr/share/common-licenses``
(``--documents`` names another folder); the questions and their answers, as
regular expressions, are in ``benchmarks/data/license_questions.json``
(``--questions``). An answer is right when one of its expressions matches it
(case-insensitive).

Two engines over the same model options, one answering in lc and one in rapid,
each with the decoding defaults of ``rapidspec generate`` (``--max-new-tokens``
excepted). For each document both engines' caches are cleared, so its first
question prefills the whole document in each mode (lc first); its later
questions are follow-ups (the document's prefill reused), asked in lc and in
rapid in turn, the order alternating from one question to the next. Times are
wall-clock seconds around each call.

Prints one table (right answers and median times per mode), then one JSON object
as the last line with every answer; ``--out FILE`` writes the answers as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rapidspec.cli.options import add_model_options, add_retrieval_options, load_engine
from rapidspec.config import DecodeConfig
from rapidspec.errors import RapidspecError
from rapidspec.outputs import timed_output

QUESTIONS = Path(__file__).with_name("data") / "license_questions.json"
MODES = ("lc", "rapid")


def load_questions(path: Path, folder: Path) -> list[dict]:
    """The questions grouped by document, in file order, each with its document's text."""
    try:
        records = json.loads(path.read_text(encoding="utf-8"))["questions"]
    except (OSError, ValueError, KeyError) as err:
        raise RapidspecError(f"cannot read questions from {path}: {err}") from None
    texts = {}
    for record in records:
        name = record["document"]
        if name not in texts:
            try:
                texts[name] = (folder / name).read_text(encoding="utf-8")
            except OSError as err:
                raise RapidspecError(f"cannot read document {name!r} in {folder}: {err.strerror}") from None
    return [{**record, "text": texts[record["document"]]} for record in records]


def is_right(answer: str, expected: list[str]) -> bool:
    return any(re.search(pattern, answer.strip(), re.IGNORECASE) for pattern in expected)


def ask(engine, record: dict, config: DecodeConfig) -> dict:
    output, first, total = timed_output(engine.stream(record["text"], record["question"], config=config))
    stats = output.stats
    return {"mode": config.mode, "document": record["document"], "question": record["question"],
            "answer": output.text, "right": is_right(output.text, record["expected"]),
            "ttft": first, "total": total, "new_tokens": stats.new_tokens,
            "decode_tokens_per_second": stats.decode_tokens_per_second, "eta": stats.eta,
            "joined_at": stats.drafter_joined_at, "drafted": stats.drafted_tokens, "accepted": stats.accepted_tokens,
            "target_prefill_reused_tokens": stats.target_prefill_reused_tokens, "stop_reason": stats.stop_reason}


def run(engines: dict, records: list[dict], max_new_tokens: int, console: Console) -> list[dict]:
    configs = {mode: DecodeConfig(mode=mode, max_new_tokens=max_new_tokens) for mode in MODES}
    runs, previous = [], None
    for index, record in enumerate(records):
        case = "first" if record["document"] != previous else "follow-up"
        if case == "first":
            for engine in engines.values():
                engine.clear_document_cache()
        previous = record["document"]
        order = MODES if case == "first" or index % 2 == 0 else MODES[::-1]
        for mode in order:
            with console.status(f"{record['document']}: question {index + 1}/{len(records)}, {mode}"):
                runs.append({"case": case, **ask(engines[mode], record, configs[mode])})
    return runs


def summarize(runs: list[dict]) -> dict:
    out = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        follow = [r for r in mine if r["case"] == "follow-up"]
        first = [r for r in mine if r["case"] == "first"]
        out[mode] = {
            "right": sum(r["right"] for r in mine), "n": len(mine),
            "first_ttft": statistics.median(r["ttft"] for r in first) if first else None,
            "follow_total": statistics.median(r["total"] for r in follow) if follow else None,
            "follow_ttft": statistics.median(r["ttft"] for r in follow) if follow else None,
            "decode_tokens_per_second": statistics.median(r["decode_tokens_per_second"] or 0 for r in mine),
            "new_tokens": statistics.median(r["new_tokens"] for r in mine),
            "joined": sum(r["joined_at"] is not None for r in mine),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=Path, default=QUESTIONS, help="questions file (default: %(default)s)")
    parser.add_argument("--documents", type=Path, default=Path("/usr/share/common-licenses"),
                        help="folder of the documents the questions name (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="answer length limit (default: 64)")
    parser.add_argument("--out", type=Path, help="write every answer here as JSON lines")
    add_model_options(parser)
    add_retrieval_options(parser)
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    try:
        records = load_questions(args.questions, args.documents)
        with console.status("loading the models"):
            engines = {mode: load_engine(args) for mode in MODES}
            for engine in engines.values():
                engine.retriever.warm_up()
        runs = run(engines, records, args.max_new_tokens, console)
    except RapidspecError as err:
        print(f"own_documents: error: {err}", file=sys.stderr)
        return 2
    engine = engines["rapid"]
    summary = summarize(runs)
    table = Table(title=f"{engine.target.name}, drafter {engine.drafter_label}: {len(records)} questions, medians")
    for name in ("mode", "right", "first question TTFT s", "follow-up TTFT s", "follow-up total s", "decode tokens/s",
                 "new tokens", "drafter joined"):
        table.add_column(name, justify="right")
    for mode, row in summary.items():
        table.add_row(mode, f"{row['right']}/{row['n']}", f"{row['first_ttft']:.2f}", f"{row['follow_ttft']:.2f}",
                      f"{row['follow_total']:.2f}", f"{row['decode_tokens_per_second']:.2f}", f"{row['new_tokens']:g}",
                      f"{row['joined']}/{row['n']}")
    Console().print(table)
    if args.out:
        args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in runs), encoding="utf-8")
    print(json.dumps({"target": engine.target.name, "drafter": engine.drafter_label, "summary": summary,
                      "runs": runs}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
