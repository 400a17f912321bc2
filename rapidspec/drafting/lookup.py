"""Prompt-lookup drafting (mode ``lookup``): drafts copied from the text itself, no model.

The free baseline users would otherwise pick (transformers'
``prompt_lookup_num_tokens``, vLLM's ``ngram`` speculator): find the latest
earlier occurrence of the last n tokens (n from :data:`MAX_NGRAM` down to
:data:`MIN_NGRAM`, or the drafter's ``min_ngram``) in what the drafter reads, the retrieved context and the
answer so far, and propose the tokens that followed it. No match: no drafts,
the round is a plain target step.

The proposal is deterministic given the sequence, so q is a point mass on
each draft: sampling accepts draft x with probability p(x) and resamples
from p without x, which keeps every token distributed as p (lossless; the
mode allows no eta). Worked example, n = 2: sequence ``a b c d a b`` ends
with ``a b``, which occurred at positions 0-1 followed by ``c d a b``, so
k = 3 proposes ``c d a``.
"""

from __future__ import annotations

import torch

from rapidspec.drafting.drafter import NO_PROPOSAL, Proposal
from rapidspec.verification.processors import NO_PROCESSORS, LogitsProcessors

MAX_NGRAM = 3
MIN_NGRAM = 1
#: The shortest match of the lookup rounds a model drafter's generation runs before the drafter joins: one-token
#: matches proposed drafts that were kept about a third of the time, and their rounds cost more than they saved
#: (``benchmarks/lookup_rounds.py``; docs/speed.md, "Lookup rounds match two tokens or more").
ROUNDS_MIN_NGRAM = 2


class LookupDrafter:
    """Drafts by n-gram match over ``sequence`` (prompt token ids, then the answer as it grows).

    Follows the :class:`~rapidspec.drafting.drafter.Drafter` protocol: no cache, no rows, no bonus row.
    """

    cache = None  # no model, no cache
    bonus_seconds = 0.0

    def __init__(self, sequence: list[int], vocab_size: int, target_device: torch.device,
                 min_ngram: int = MIN_NGRAM) -> None:
        if not MIN_NGRAM <= min_ngram <= MAX_NGRAM:
            raise ValueError(f"min_ngram must be in [{MIN_NGRAM}, {MAX_NGRAM}], got {min_ngram}")
        self.sequence = list(sequence)
        self.min_ngram = min_ngram
        self.vocab_size = vocab_size
        self.target_device = target_device
        # For each n, the n-gram ending just before index e -> the latest such e (continuation starts there).
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, MAX_NGRAM + 1)}
        self._indexed = 0  # n-grams ending before indices < _indexed are registered

    @property
    def device(self) -> torch.device:
        """Where its (empty) rows live: the target's device."""
        return self.target_device

    def _index(self, upto: int) -> None:
        """Register the n-grams ending before indices in [_indexed, upto)."""
        seq = self.sequence
        for end in range(max(self._indexed, self.min_ngram), upto):
            for n, table in self._latest.items():
                if end >= n:
                    table[tuple(seq[end - n : end])] = end
        self._indexed = max(self._indexed, upto)

    def continuation(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier match of the longest matching suffix."""
        length = len(self.sequence)
        self._index(length)  # occurrences ending before the last index: the suffix itself is not one
        for n in range(MAX_NGRAM, self.min_ngram - 1, -1):
            if length <= n:
                continue
            start = self._latest[n].get(tuple(self.sequence[length - n :]))
            if start is not None and start < length:
                return self.sequence[start : start + k]
        return []

    def propose(self, k: int, config, generator, stop_tokens: frozenset[int],
                processors: LogitsProcessors = NO_PROCESSORS) -> Proposal:
        """The continuation of the latest match, cut before a token the grammar (when ``processors`` has one) forbids."""
        if k <= 0:
            return NO_PROPOSAL
        found = self.continuation(k)
        found = found[: processors.allowed_prefix(found)]
        tokens = []
        for token in found:
            if token >= self.vocab_size:
                break
            tokens.append(token)
            if token in stop_tokens:
                break
        if not tokens:
            return NO_PROPOSAL
        rows = None
        if not config.greedy:  # q is a point mass on each draft
            rows = torch.zeros(len(tokens), self.vocab_size, device=self.target_device)  # [k, V]
            rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        return Proposal(tokens, rows, 0)

    def bonus_row(self, config, stop_tokens: frozenset[int], sync: bool = False,
                  processors: LogitsProcessors = NO_PROCESSORS) -> None:
        return None  # eta is 0 in mode lookup: p^ = p needs no q

    def commit(self, emitted: list[int]) -> None:
        self.sequence.extend(emitted)

    def close(self, keep: bool = True) -> None:
        pass  # nothing is kept
