"""Chunking: exact character spans, token counts of the given tokenizer, sizes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import train_bpe_tokenizer
from rapidspec.retrieval.chunking import Chunker, split_sections

CORPUS = [
    "The quick brown fox jumps over the lazy dog. A second sentence follows here.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "Retrieval picks the chunks of a long document that matter for the question.",
    "日本語のテキストと中文文本，还有表情符号 😀🎉 and Windows line endings.\r\n",
]


def tiny_tokenizer():
    """A byte-level BPE tokenizer trained here in milliseconds (emoji/CJK = several tokens)."""
    return train_bpe_tokenizer(CORPUS * 5, 400)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


FRAGMENTS = [
    "word", "another", "Sentence one.", "Question?", "Wow!", " ", "  ", "\t", "\n", "\n\n",
    "\r\n", "\r\n\r\n", "日本語のテキスト。", "中文文本，", "😀", "🎉🎉", "👨‍👩‍👧", "é", "e\u0301",
    "The quick brown fox jumps over the lazy dog.", "naïve café", "-", "...",
]
fragment_docs = st.lists(st.sampled_from(FRAGMENTS), min_size=0, max_size=120).map("".join)
# Repeated passages: a few paragraphs, some of them repeated verbatim.
repeated_docs = st.tuples(st.lists(fragment_docs, min_size=1, max_size=4), st.lists(st.integers(0, 3), max_size=10)).map(
    lambda pr: "\n\n".join(pr[0][i % len(pr[0])] for i in [*range(len(pr[0])), *pr[1]])
)
any_docs = st.one_of(fragment_docs, repeated_docs, st.text(max_size=300))


def check_contract(document: str, chunks, tok, chunk_tokens: int, overlap: int) -> None:
    for i, c in enumerate(chunks):
        assert c.index == i
        assert document[c.char_start : c.char_end] == c.text
        assert c.span == (c.char_start, c.char_end)
        assert c.text and c.text == c.text.strip(" \t\r\n")  # Rust and Python disagree on e.g. "\x1f"
        assert c.num_tokens == len(tok.encode(c.text, add_special_tokens=False))
    for a, b in zip(chunks, chunks[1:]):
        assert a.char_start < b.char_start
        if overlap == 0:
            assert a.char_end <= b.char_start


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=any_docs, chunk_tokens=st.integers(1, 48), data=st.data())
def test_spans_are_exact_for_any_text(tok, document, chunk_tokens, data):
    overlap = data.draw(st.integers(0, chunk_tokens - 1))
    chunks = Chunker(tok, chunk_tokens, overlap).chunk(document)
    check_contract(document, chunks, tok, chunk_tokens, overlap)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=st.one_of(fragment_docs, repeated_docs), chunk_tokens=st.integers(32, 64))
def test_chunks_fit_and_cover_all_text(tok, document, chunk_tokens):
    chunks = Chunker(tok, chunk_tokens).chunk(document)
    assert all(c.num_tokens <= chunk_tokens for c in chunks)
    covered = bytearray(len(document))
    for c in chunks:
        covered[c.char_start : c.char_end] = b"\1" * (c.char_end - c.char_start)
    assert all(covered[i] or ch.isspace() for i, ch in enumerate(document))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=repeated_docs, section_chars=st.integers(2, 80))
def test_parallel_sections_keep_exact_spans(tok, document, section_chars):
    sections = split_sections(document, section_chars)
    assert sections[0][0] == 0 and sections[-1][1] == len(document)
    assert all(a[1] == b[0] for a, b in zip(sections, sections[1:]))
    chunks = Chunker(tok, 16, section_chars=section_chars).chunk(document)
    check_contract(document, chunks, tok, 16, 0)


def test_worked_example_from_the_docstring():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    doc = "one two three.\r\n\r\nfour five"
    chunks = Chunker(words, 4).chunk(doc)
    assert [(c.text, c.span, c.num_tokens) for c in chunks] == [
        ("one two three.", (0, 14), 4),
        ("four five", (18, 27), 2),
    ]


def test_split_sections_example():
    assert split_sections("aaaa\n\nbbbb\n\ncc", 8) == [(0, 6), (6, 14)]
    assert split_sections("short", 100) == [(0, 5)]


def test_prefers_paragraph_boundaries(tok):
    paragraphs = [f"Paragraph {i} talks about the fox. It has two sentences." for i in range(12)]
    doc = "\n\n".join(paragraphs)
    one = len(tok.encode(paragraphs[0] + "\n\n" + paragraphs[1], add_special_tokens=False))
    chunks = Chunker(tok, one + 2).chunk(doc)
    # Every chunk starts and ends on a paragraph boundary.
    for c in chunks:
        assert c.text.startswith("Paragraph") and c.text.endswith("sentences.")


def test_overlap_shares_text(tok):
    doc = " ".join(f"w{i}" for i in range(300))
    chunks = Chunker(tok, 20, 8).chunk(doc)
    assert len(chunks) > 2
    assert any(a.char_end > b.char_start for a, b in zip(chunks, chunks[1:]))


def test_slow_tokenizer_path_matches_fast(tok):
    class Slow:  # only .encode, like a python (slow) tokenizer
        def encode(self, text, add_special_tokens=False):
            return tok.encode(text, add_special_tokens=add_special_tokens)

    doc = "\n\n".join(CORPUS * 3)
    fast = Chunker(tok, 24).chunk(doc)
    slow = Chunker(Slow(), 24).chunk(doc)
    assert [c.span for c in fast] == [c.span for c in slow]


def test_tokenizer_with_truncation_is_not_modified(tok):
    from transformers import PreTrainedTokenizerFast

    truncating = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer)
    truncating.backend_tokenizer.enable_truncation(5)
    chunks = Chunker(truncating, 40).chunk(" ".join(["fox"] * 200))
    assert max(c.num_tokens for c in chunks) > 5
    assert truncating.backend_tokenizer.truncation["max_length"] == 5
