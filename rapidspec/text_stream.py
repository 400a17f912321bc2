"""Turn a growing list of token ids into streamed text, honouring stop strings.

Text is released only when it is final: a trailing partial UTF-8 character
(decoded as U+FFFD) or a suffix that could be the start of a stop string is
held back until the next tokens decide it. Decoding never applies the
tokenizer's clean-up of spaces, which can rewrite earlier text as tokens
arrive; so the streamed text only grows and equals the final text. A stop
string ends the answer at its first character, and the tokens after the one
that completed it are dropped (:attr:`TextAssembler.kept`).
:func:`cut_answer` cuts a round's tokens at an end-of-sequence token and at
the length limit.
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
        self.kept = 0  # tokens of the last ``add`` that belong to the answer (fewer after a stop string)

    @property
    def text(self) -> str:
        """The whole answer so far (final once stopped or flushed)."""
        return self._final if self._final is not None else self._decoded()

    def _decoded(self, token_ids: Sequence[int] | None = None) -> str:
        ids = self._token_ids if token_ids is None else token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _release(self, upto: str) -> str:
        # Only ever the text past what was released: should a decoder still revise earlier text, the
        # stream goes on (the client keeps its version of the revised part) instead of stalling.
        new = upto[len(self._released) :]
        self._released = upto
        return new

    def add(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Add tokens; return (text now safe to show, whether a stop string was hit)."""
        before = len(self._token_ids)
        self._token_ids.extend(token_ids)
        self.kept = len(token_ids)
        full = self._decoded()
        hits = [full.find(s) for s in self.stop if s in full]
        if hits:
            self._final = full[: min(hits)]
            # the fewest new tokens whose text already holds a stop string; the rest are not part of the answer
            self.kept = next(n for n in range(1, len(token_ids) + 1)
                             if any(s in self._decoded(self._token_ids[: before + n]) for s in self.stop))
            del self._token_ids[before + self.kept :]
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


def cut_answer(emitted: list[int], remaining: int, stop_tokens: frozenset[int]) -> tuple[list[int], str]:
    """``emitted`` up to an EOS and to ``remaining`` tokens, and why generation finishes ("" = it goes on)."""
    finished = ""
    for index, token in enumerate(emitted):
        if token in stop_tokens:
            emitted, finished = emitted[:index], "eos"
            break
    if len(emitted) >= remaining:
        emitted, finished = emitted[:remaining], finished or "length"
    return emitted, finished
