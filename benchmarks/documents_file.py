"""Write a ``rapidspec bench serve --documents`` file: documents cut to a length in the target's tokens, with questions.

    python -m benchmarks.documents_file builtin --tokens 16384 --out demo_16k.jsonl
    python -m benchmarks.documents_file dev.json --tokens 32768 --max-documents 4 --out longbench_32k.jsonl

The source is ``builtin`` (the built-in demo document at that length, with the
8 questions ``bench serve`` asks about it) or any file ``rapidspec eval`` reads
(LongBench v2, L-Eval, LoCoMo): its items grouped by document, each document cut
to its first ``--tokens`` tokens (at the last line break of the final 10% where
there is one), documents shorter than that left out, each with its questions in
the file's order (a LongBench v2 document has one, with its choices; an L-Eval
document several). ``--follow-ups N`` adds the first N of
:data:`FOLLOW_UPS`, questions any text answers, after each document's own (a
LongBench v2 document then has follow-ups that find it cached). The cut may
leave a question without its answer in the text: the file measures speed, not
accuracy.

One JSON object per line, ``{"document": "...", "questions": ["...", ...]}``;
a summary line (documents, questions, tokens) on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rapidspec.errors import RapidspecError

#: A cut moves back to a line break found within this last fraction of the kept text.
LINE_BREAK_WINDOW = 0.1
FOLLOW_UPS = (
    "Summarize the text in three sentences.",
    "Which people, places or organizations does the text name?",
    "What is the main point of the text's last part?",
    "List three facts the text states, each in one sentence.",
    "What question does the text leave open?",
    "Quote the first sentence of the text.",
    "What would a reader need to know before reading this text?",
)


def cut(tokenizer, text: str, tokens: int) -> str | None:
    """The first ``tokens`` tokens of ``text`` (ending at a line break when one is near), None when it is shorter."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if len(encoded["input_ids"]) < tokens:
        return None
    end = encoded["offset_mapping"][tokens - 1][1]
    kept = text[:end]
    line = kept.rfind("\n")
    return kept[:line] if line >= (1 - LINE_BREAK_WINDOW) * len(kept) else kept


def builtin_records(tokenizer, tokens: int) -> list[dict]:
    from rapidspec.bench.serve.dataset import BUILTIN_QUESTIONS
    from rapidspec.prompting.demo_document import demo_document

    return [{"document": demo_document(target_tokens=tokens, tokenizer=tokenizer).document,
             "questions": list(BUILTIN_QUESTIONS)}]


def file_records(tokenizer, path: str, tokens: int, max_documents: int | None) -> list[dict]:
    from rapidspec.evaluation.datasets import load_items

    questions: dict[str, list[str]] = {}
    for item in load_items(path):
        questions.setdefault(item.document, []).append(item.question)
    records = []
    for document, asked in questions.items():
        if max_documents is not None and len(records) >= max_documents:
            break
        text = cut(tokenizer, document, tokens)
        if text is not None:
            records.append({"document": text, "questions": asked})
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.documents_file", description=__doc__.split("\n")[0])
    parser.add_argument("source", help="builtin, or a file rapidspec eval reads (LongBench v2, L-Eval, LoCoMo)")
    parser.add_argument("--tokens", type=int, required=True, help="each document's length in the tokenizer's tokens")
    parser.add_argument("--tokenizer", default="builtin", help="the target's tokenizer (default: %(default)s)")
    parser.add_argument("--max-documents", type=int, default=None, help="keep at most this many documents")
    parser.add_argument("--follow-ups", type=int, default=0,
                        help=f"questions any text answers added after each document's own (0-{len(FOLLOW_UPS)})")
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    args = parser.parse_args(argv)
    try:
        if args.tokens < 256 or (args.max_documents is not None and args.max_documents < 1):
            raise RapidspecError("--tokens must be at least 256 and --max-documents at least 1")
        if not 0 <= args.follow_ups <= len(FOLLOW_UPS):
            raise RapidspecError(f"--follow-ups must be between 0 and {len(FOLLOW_UPS)}")
        from rapidspec.retrieval.tokenizers import resolve_tokenizer

        tokenizer = resolve_tokenizer(args.tokenizer)
        records = builtin_records(tokenizer, args.tokens) if args.source == "builtin" else \
            file_records(tokenizer, args.source, args.tokens, args.max_documents)
        if not records:
            raise RapidspecError(f"{args.source}: no document has {args.tokens} tokens")
        for record in records:
            record["questions"] += FOLLOW_UPS[:args.follow_ups]
        out = Path(args.out)
        out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    except (RapidspecError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{out}: {len(records)} documents of {args.tokens} tokens, {sum(len(r['questions']) for r in records)} "
          "questions", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
