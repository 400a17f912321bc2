"""The built-in long document for the demo, tests and benchmarks.

Contract:

* The text is real prose from the Python Language Reference as shipped with
  every Python in ``pydoc_data.topics`` (PSF License), taken from a fixed list
  of topics in a fixed order, with code samples, grammar and indented notes
  removed. It is available offline and deterministic for a given Python
  version (other versions may word a few paragraphs differently).
* One "needle" paragraph that is not in the source, a simple fact about a
  library, is planted at the paragraph boundary nearest the middle of the
  document (by tokens). The question asks for that fact, so a correct answer
  shows that the model read the middle of the context.
* ``demo_document()`` is about 7K tokens of the built-in tokenizer;
  ``demo_document(target_tokens=n, tokenizer=tok)`` builds the same family at
  another length, counted with ``tok``. Without a tokenizer, tokens are
  estimated from characters (:data:`CHARS_PER_TOKEN`, calibrated on the
  built-in SmolLM2 tokenizer for this text, separators included).
"""

from __future__ import annotations

import itertools
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from rapidspec.errors import RapidspecError

__all__ = ["DEFAULT_TARGET_TOKENS", "DemoItem", "demo_document", "demo_prompt"]

#: Default length of the demo document, in tokens of the built-in tokenizer.
DEFAULT_TARGET_TOKENS = 7000

#: The longest demo document built (a million tokens, the text repeated about twenty times).
MAX_TARGET_TOKENS = 1 << 20

#: Characters per SmolLM2 token of this text, paragraph by paragraph (so that
#: 2K-8K documents land within ~2% of the target); used only without a tokenizer.
CHARS_PER_TOKEN = 4.55

#: Reference topics, in document order: the ones that read as prose.
TOPICS: tuple[str, ...] = (
    "objects",
    "execmodel",
    "exceptions",
    "truth",
    "import",
    "types",
    "comparisons",
    "numeric-types",
    "naming",
    "compound",
)

NEEDLE = (
    "Archivist's note: the reading room of the Lisbon library closes at "
    "4:30 pm on Thursdays."
)
QUESTION = "At what time does the reading room of the Lisbon library close on Thursdays?"
ANSWER = "4:30 pm"
#: A follow-up whose answer is long and copies the text (the passage is in every document of 1,500 tokens or
#: more): the kind of answer a drafter reading the retrieved passage is for. ``rapidspec demo`` asks it after
#: :data:`QUESTION`.
FOLLOW_UP = "What is a code block in Python's execution model? Give the examples the text lists."

PROMPT_TEMPLATE = (
    "Please read the following text and answer the question below.\n\n"
    "<text>\n{document}\n</text>\n\nQuestion: {question}"
)

_UNDERLINE = re.compile(r"^([*=\-~^\"'`#+])\1{2,}$")
_FOOTNOTE_REF = re.compile(r" ?\[\d+\]")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"“(*])")


@dataclass(frozen=True)
class DemoItem:
    """A long document with one planted fact and a question about it.

    ``needle_position`` is the character offset of ``needle`` in ``document``.
    """

    document: str
    question: str
    answer: str
    source: str
    needle_position: int
    needle: str = NEEDLE

    def prompt(self) -> str:
        """The user message of the demo: the document, then the question."""
        return demo_prompt(self.document, self.question)


def demo_prompt(document: str, question: str) -> str:
    """The demo's user message for ``document`` and ``question``."""
    return PROMPT_TEMPLATE.format(document=document, question=question)


def _topic_paragraphs(text: str) -> list[str]:
    """Prose paragraphs of one pydoc topic, one line each.

    Headings become their own paragraph; paragraphs that start indented (code,
    grammar, notes, nested lists) are dropped, together with a preceding
    paragraph that ends with ``:`` and so introduced them; footnotes go.
    """
    text = text.split("-[ Footnotes ]-")[0]
    blocks = [b for b in re.split(r"\n\s*\n", text) if b.strip()]
    kept: list[str] = []
    previous_kept_introduces = False
    for block in blocks:
        lines = block.rstrip().splitlines()
        if lines[0][:1].isspace() or lines[0].startswith(">>>"):
            if previous_kept_introduces and kept:
                kept.pop()
            previous_kept_introduces = False
            continue
        # A heading is a line underlined by a run of punctuation.
        if len(lines) >= 2 and _UNDERLINE.match(lines[1].strip()):
            kept.append(lines[0].strip().strip('"'))
            lines = lines[2:]
            if not lines:
                previous_kept_introduces = False
                continue
        paragraph = _FOOTNOTE_REF.sub("", " ".join(line.strip() for line in lines))
        kept.append(paragraph)
        previous_kept_introduces = paragraph.endswith(":")
    if previous_kept_introduces and kept:  # a trailing "See also:" and the like
        kept.pop()
    return kept


def source_paragraphs() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some minimal Python builds strip it
        raise RapidspecError(f"the demo document needs pydoc_data.topics, missing in this Python: {exc}") from None
    paragraphs: list[str] = []
    for name in TOPICS:
        if name in topics:
            paragraphs.extend(_topic_paragraphs(topics[name]))
    return paragraphs


def _long_source() -> Iterator[str]:
    """The paragraphs of :data:`TOPICS`, then of the other topics alphabetically, then all of it again, endlessly."""
    from pydoc_data.topics import topics

    rest = [paragraph for name in sorted(set(topics) - set(TOPICS)) for paragraph in _topic_paragraphs(topics[name])]
    return itertools.cycle([*source_paragraphs(), *rest])


def token_counter(tokenizer: Any | None) -> Callable[[str], int]:
    if tokenizer is None:
        return lambda text: max(1, round(len(text) / CHARS_PER_TOKEN))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def demo_document(target_tokens: int = DEFAULT_TARGET_TOKENS, tokenizer: Any | None = None) -> DemoItem:
    """Build the demo document of about ``target_tokens`` tokens.

    Paragraphs are taken in order until the count reaches ``target_tokens``
    (the last one cut at a sentence boundary when whole paragraphs would
    overshoot), then :data:`NEEDLE` is inserted as its own paragraph at the
    boundary nearest the middle. The needle is included in the count, so the
    document is ``target_tokens`` within a sentence or so. Deterministic.
    """
    if not 256 <= target_tokens <= MAX_TARGET_TOKENS:
        raise RapidspecError(f"target_tokens must be at least 256 and at most {MAX_TARGET_TOKENS}, got {target_tokens}")
    count = token_counter(tokenizer)
    separator = 1 if tokenizer is None else count("a\n\nb") - count("a") - count("b")
    budget = target_tokens - count(NEEDLE) - separator

    chosen: list[str] = []
    lengths: list[int] = []
    total = 0
    for paragraph in _long_source():
        n = count(paragraph) + separator
        if total + n <= budget:
            chosen.append(paragraph)
            lengths.append(n)
            total += n
            continue
        # Fill the rest of the budget with whole sentences of this paragraph.
        sentences = SENTENCE_END.split(paragraph)
        partial: list[str] = []
        for sentence in sentences:
            candidate = " ".join([*partial, sentence])
            if total + count(candidate) + separator > budget:
                break
            partial.append(sentence)
        if partial:
            text = " ".join(partial)
            chosen.append(text)
            lengths.append(count(text) + separator)
            total += lengths[-1]
        break

    # Insert the needle at the paragraph boundary closest to half the tokens.
    half, running, split = total / 2, 0, 0
    best = float("inf")
    for i in range(len(chosen) + 1):
        if abs(running - half) < best:
            best, split = abs(running - half), i
        if i < len(lengths):
            running += lengths[i]
    before = "\n\n".join(chosen[:split])
    document = "\n\n".join([*chosen[:split], NEEDLE, *chosen[split:]])
    needle_position = len(before) + 2 if before else 0

    version = ".".join(map(str, sys.version_info[:3]))
    source = (
        f"Python {version} Language Reference (pydoc_data.topics: {', '.join(TOPICS)}; beyond them the other topics "
        "alphabetically, then the same text again), "
        "PSF License; one planted sentence (the needle) added by rapidspec"
    )
    return DemoItem(
        document=document,
        question=QUESTION,
        answer=ANSWER,
        source=source,
        needle_position=needle_position,
    )
