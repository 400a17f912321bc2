"""Real documents for `rapidspec bench --data`: dev-set texts at several lengths x question kinds.

Retrieval fits a question whose answer sits in a few places of the document;
it fits a summary badly. This script picks, from benchmark files in their
published formats (LongBench v2, L-Eval; read by rapidspec's own loaders), the
document whose length in the target's tokens is nearest each ``--lengths``
value, and writes one ``{"document", "question", "kind", "tokens", "source"}``
record per document and question kind:

* ``own``: the benchmark's own question about that document (its first one),
  without the answer options;
* ``summary``: "Summarize the main argument of the text.";
* ``main-point``: "What is the main point the author makes, and how is it supported?".

    python benchmarks/real_documents.py $DATA/leval/quality.jsonl $DATA/longbench_v2/dev.json \\
        --target builtin:qwen2.5-coder-0.5b --lengths 7000,16000,26000 --out real_documents.jsonl
    rapidspec bench --data real_documents.jsonl --target builtin:qwen2.5-coder-0.5b \\
        --modes lc,rapid,llama.cpp --repeats 1 --share-prefill --max-new-tokens 64

Writes the JSONL file and prints one line per record (kind, tokens, source).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rapidspec.errors import RapidspecError
from rapidspec.evaluation.datasets import load_items

QUESTION_KINDS = {
    "summary": "Summarize the main argument of the text.",
    "main-point": "What is the main point the author makes, and how is it supported?",
}


def own_question(item) -> str:
    """The item's question without its options (the first line of an L-Eval instruction; LongBench v2's query)."""
    text = item.query if item.choices else item.question
    return text.splitlines()[0].strip() if item.choices else text.strip()


def documents(paths: list[str]) -> dict[str, tuple[str, str]]:
    """Each distinct document of the files -> (its first question, its source name)."""
    found: dict[str, tuple[str, str]] = {}
    for path in paths:
        for item in load_items(path):
            found.setdefault(item.document, (own_question(item), item.group))
    return found


def pick(lengths: list[int], counted: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """For each wanted length, the (tokens, document) nearest it, each document at most once."""
    chosen, left = [], list(counted)
    for wanted in lengths:
        if not left:
            break
        best = min(left, key=lambda pair: abs(pair[0] - wanted))
        left.remove(best)
        chosen.append(best)
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", nargs="+", help="benchmark files (LongBench v2 JSON, L-Eval JSONL)")
    parser.add_argument("--target", default="builtin", help="whose tokenizer counts the lengths")
    parser.add_argument("--lengths", default="7000,16000,26000", help="wanted document lengths in tokens")
    parser.add_argument("--kinds", default="own,summary,main-point", help="question kinds (own, summary, main-point)")
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    args = parser.parse_args(argv)
    try:
        from rapidspec.models import load_model

        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        kinds = [x.strip() for x in args.kinds.split(",") if x.strip()]
        unknown = [k for k in kinds if k != "own" and k not in QUESTION_KINDS]
        if unknown or not kinds or not lengths:
            raise RapidspecError(f"--kinds takes own, {', '.join(QUESTION_KINDS)}; --lengths positive integers")
        tokenizer = load_model(args.target).tokenizer
        found = documents(args.data)
    except (RapidspecError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    counted = [(len(tokenizer(doc, add_special_tokens=False)["input_ids"]), doc) for doc in found]
    with Path(args.out).open("w", encoding="utf-8") as out:
        for tokens, document in pick(lengths, counted):
            question, source = found[document]
            for kind in kinds:
                record = {"document": document, "question": question if kind == "own" else QUESTION_KINDS[kind],
                          "kind": kind, "tokens": tokens, "source": source}
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                print(f"{kind:10s} {tokens:6d} tokens  {source}: {record['question'][:70]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
