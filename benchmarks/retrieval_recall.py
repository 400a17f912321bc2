"""Retrieval quality on LoCoMo: how much of the evidence lands in the short context.

Each LoCoMo conversation becomes one document: for every session a header line
``Session N (date)`` and then one line per turn, ``Speaker: text`` (an image a
speaker shares is appended as ``[shares a photo: caption]``); sessions are
separated by blank lines. The character span of every turn is remembered.

For each QA item with evidence (ids like ``D3:12``; malformed ones such as
``"D8:6; D9:17"`` or ``"D:11:26"`` are parsed leniently, unknown ids ignored),
the question is the query. An evidence turn counts as *retrieved* when its
whole span lies inside one retrieved chunk span. Reported per method and
budget: turn recall (retrieved evidence turns / evidence turns) and the share
of questions whose evidence was all retrieved. Token counts use the built-in
SmolLM2 tokenizer. Chunks are ``--chunk-tokens`` (default 256) or the budget,
whichever is smaller, so that every budget can hold at least one chunk.

    python benchmarks/retrieval_recall.py /work/shared/data/locomo/locomo_dev.json \
        [--budgets 256,512,1024,2048] [--methods bm25,dense,hybrid] [--limit N]

Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import dataclass

import numpy as np

from rapidspec.retrieval import RetrievalConfig, Retriever, resolve_tokenizer
from rapidspec.retrieval.dense import load_embedder
from rapidspec.retrieval.selection import select_chunks
from rapidspec.textio import read_text

EVIDENCE_ID = re.compile(r"D:?\s*(\d+)\s*:\s*(\d+)")


@dataclass(frozen=True)
class Conversation:
    sample_id: str
    document: str
    turn_spans: dict[str, tuple[int, int]]  # "D3:12" -> (start, end)
    qa: list[tuple[str, list[str]]]  # (question, evidence ids), only items with known evidence


def render(sample: dict) -> Conversation:
    """Render one LoCoMo sample as a document with each turn's character span."""
    conv = sample["conversation"]
    sessions = sorted(
        (int(m.group(1)) for key in conv if (m := re.fullmatch(r"session_(\d+)", key))),
    )
    parts: list[str] = []
    spans: dict[str, tuple[int, int]] = {}
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
            qa.append((item["question"], ids))
    for dia_id, (a, b) in spans.items():
        assert document[a:b].count("\n") == 0, dia_id
    return Conversation(str(sample.get("sample_id", "")), document, spans, qa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_path", help="LoCoMo JSON (e.g. locomo10.json or locomo_dev.json)")
    parser.add_argument("--budgets", default="256,512,1024,2048")
    parser.add_argument("--methods", default="bm25,dense,hybrid")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N conversations")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    methods = args.methods.split(",")

    samples = json.loads(read_text(args.data_path))[: args.limit]
    conversations = [render(s) for s in samples]
    tokenizer = resolve_tokenizer("builtin")
    embedder = load_embedder() if any(m != "bm25" for m in methods) else None

    hits = {(m, b): [0, 0, 0, 0, 0] for m in methods for b in budgets}  # turns hit, turns, questions all hit, questions, tokens
    doc_tokens = []
    started = time.perf_counter()
    for conv in conversations:
        for chunk_tokens in sorted({min(args.chunk_tokens, b) for b in budgets}):
            for method in methods:
                config = RetrievalConfig(method=method, chunk_tokens=chunk_tokens)
                retriever = Retriever(config, tokenizer=tokenizer, embedder=embedder)
                chunks = retriever.chunks(conv.document)
                counts = [c.num_tokens for c in chunks]
                starts = np.array([c.char_start for c in chunks])
                ends = np.array([c.char_end for c in chunks])
                if method == methods[0] and chunk_tokens == min(args.chunk_tokens, budgets[0]):
                    doc_tokens.append(sum(counts))
                for question, evidence in conv.qa:
                    scores = retriever.scores(conv.document, question)
                    for budget in budgets:
                        if min(args.chunk_tokens, budget) != chunk_tokens:
                            continue
                        chosen = [i for i, _ in select_chunks(scores, counts, budget)]
                        got = 0
                        for dia_id in evidence:
                            a, b = conv.turn_spans[dia_id]
                            got += bool(np.any((starts[chosen] <= a) & (ends[chosen] >= b)))
                        h = hits[(method, budget)]
                        h[0] += got
                        h[1] += len(evidence)
                        h[2] += got == len(evidence)
                        h[3] += 1
                        h[4] += sum(counts[i] for i in chosen)
    seconds = time.perf_counter() - started

    rows = {}
    for (method, budget), (got, total, full, questions, tokens) in hits.items():
        rows[f"{method}@{budget}"] = {
            "method": method,
            "budget_tokens": budget,
            "turn_recall": round(got / max(total, 1), 4),
            "questions_fully_covered": round(full / max(questions, 1), 4),
            "mean_context_tokens": round(tokens / max(questions, 1), 1),
        }
    print(f"LoCoMo {args.data_path}: {len(conversations)} conversations, "
          f"{sum(len(c.qa) for c in conversations)} questions with evidence, "
          f"mean document {np.mean(doc_tokens):,.0f} tokens, chunks of <= {args.chunk_tokens} tokens")
    header = "method  " + "".join(f"{b:>12}" for b in budgets)
    print("turn recall (share of questions with all evidence retrieved)")
    print(header)
    for method in methods:
        cells = "".join(
            f"{rows[f'{method}@{b}']['turn_recall']:>6.3f} ({rows[f'{method}@{b}']['questions_fully_covered']:.2f})" for b in budgets
        )
        print(f"{method:<8}{cells}")
    print(json.dumps({
        "data_path": args.data_path,
        "conversations": len(conversations),
        "questions": sum(len(c.qa) for c in conversations),
        "evidence_turns": sum(len(e) for c in conversations for _, e in c.qa),
        "mean_document_tokens": round(float(np.mean(doc_tokens)), 1),
        "chunk_tokens": args.chunk_tokens,
        "seconds": round(seconds, 1),
        "results": list(rows.values()),
    }))


if __name__ == "__main__":
    main()
