"""Turn a growing list of token ids into streamed text, honouring stop strings.

Text is released only when it is final: a trailing partial UTF-8 character
(decoded as U+FFFD) or a suffix that could be the start of a stop string is
held back until the next tokens decide it.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextAssembler:
    """Accumulates tokens; ``add`` returns the new releasable text."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._token_ids: list[int] = []
        self._released = ""
        self._final: str | None = None

    @property
    def text(self) -> str:
        """The whole answer so far (final once stopped or flushed)."""
        return self._final if self._final is not None else self._decoded()

    def _decoded(self) -> str:
        return self.tokenizer.decode(self._token_ids, skip_special_tokens=True)

    def _release(self, upto: str) -> str:
        if not upto.startswith(self._released):
            return ""  # the decoder revised earlier text; the final text will still be exact
        new = upto[len(self._released) :]
        self._released = upto
        return new

    def add(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Add tokens; return (text now safe to show, whether a stop string was hit)."""
        self._token_ids.extend(token_ids)
        full = self._decoded()
        hits = [full.find(s) for s in self.stop if s in full]
        if hits:
            self._final = full[: min(hits)]
            return self._release(self._final), True
        safe = full.rstrip("\ufffd")
        hold = 0
        for s in self.stop:
            for size in range(min(len(s) - 1, len(safe)), 0, -1):
                if safe.endswith(s[:size]):
                    hold = max(hold, size)
                    break
        return self._release(safe[: len(safe) - hold]), False

    def flush(self) -> str:
        """Release everything held back (at the end of generation)."""
        self._final = self._decoded()
        return self._release(self._final)
