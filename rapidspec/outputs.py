"""What a generation yields: streamed chunks, and the output with its statistics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from rapidspec.config import DecodeConfig
from rapidspec.stats import GenerationStats, RoundRecord


@dataclass(frozen=True)
class GenerationOutput:
    """The answer of one generation with everything measured about it."""

    text: str
    token_ids: tuple[int, ...]
    stats: GenerationStats
    config: DecodeConfig
    retrieval: object | None = None  # rapidspec.retrieval.RetrievalResult for retrieving modes
    retrieved_turns: tuple[int, ...] = ()  # chat messages the drafter read from the history
    logprobs: tuple | None = None  # TokenLogprob per answer token when DecodeConfig.logprobs is set

    def to_dict(self) -> dict:
        out = {
            "text": self.text,
            "mode": self.config.mode,
            "stats": self.stats.to_dict(),
            "retrieval": self.retrieval.to_dict() if self.retrieval is not None else None,
        }
        if self.retrieved_turns:
            out["retrieved_turns"] = list(self.retrieved_turns)
        return out


@dataclass(frozen=True)
class StreamChunk:
    """New text and tokens of one step; the last chunk carries the full output.

    ``round``: the draft/verify round that emitted ``token_ids`` (its first
    ``round.accepted`` tokens are accepted drafts, a next one the target's own
    choice: :func:`token_kinds`). ``prefill``: (prompt tokens the target
    holds, its prompt tokens) on the empty chunk after each prefill chunk.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    output: GenerationOutput | None = field(default=None, repr=False)
    logprobs: tuple = ()  # TokenLogprob per token of token_ids when DecodeConfig.logprobs is set
    round: RoundRecord | None = None
    prefill: tuple[int, int] | None = None


def token_kinds(chunk: StreamChunk) -> list[str]:
    """How each of a chunk's tokens came: ``accepted`` (a draft the target kept), ``recovered`` (the target's
    token where it rejected a draft), ``bonus`` (the target's token after every draft was kept) or ``plain``
    (a round without drafts)."""
    record, count = chunk.round, len(chunk.token_ids)
    if record is None:
        return ["plain"] * count
    own = "plain" if record.drafted == 0 else "bonus" if record.accepted == record.drafted else "recovered"
    return ["accepted" if i < record.accepted else own for i in range(count)]


def last_output(chunks: Iterator[StreamChunk]) -> GenerationOutput:
    """The final output of a stream (consumed to the end)."""
    output = None
    for chunk in chunks:
        output = chunk.output or output
    assert output is not None
    return output


def timed_output(chunks: Iterator[StreamChunk]) -> tuple[GenerationOutput, float | None, float]:
    """(final output, wall-clock seconds to the first chunk with tokens or None, seconds to the end) of a stream
    consumed to the end, timed from this call (a generator's work starts at its first chunk)."""
    started, first, output = time.perf_counter(), None, None
    for chunk in chunks:
        if first is None and chunk.token_ids:
            first = time.perf_counter() - started
        output = chunk.output or output
    assert output is not None
    return output, first, time.perf_counter() - started
