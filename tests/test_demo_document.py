"""Tests of rapidspec.prompting.demo_document: length, needle placement, determinism.

Fast tests count tokens with a whitespace stub tokenizer or the built-in
character estimate; the ``slow`` ones use the real built-in tokenizer.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rapidspec.prompting.demo_document import (
    ANSWER,
    DEFAULT_TARGET_TOKENS,
    NEEDLE,
    QUESTION,
    DemoItem,
    source_paragraphs,
    demo_document,
    demo_prompt,
)
from rapidspec.errors import RapidspecError


class WordTokenizer:
    """Counts whitespace-separated words; enough for the length logic."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [0] * len(text.split())


def assert_needle_in_middle_third(item: DemoItem, count) -> None:
    assert item.document.count(NEEDLE) == 1
    assert item.document[item.needle_position : item.needle_position + len(NEEDLE)] == NEEDLE
    before = count(item.document[: item.needle_position])
    total = count(item.document)
    assert total / 3 <= before <= 2 * total / 3, (before, total)
    # The needle is a paragraph of its own.
    assert item.document[item.needle_position - 2 : item.needle_position] == "\n\n"
    assert item.document[item.needle_position + len(NEEDLE) :].startswith("\n\n")


def test_default_item_fields():
    item = demo_document()
    assert item.question == QUESTION and item.answer == ANSWER
    assert item.answer in item.needle and item.needle == NEEDLE
    assert "PSF License" in item.source and "pydoc_data" in item.source
    assert item.prompt() == demo_prompt(item.document, item.question)
    assert item.prompt().endswith(f"</text>\n\nQuestion: {QUESTION}")
    # Roughly 7K tokens by the character estimate (real count tested in slow tests).
    assert 6000 * 4.2 <= len(item.document) <= 7500 * 4.9


def test_deterministic():
    assert demo_document() == demo_document()
    assert demo_document(3000, WordTokenizer()) == demo_document(3000, WordTokenizer())


def test_needle_is_not_in_the_source_text():
    source = "\n\n".join(source_paragraphs())
    assert "Lisbon" not in source and "Archivist" not in source and "4:30" not in source


def test_source_is_prose():
    paragraphs = source_paragraphs()
    assert all("\n" not in p for p in paragraphs)
    assert not any(p.startswith((" ", ">>>")) for p in paragraphs)
    assert not any("-[ Footnotes ]-" in p for p in paragraphs)


@pytest.mark.parametrize("target", [1000, 2000, 4000, 7000, 8000])
def test_length_and_needle_with_a_tokenizer(target):
    tokenizer = WordTokenizer()
    item = demo_document(target, tokenizer)
    total = len(tokenizer.encode(item.document))
    assert 0.9 * target <= total <= target + 5, total
    assert_needle_in_middle_third(item, lambda text: len(tokenizer.encode(text)))


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=256, max_value=9000))
def test_needle_in_middle_third_for_any_length(target):
    item = demo_document(target)
    assert_needle_in_middle_third(item, len)
    assert len(item.document) <= (target + 5) * 4.55 * 1.05


def test_shorter_documents_are_prefixes_in_spirit():
    """The same family: a shorter document starts with the same prose."""
    short, long = demo_document(1000), demo_document(7000)
    assert short.document[:200] == long.document[:200]


def test_bad_lengths():
    with pytest.raises(RapidspecError, match="at least"):
        demo_document(50)
    with pytest.raises(RapidspecError, match="at most"):
        demo_document(10_000_000)


def test_a_document_longer_than_the_source_goes_on_with_the_other_topics_then_starts_over():
    first = max(source_paragraphs()[:5], key=len)  # a long paragraph near the start, found nowhere else
    within, beyond = demo_document(15_000), demo_document(80_000)
    assert within.document.count(first) == 1
    assert beyond.document.count(first) == 2  # about 50K tokens of all topics, then the same text again
    assert beyond.document.count(NEEDLE) == 1
    assert 0.95 * 80_000 * 4.55 <= len(beyond.document) <= 1.05 * 80_000 * 4.55


# ---------------------------------------------------------------- built-in tokenizer


@pytest.fixture(scope="module")
def builtin_tokenizer(smollm2):
    return smollm2.tokenizer


def count_with(tokenizer):
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.slow
def test_default_document_is_about_7k_builtin_tokens(builtin_tokenizer):
    count = count_with(builtin_tokenizer)
    item = demo_document()
    assert 6500 <= count(item.document) <= 7300
    assert_needle_in_middle_third(item, count)
    exact = demo_document(DEFAULT_TARGET_TOKENS, builtin_tokenizer)
    assert 6800 <= count(exact.document) <= DEFAULT_TARGET_TOKENS + 5


@pytest.mark.slow
@pytest.mark.parametrize("target", [1000, 2000, 4000, 8000])
def test_lengths_with_builtin_tokenizer(builtin_tokenizer, target):
    count = count_with(builtin_tokenizer)
    item = demo_document(target, builtin_tokenizer)
    assert 0.9 * target <= count(item.document) <= target + 5
    assert_needle_in_middle_third(item, count)
    assert item == demo_document(target, builtin_tokenizer)
