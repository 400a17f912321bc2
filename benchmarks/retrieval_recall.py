"""Retrieval quality per data kind: how much of the evidence lands in the short context.

Two kinds of data, each a set of documents with questions whose evidence spans
are known:

* conversations, from a LoCoMo file (the positional argument). Each
  conversation becomes one document: for every session a header line
  ``Session N (date)`` and then one line per turn, ``Speaker: text`` (an image
  a speaker shares is appended as ``[shares a photo: caption]``); sessions are
  separated by blank lines. Each QA item with evidence (ids like ``D3:12``;
  malformed ones such as ``"D8:6; D9:17"`` or ``"D:11:26"`` are parsed
  leniently, unknown ids ignored) is a question whose evidence is its turns.
* documents, the synthetic needle tasks of ``rapidspec eval --format synthetic``
  (``--needles 4096,8192``, ``--per-task`` items per task and length, built
  with the built-in tokenizer as eval builds them for the built-in model): real
  prose with needle sentences; the evidence is the needles that hold an answer.

An evidence span counts as *retrieved* when it lies wholly inside one retrieved
chunk. Reported per data kind, method and budget: evidence recall (retrieved
evidence spans / evidence spans) and the share of questions whose evidence was
all retrieved. Token counts use the built-in SmolLM2 tokenizer. Chunks are
``--chunk-tokens`` (default 256) or the budget, whichever is smaller, so that
every budget can hold at least one chunk.

    python benchmarks/retrieval_recall.py [/work/shared/data/locomo/locomo_dev.json] \
        [--needles 4096,8192 --per-task 4] [--budgets 256,512,1024,2048] \
        [--methods bm25,dense,hybrid] [--limit N]

Prints a table per data kind, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import dataclass

import numpy as np

from rapidspec.evaluation.synthetic import synthetic_items
from rapidspec.prompting.textio import read_text
from rapidspec.retrieval import RetrievalConfig, Retriever, resolve_tokenizer
from rapidspec.retrieval.config import EMBEDDING_DTYPES
from rapidspec.retrieval.dense import load_embedder
from rapidspec.retrieval.selection import select_chunks

EVIDENCE_ID = re.compile(r"D:?\s*(\d+)\s*:\s*(\d+)")

Span = tuple[int, int]  # character [start, end) in the document


@dataclass(frozen=True)
class Case:
    """One document and the questions asked of it, each with the spans of its evidence."""

    kind: str  # "conversations" or "documents"
    document: str
    qa: list[tuple[str, list[Span]]]


def conversation_case(sample: dict) -> Case:
    """Render one LoCoMo sample as a document; each question's evidence is its turns' spans."""
    conv = sample["conversation"]
    sessions = sorted(
        (int(m.group(1)) for key in conv if (m := re.fullmatch(r"session_(\d+)", key))),
    )
    parts: list[str] = []
    spans: dict[str, Span] = {}
    offset = 0
    for n in sessions:
        lines = [f"Session {n} ({conv.get(f'session_{n}_date_time', 'unknown date')})"]
        offset_in = offset + len(lines[0]) + 1
        for turn in conv[f"session_{n}"]:
            line = f"{turn['speaker']}: {turn.get('text', '')}"
            if turn.get("blip_caption"):
                line += f" [shares a photo: {turn['blip_caption']}]"
            line = " ".join(line.split())  # one line per turn
            spans[turn["dia_id"]] = (offset_in, offset_in + len(line))
            lines.append(line)
            offset_in += len(line) + 1
        block = "\n".join(lines)
        parts.append(block)
        offset += len(block) + 2
    document = "\n\n".join(parts)
    qa = []
    for item in sample.get("qa", []):
        ids = [f"D{a}:{b}" for e in item.get("evidence") or [] for a, b in EVIDENCE_ID.findall(str(e))]
        ids = [i for i in dict.fromkeys(ids) if i in spans]
        if ids:
            qa.append((item["question"], [spans[i] for i in ids]))
    for a, b in spans.values():
        assert document[a:b].count("\n") == 0, (a, b)
    return Case("conversations", document, qa)


def needle_cases(lengths: list[int], per_task: int, tokenizer) -> list[Case]:
    """The synthetic needle items as cases: the evidence is every needle that holds a gold value."""
    cases = []
    for item in synthetic_items(lengths, per_task=per_task, tokenizer=tokenizer):
        needles = [n for n in item.meta["needles"] if any(value in n for value in item.answers)]
        spans = [(item.document.index(n), item.document.index(n) + len(n)) for n in needles]
        cases.append(Case("documents", item.document, [(item.query, spans)]))
    return cases


def measure(cases: list[Case], methods: list[str], budgets: list[int], chunk_tokens: int, tokenizer, embedder) -> dict:
    """Per (kind, method, budget): [spans hit, spans, questions all hit, questions, context tokens, document tokens]."""
    hits: dict[tuple[str, str, int], list[int]] = {}
    for case in cases:
        for size in sorted({min(chunk_tokens, b) for b in budgets}):
            for method in methods:
                retriever = Retriever(RetrievalConfig(method=method, chunk_tokens=size), tokenizer=tokenizer, embedder=embedder)
                chunks = retriever.chunks(case.document)
                counts = [c.num_tokens for c in chunks]
                document_tokens = sum(counts)
                starts = np.array([c.char_start for c in chunks])
                ends = np.array([c.char_end for c in chunks])
                for question, evidence in case.qa:
                    scores = retriever.scores(case.document, question)
                    for budget in (b for b in budgets if min(chunk_tokens, b) == size):
                        chosen = [i for i, _ in select_chunks(scores, counts, budget)]
                        got = sum(bool(np.any((starts[chosen] <= a) & (ends[chosen] >= b))) for a, b in evidence)
                        h = hits.setdefault((case.kind, method, budget), [0, 0, 0, 0, 0, 0])
                        h[0] += got
                        h[1] += len(evidence)
                        h[2] += got == len(evidence)
                        h[3] += 1
                        h[4] += sum(counts[i] for i in chosen)
                        h[5] += document_tokens
    return hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_path", nargs="?", help="LoCoMo JSON (e.g. locomo10.json or locomo_dev.json)")
    parser.add_argument("--needles", default="", help="synthetic needle documents at these lengths, e.g. 4096,8192")
    parser.add_argument("--per-task", type=int, default=4, help="needle items per task and length")
    parser.add_argument("--budgets", default="256,512,1024,2048")
    parser.add_argument("--methods", default="bm25,dense,hybrid")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N conversations")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--embedding-dtype", default="auto", choices=EMBEDDING_DTYPES,
                        help="the embedder's dtype (default: auto, as retrieval uses it)")
    args = parser.parse_args()
    if not args.data_path and not args.needles:
        parser.error("give a LoCoMo file, --needles LENGTHS, or both")
    budgets = [int(b) for b in args.budgets.split(",")]
    methods = args.methods.split(",")

    tokenizer = resolve_tokenizer("builtin")
    cases: list[Case] = []
    if args.data_path:
        cases += [conversation_case(s) for s in json.loads(read_text(args.data_path))[: args.limit]]
    if args.needles:
        cases += needle_cases([int(n) for n in args.needles.split(",")], args.per_task, tokenizer)
    embedder = load_embedder(dtype=args.embedding_dtype) if any(m != "bm25" for m in methods) else None

    started = time.perf_counter()
    hits = measure(cases, methods, budgets, args.chunk_tokens, tokenizer, embedder)
    seconds = time.perf_counter() - started

    rows = []
    for (kind, method, budget), (got, total, full, questions, tokens, doc_tokens) in hits.items():
        rows.append({
            "kind": kind,
            "method": method,
            "budget_tokens": budget,
            "evidence_recall": round(got / max(total, 1), 4),
            "questions_fully_covered": round(full / max(questions, 1), 4),
            "questions": questions,
            "mean_context_tokens": round(tokens / max(questions, 1), 1),
            "mean_document_tokens": round(doc_tokens / max(questions, 1), 1),
        })
    for kind in dict.fromkeys(c.kind for c in cases):
        kind_rows = {(r["method"], r["budget_tokens"]): r for r in rows if r["kind"] == kind}
        first = next(iter(kind_rows.values()))
        print(f"{kind}: {sum(c.kind == kind for c in cases)} documents, {first['questions']} questions with evidence, "
              f"mean document {first['mean_document_tokens']:,.0f} tokens, chunks of <= {args.chunk_tokens} tokens")
        print("evidence recall (share of questions with all evidence retrieved)")
        print("method  " + "".join(f"{b:>14}" for b in budgets))
        for method in methods:
            cells = "".join(
                f"{kind_rows[(method, b)]['evidence_recall']:>8.3f} ({kind_rows[(method, b)]['questions_fully_covered']:.2f})"
                for b in budgets
            )
            print(f"{method:<8}{cells}")
    print(json.dumps({
        "data_path": args.data_path,
        "needles": args.needles or None,
        "per_task": args.per_task if args.needles else None,
        "chunk_tokens": args.chunk_tokens,
        "seconds": round(seconds, 1),
        "results": rows,
    }))


if __name__ == "__main__":
    main()
