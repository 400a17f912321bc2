"""Split a document into token-bounded chunks that keep exact character spans.

The splitting itself is done by ``semantic-text-splitter`` (Rust): it packs the
largest semantic units that fit, preferring paragraph, then line, sentence,
word and finally character boundaries, and trims whitespace at chunk edges.
Token counts come from the caller's Hugging Face tokenizer, without special
tokens (no BOS/EOS), and are the tokenizer's own counts of each chunk's text.

Contract, for every chunk ``c`` of ``chunk_document(doc)``:

* ``doc[c.char_start:c.char_end] == c.text`` (Python ``str`` indices, i.e.
  code points, so CJK, emoji and ``"\\r\\n"`` are handled exactly);
* chunks are in document order, ``c.index`` is their position;
* ``c.num_tokens <= chunk_tokens`` unless a single character alone needs more
  tokens than that (the splitter never cuts inside a character);
* whitespace-only stretches belong to no chunk.

Worked example (word-level tokenizer, ``chunk_tokens=4``)::

    doc = "one two three.\\r\\n\\r\\nfour five"
    #      0123456789012345 6 7 8901234567
    chunk_document(doc) ==
        (Chunk(index=0, text="one two three.", char_start=0,  char_end=14, num_tokens=4),
         Chunk(index=1, text="four five",      char_start=18, char_end=27, num_tokens=2))

The "\\r\\n\\r\\n" between them (chars 14-17) is in no chunk.

Long documents are first cut into sections of about ``section_chars``
characters at paragraph (else line, else word) boundaries, and the sections
are chunked in parallel by the splitter's thread pool; a chunk never crosses a
section boundary. With the default of 200,000 characters this costs at most one
shorter-than-necessary chunk per ~50K tokens.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from semantic_text_splitter import TextSplitter

logger = logging.getLogger(__name__)

#: Documents longer than this many characters are chunked in parallel sections.
SECTION_CHARS = 200_000


@dataclass(frozen=True)
class Chunk:
    """One chunk: ``document[char_start:char_end] == text``."""

    index: int
    text: str
    char_start: int
    char_end: int
    num_tokens: int

    @property
    def span(self) -> tuple[int, int]:
        """``(char_start, char_end)``, a half-open range of ``str`` indices."""
        return (self.char_start, self.char_end)


class Chunker:
    """Chunks documents by tokens of one Hugging Face tokenizer.

    ``tokenizer`` may be a ``transformers`` tokenizer (fast or slow) or a raw
    ``tokenizers.Tokenizer``. Fast tokenizers use the splitter's native path
    (a private copy of the Rust tokenizer with truncation and padding off, so
    the caller's tokenizer is never modified; :func:`private_tokenizer` makes
    one that several chunkers can share, skipping a copy each); slow ones are
    called back from Rust, which works but is much slower.
    """

    def __init__(
        self,
        tokenizer: Any,
        chunk_tokens: int = 512,
        overlap_tokens: int = 0,
        *,
        section_chars: int = SECTION_CHARS,
    ) -> None:
        if chunk_tokens < 1 or not 0 <= overlap_tokens < chunk_tokens:
            raise ValueError(f"bad chunk_tokens={chunk_tokens} / overlap_tokens={overlap_tokens}")
        self.chunk_tokens = chunk_tokens
        self.overlap_tokens = overlap_tokens
        self.section_chars = section_chars
        backend = tokenizer if isinstance(tokenizer, PrivateTokenizer) else private_tokenizer(tokenizer)
        self._backend = backend
        if backend is not None:
            rust = backend.tokenizer
            self._splitter = TextSplitter.from_huggingface_tokenizer(rust, chunk_tokens, overlap=overlap_tokens)
            self._count: Callable[[list[str]], list[int]] = lambda texts: [
                len(e.ids) for e in rust.encode_batch(texts, add_special_tokens=False)
            ]
        else:
            def count_one(text: str) -> int:
                return len(tokenizer.encode(text, add_special_tokens=False))

            self._splitter = TextSplitter.from_callback(count_one, chunk_tokens, overlap=overlap_tokens)
            self._count = lambda texts: [count_one(t) for t in texts]

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Token count of each text (no special tokens)."""
        return self._count(list(texts)) if texts else []

    def chunk(self, document: str) -> tuple[Chunk, ...]:
        """Chunks of ``document`` in order; see the module docstring for the contract."""
        sections = split_sections(document, self.section_chars)
        pieces: list[tuple[int, str]] = []
        if len(sections) == 1:
            pieces = list(self._splitter.chunk_indices(document))
        else:
            results = self._splitter.chunk_all_indices([document[a:b] for a, b in sections])
            for (section_start, _), found in zip(sections, results):
                pieces.extend((section_start + offset, text) for offset, text in found)
        counts = self.count_tokens([text for _, text in pieces])
        chunks = tuple(
            Chunk(index=i, text=text, char_start=start, char_end=start + len(text), num_tokens=n)
            for i, ((start, text), n) in enumerate(zip(pieces, counts))
        )
        for c in chunks:
            # The splitter reports str (code point) offsets; guard the contract cheaply.
            if document[c.char_start : c.char_end] != c.text:
                raise AssertionError(f"chunk {c.index} span {c.span} does not match its text")
        oversized = sum(c.num_tokens > self.chunk_tokens for c in chunks)
        if oversized:
            logger.warning("%d chunk(s) exceed %d tokens (single characters too long to split)", oversized, self.chunk_tokens)
        return chunks


@functools.lru_cache(maxsize=1)
def splitter_version() -> str:
    """The installed ``semantic-text-splitter`` version (stored chunks name it: another version may cut otherwise)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("semantic-text-splitter")
    except PackageNotFoundError:
        return "unknown"


def split_sections(document: str, section_chars: int) -> list[tuple[int, int]]:
    """Cut ``document`` into ``(start, end)`` sections of at most ~``section_chars``.

    Each cut is placed right after the last ``"\\n\\n"`` (else ``"\\n"``, else
    ``" "``) in the second half of the window, or at the window's end if the
    window has none. Sections tile the document exactly.

    Example: ``split_sections("aaaa\\n\\nbbbb\\n\\ncc", 8) == [(0, 6), (6, 14)]``.
    """
    if section_chars < 2 or len(document) <= section_chars:
        return [(0, len(document))]
    sections: list[tuple[int, int]] = []
    start = 0
    while len(document) - start > section_chars:
        end = start + section_chars
        low = start + section_chars // 2
        for sep in ("\n\n", "\n", " "):
            found = document.rfind(sep, low, end)
            if found != -1:
                end = found + len(sep)
                break
        sections.append((start, end))
        start = end
    sections.append((start, len(document)))
    return sections


@dataclass(frozen=True)
class PrivateTokenizer:
    """A ``tokenizers.Tokenizer`` copy without truncation or padding, which chunkers may share (only encoding)."""

    tokenizer: Any


def private_tokenizer(tokenizer: Any) -> PrivateTokenizer | None:
    """A private copy of ``tokenizer``'s Rust tokenizer (None for a slow tokenizer): copying it costs tens of ms."""
    from tokenizers import Tokenizer

    backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None
    backend = copy.deepcopy(backend)
    backend.no_truncation()
    backend.no_padding()
    return PrivateTokenizer(backend)
