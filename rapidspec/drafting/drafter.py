"""The drafter of one generation: its own prompt, cache and token sequence.

In the spirit of transformers' ``CandidateGenerator`` and llama.cpp's
``common_speculative``, the :class:`Drafter` protocol hides how drafts are
made behind the calls the engine's loop makes every round::

    proposal = drafter.propose(k, config, generator, stop_tokens, processors)   # step 2
    ... the target verifies proposal.tokens (step 3, sampling.verify, step 4)
    drafter.bonus_row(config, stop_tokens, sync, processors)   # only when verification leaves the bonus token open
    drafter.commit(emitted)                  # step 5: roll back to the committed tokens
    drafter.close(keep)                      # after the last round

:class:`ModelDrafter` drafts with a language model over any key/value cache
that follows the runtime's protocol (``forward``, ``prefill``, ``crop``,
``length``, ``token_ids``, ``device``): a torch cache
(:func:`rapidspec.runtime.new_kv_cache`) or a llama.cpp context
(:mod:`rapidspec.runtime.llama_cpp`). :class:`~rapidspec.drafting.lookup.LookupDrafter`
drafts without a model. Which drafter a mode uses is in :mod:`.modes` and
:mod:`.factory`; where caches come from (and are kept across questions) is in
:mod:`.backends`.

Convention (as the target's cache): after ``commit`` the cache holds a prefix
of ``sequence``; the rest (usually the last token, more after plain rounds)
is fed at the start of the next forward (*pending* tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from rapidspec.verification import sampling
from rapidspec.verification.processors import NO_PROCESSORS, LogitsProcessors


@dataclass(frozen=True)
class Proposal:
    """Drafted tokens and the drafter's rows at their positions.

    ``rows``: [r, V] on the target's device: q (sampling; r = len(tokens)) or
    the raw logits (greedy with eta > 0; r = len(tokens)); None when nothing
    downstream reads them (greedy with eta = 0, or no drafts).
    """

    tokens: list[int]
    rows: torch.Tensor | None = None
    forwards: int = 0  # drafter forward passes it took
    caught_up: int = 0  # tokens its first forward fed before drafting (the pending ones; many after plain rounds)


NO_PROPOSAL = Proposal([])


@runtime_checkable
class Drafter(Protocol):
    """What the engine uses of a drafter (model drafters, lookup, and any new kind).

    ``sequence``: the drafter's prompt then the committed answer tokens;
    ``vocab_size``: the logits both models share; ``cache``: the key/value
    cache drafting reads (None without a model); ``device``: where it computes
    (its cache's device; the target's without a cache); ``bonus_seconds``: the
    time the last :meth:`bonus_row` took.
    """

    sequence: list[int]
    vocab_size: int
    bonus_seconds: float

    @property
    def cache(self): ...

    @property
    def device(self) -> torch.device: ...

    def propose(self, k: int, config, generator: torch.Generator, stop_tokens: frozenset[int],
                processors: LogitsProcessors = NO_PROCESSORS) -> Proposal:
        """Up to ``k`` drafted tokens after the committed ones, with their rows (:class:`Proposal`).

        ``processors`` (:mod:`rapidspec.verification.processors`) process each row after the committed answer
        and the drafts before it: with a grammar every draft is one it allows, and the rows are masked by it;
        with penalties each row is penalised for the answer so far.
        """
        ...

    def bonus_row(self, config, stop_tokens: frozenset[int], sync: bool = False,
                  processors: LogitsProcessors = NO_PROCESSORS) -> torch.Tensor | None:
        """The row at the position after the last draft ([V], processed by ``processors``), or None when there
        is none."""
        ...

    def commit(self, emitted: list[int]) -> None:
        """Append the round's emitted tokens and roll back to them."""
        ...

    def close(self, keep: bool = True) -> None:
        """The generation is over (``keep=False``: after an error, drop what may be half-written)."""
        ...


def draft_row(logits: torch.Tensor, config, device: torch.device) -> torch.Tensor:
    """What verification keeps of a drafter position ([V] -> [V] on ``device``).

    Greedy: the raw logits (q is taken at T = 1 by :func:`sampling.verify`).
    Sampling: q, the logits at the temperature, then filtered (HF's order), normalised.
    """
    if config.greedy:
        return logits.to(device)
    scaled = logits[None].to(device) / config.temperature  # [1, V]
    return sampling.filter_logits(scaled, config.top_k, config.top_p).softmax(-1)[0]


class ModelDrafter:
    """Drafts with a language model over ``cache``, which already holds ``sequence[:-1]`` (or a prefix of it).

    ``vocab_size`` cuts logits to the vocabulary both models share;
    ``target_device`` is where rows go. :attr:`bonus_seconds` is the time the
    last :meth:`bonus_row` took (0 when it was not called since the last
    :meth:`propose`).
    """

    def __init__(self, cache, sequence: list[int], vocab_size: int, target_device: torch.device, on_close=None) -> None:
        self.cache = cache
        self.sequence = list(sequence)
        self.vocab_size = vocab_size
        self.target_device = target_device
        self.bonus_seconds = 0.0
        self._drafts: list[int] = []
        self._on_close = on_close

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def _next_logits(self, token_ids: list[int], processors: LogitsProcessors) -> torch.Tensor:
        logits = self.cache.forward(token_ids, 1)[0, : self.vocab_size]  # [V]
        return processors.row_after(logits, self._drafts)  # the position after the drafts so far

    def propose(self, k: int, config, generator: torch.Generator, stop_tokens: frozenset[int],
                processors: LogitsProcessors = NO_PROCESSORS) -> Proposal:
        """Feed the pending tokens, then draft up to ``k`` tokens one by one (the last one is not fed).

        Drafting stops early after a token in ``stop_tokens`` (nothing follows
        an EOS) or, with ``config.draft_confidence``, after an unsure draft.
        Each position's logits go through ``processors`` (a grammar's mask, penalties) before the draft is
        chosen.
        """
        self.bonus_seconds = 0.0
        self._drafts = []
        if k <= 0:
            return NO_PROPOSAL
        keep_rows = not config.greedy or config.eta_value > 0
        confidence = config.draft_confidence
        rows: list[torch.Tensor] = []  # each [V] on the target's device
        pending = self.sequence[self.cache.length :]
        logits = self._next_logits(pending, processors)  # [V]
        forwards = 1
        for position in range(k):
            if keep_rows:
                rows.append(draft_row(logits, config, self.target_device))
            if config.greedy:
                token = int(logits.argmax())
                unsure = confidence > 0 and sampling.top_probability(logits) < confidence
            else:
                token = int(sampling.sample(rows[-1][None], generator)[0])
                unsure = confidence > 0 and float(rows[-1][token]) < confidence
            self._drafts.append(token)
            if position == k - 1 or unsure or token in stop_tokens:
                break
            logits = self._next_logits([token], processors)
            forwards += 1
        return Proposal(list(self._drafts), torch.stack(rows) if rows else None, forwards, len(pending))

    def bonus_row(self, config, stop_tokens: frozenset[int], sync: bool = False,
                  processors: LogitsProcessors = NO_PROCESSORS) -> torch.Tensor | None:
        """The row after the last draft ([V], through ``processors``), or None after a stopping draft.

        Feeding the last draft costs nothing extra when it is accepted: the
        next round would feed it anyway. ``sync``: wait for the device, so
        :attr:`bonus_seconds` is exact (profiling, the ``cost`` schedule).
        """
        if self._drafts and self._drafts[-1] in stop_tokens:
            return None
        started = time.perf_counter()
        logits = self._next_logits((self.sequence + self._drafts)[self.cache.length :], processors)
        row = draft_row(logits, config, self.target_device)
        if sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.bonus_seconds = time.perf_counter() - started
        return row

    def commit(self, emitted: list[int]) -> None:
        """Append the emitted tokens and roll the cache back to the committed ones (minus the pending last)."""
        self.sequence.extend(emitted)
        self.cache.crop(min(self.cache.length, len(self.sequence) - 1))

    def close(self, keep: bool = True) -> None:
        """Hand the cache back to the backend that made it (it may serve the next prompt's common prefix).

        ``keep=False`` after an error: the cache may be half-written, so it is dropped.
        """
        if self._on_close is not None and keep:
            self._on_close(self.cache)
        self._on_close = None
