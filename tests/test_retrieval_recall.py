"""benchmarks/retrieval_recall.py: evidence spans per data kind and the recall count, with BM25 on the byte tokenizer."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "retrieval_recall", Path(__file__).parents[1] / "benchmarks" / "retrieval_recall.py")
retrieval_recall = importlib.util.module_from_spec(_SPEC)
sys.modules["retrieval_recall"] = retrieval_recall  # its dataclass looks its module up
_SPEC.loader.exec_module(retrieval_recall)

FILLER = "The weather report said nothing of interest about the coast that week. " * 6


def sample() -> dict:
    turns = [{"speaker": "Ann", "dia_id": f"D1:{i}", "text": FILLER} for i in range(1, 9)]
    turns[5] = {"speaker": "Bob", "dia_id": "D1:6", "text": "I adopted a greyhound called Pixel last spring.",
                "blip_caption": "a dog on a sofa"}
    return {"sample_id": "s", "conversation": {"session_1": turns, "session_1_date_time": "1 May"},
            "qa": [{"question": "What is the name of the greyhound Bob adopted?", "evidence": ["D1:6"]},
                   {"question": "Where?", "evidence": ["D9:1"]}]}  # unknown evidence: dropped


def test_conversation_case_spans_and_recall(byte_tokenizer):
    case = retrieval_recall.conversation_case(sample())
    assert case.kind == "conversations" and len(case.qa) == 1
    question, [(start, end)] = case.qa[0]
    assert case.document[start:end] == "Bob: I adopted a greyhound called Pixel last spring. [shares a photo: a dog on a sofa]"
    hits = retrieval_recall.measure([case], ["bm25"], [128, 4096], 128, byte_tokenizer, None)
    small, everything = hits[("conversations", "bm25", 128)], hits[("conversations", "bm25", 4096)]
    assert small[:4] == [1, 1, 1, 1]  # the one evidence turn is the best BM25 chunk
    assert everything[:4] == [1, 1, 1, 1] and everything[4] > small[4]  # more context at the larger budget
    far = retrieval_recall.Case("conversations", case.document, [(question, [(0, len(case.document))])])
    assert retrieval_recall.measure([far], ["bm25"], [128], 128, byte_tokenizer, None)[("conversations", "bm25", 128)][:4] == [0, 1, 0, 1]


def test_needle_cases_hold_the_answer_needles(byte_tokenizer):
    cases = retrieval_recall.needle_cases([1024], 1, byte_tokenizer)
    assert [len(c.qa[0][1]) for c in cases] == [1, 1, 4]  # single, multi-key (one asked), multi-value (all four)
    for case in cases:
        for start, end in case.qa[0][1]:
            assert case.document[start:end].startswith("One of the special magic numbers for ")
