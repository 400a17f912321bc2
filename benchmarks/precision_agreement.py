"""Did the target's answers change with its weights' precision? Greedy lc answers per ``--quantize`` against the float copy.

    python -m benchmarks.precision_agreement --quantize none,gguf,int8 --dtype float32
    python -m benchmarks.precision_agreement --data leval_tpo.jsonl --limit 32 --quantize none,gguf

The first ``--quantize`` value is the reference (``none``: transformers' float
copy of the file's weights). Each value loads the target once and answers
every question greedily in ``lc`` mode (the engine's own prompts, EOS ends an
answer, at most ``--max-new-tokens``); a document's later questions reuse its
prefill. Reported per value: answers identical token for token to the
reference's, where the first difference falls, and, where questions carry
expected answers, how many are right with a 95% Wilson interval.

Questions: the license texts Debian ships with
``benchmarks/data/license_questions.json`` (regular expressions: right when
one matches), or ``--data`` JSON lines ``{"document", "question", "answer"}``
in any format ``rapidspec eval`` reads (right when the item's headline
score, :func:`rapidspec.evaluation.metrics.score_prediction`, is full: the
choice, every needle). Prints a table, then
one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.own_documents import QUESTIONS, is_right, load_questions
from rapidspec import EngineSpec, Rapid, load_model
from rapidspec.errors import RapidspecError
from rapidspec.config import TARGET_QUANTIZATIONS


def wilson(right: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion ``right / total``."""
    if total == 0:
        return (0.0, 1.0)
    p = right / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return (max(0.0, centre - half), min(1.0, centre + half))


def load_records(args) -> list[dict]:
    """Questions with ``document``, ``question``, ``template`` (None: the engine's) and ``check(answer) -> bool``."""
    if args.data is None:
        records = load_questions(args.questions, args.documents)
        return [{"document": r["text"], "question": r["question"], "template": None,
                 "check": (lambda answer, expected=r["expected"]: is_right(answer, expected))} for r in records]
    from rapidspec.evaluation.datasets import load_items
    from rapidspec.evaluation.metrics import score_prediction

    def check(answer: str, item) -> bool:  # right: the item's headline score is full (a choice, every needle, F1 1)
        return score_prediction(item.task_type, answer, item.answers, len(item.choices), choices=item.choices,
                                scorer=item.scorer, category=item.meta.get("category"))["score"] >= 1.0

    return [{"document": item.document, "question": item.question, "template": item.template,
             "check": (lambda answer, item=item: check(answer, item))} for item in load_items(args.data)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (the shorter one's end counts), or None if equal."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def answer_all(args, quantize: str, records: list[dict], console: Console) -> dict:
    target = load_model(args.target, dtype=args.dtype, quantize=quantize)
    engine = Rapid(EngineSpec(kv_cache_gib=0),
                   target=target)  # every prefill computed at the precision compared, none read from disk
    answers, started = [], time.perf_counter()
    for index, record in enumerate(records):
        out = engine.generate(record["document"], record["question"], template=record["template"], mode="lc",
                              max_new_tokens=args.max_new_tokens)
        answers.append({"token_ids": list(out.token_ids), "text": out.text, "right": record["check"](out.text)})
        console.print(f"[dim]{target.label}: {index + 1}/{len(records)}[/dim]")
    return {"quantize": target.quantization, "label": target.label, "dtype": str(target.dtype).removeprefix("torch."),
            "seconds": time.perf_counter() - started, "answers": answers}


def summary(run: dict, reference: dict) -> dict:
    diffs = [first_difference(a["token_ids"], b["token_ids"]) for a, b in zip(run["answers"], reference["answers"])]
    rights = [a["right"] for a in run["answers"]]
    low, high = wilson(sum(rights), len(rights))
    return {"quantize": run["quantize"], "label": run["label"], "dtype": run["dtype"],
            "identical": sum(d is None for d in diffs), "questions": len(diffs),
            "first_differences": [d for d in diffs if d is not None], "right": sum(rights), "scored": len(rights),
            "right_interval": [low, high], "seconds": run["seconds"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="builtin")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantize", default="none,gguf", help="comma-separated; the first is the reference")
    parser.add_argument("--questions", type=Path, default=QUESTIONS)
    parser.add_argument("--documents", type=Path, default=Path("/usr/share/common-licenses"))
    parser.add_argument("--data", type=Path, default=None, help="JSON lines of {document, question, answer}")
    parser.add_argument("--limit", type=int, default=None, help="at most this many questions")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    settings = [q.strip() for q in args.quantize.split(",") if q.strip()]
    try:
        if len(settings) < 2 or any(q not in TARGET_QUANTIZATIONS for q in settings):
            raise RapidspecError(f"--quantize takes two or more of {', '.join(TARGET_QUANTIZATIONS)}")
        records = load_records(args)[: args.limit]
        runs = [answer_all(args, quantize, records, console) for quantize in settings]
    except RapidspecError as error:
        console.print(f"[red]error:[/red] {error}")
        return 2
    rows = [summary(run, runs[0]) for run in runs]
    table = Table(title=f"greedy lc answers against {rows[0]['label']} ({rows[0]['dtype']}), {len(records)} questions, "
                        f"at most {args.max_new_tokens} tokens")
    for column in ("weights", "identical answers", "median first difference", "right", "95% interval", "seconds"):
        table.add_column(column, justify="right")
    for row in rows:
        median = statistics.median(row["first_differences"]) if row["first_differences"] else None
        table.add_row(row["label"], f"{row['identical']}/{row['questions']}", "-" if median is None else f"token {median:g}",
                      f"{row['right']}/{row['scored']}" if row["scored"] else "-",
                      f"[{row['right_interval'][0]:.2f}, {row['right_interval'][1]:.2f}]" if row["scored"] else "-",
                      f"{row['seconds']:.0f}")
    Console(width=140).print(table)
    print(json.dumps({"target": args.target, "max_new_tokens": args.max_new_tokens, "rows": rows,
                      "answers": {run["label"]: [a["text"] for a in run["answers"]] for run in runs}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
