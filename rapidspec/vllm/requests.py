"""vLLM's running requests as the proposer keeps them: one drafter each, found again by its tokens.

vLLM hands the proposer one row per running request each step, in an order
that changes as requests come and go. A :class:`RequestDrafts` is found again
by what it saw: the row whose tokens (prompt and answer so far) start with
the tokens it saw last step (:meth:`Requests.match`; two requests with the
same tokens so far are interchangeable). A request missing from a step has
finished (or was preempted: it starts anew if it comes back); its drafter
cache goes back to its pool, which may hand it to the next request with the
same document.
"""

from __future__ import annotations

import numpy as np

from rapidspec.drafting.drafter import NO_PROPOSAL
from rapidspec.drafting.gamma_schedule import CostSchedule, StepCosts, expected_round_seconds, expected_tokens
from rapidspec.runtime.cache import common_prefix_length
from rapidspec.stats import RoundRecord

#: Tokens of a request's start that index it (the rest is compared when a row is matched).
KEY_TOKENS = 64


class RequestDrafts:
    """The drafter of one vLLM request, fed the tokens vLLM accepted since the last step.

    ``prompt_tokens``: the length of vLLM's prompt; ``drafter``: a
    :class:`~rapidspec.drafting.drafter.ModelDrafter` over the drafter's own
    prompt (None: the request gets no drafts); ``schedule``: how many tokens to draft each step (None: always
    the most vLLM takes).
    """

    def __init__(self, tokens: np.ndarray, prompt_tokens: int, drafter, schedule: CostSchedule | None) -> None:
        self.seen = np.array(tokens, dtype=np.int64)  # [n] the request's tokens as of the last step
        self.prompt_tokens = prompt_tokens
        self.drafter = drafter
        self.schedule = schedule
        self.drafts: list[int] = []  # proposed last step
        self.preparing = None  # a Future of the drafter while it is prepared beside vLLM's steps
        self.drafted = self.accepted = self.rounds = 0  # totals over the request (drafting rounds only)
        if drafter is not None:
            drafter.commit([int(t) for t in self.seen[prompt_tokens:]])

    @property
    def key(self) -> tuple[int, bytes]:
        """(length, bytes) of the prompt's first tokens, at most :data:`KEY_TOKENS` of them."""
        length = min(KEY_TOKENS, self.prompt_tokens)
        return length, self.seen[:length].tobytes()

    def extends(self, tokens: np.ndarray) -> bool:
        """Whether ``tokens`` (a row's) start with what this request saw last step."""
        return len(tokens) >= len(self.seen) and np.array_equal(tokens[: len(self.seen)], self.seen)

    def advance(self, tokens: np.ndarray) -> None:
        """Take the row's ``tokens``: count how many of last step's drafts vLLM kept and feed the new tokens."""
        new = [int(t) for t in tokens[len(self.seen):]]
        if self.drafts:
            kept = min(common_prefix_length(new, self.drafts), len(self.drafts), max(len(new) - 1, 0))
            self.drafted, self.accepted, self.rounds = self.drafted + len(self.drafts), self.accepted + kept, self.rounds + 1
            if self.schedule is not None:
                self.schedule.record(RoundRecord(len(self.drafts), kept, 0.0, 0, 0.0, 0.0, len(self.drafts) + 1))
        elif self.schedule is not None and new:
            self.schedule.record(RoundRecord(0, 0, 0.0, 0, 0.0, 0.0, 1))
        self.drafts = []
        self.seen = np.array(tokens, dtype=np.int64)
        if new and self.drafter is not None:
            self.drafter.commit(new)
            cache = self.drafter.cache  # keep only what matches the committed tokens (a draft vLLM did not keep)
            cache.crop(min(cache.length, common_prefix_length(cache.token_ids, self.drafter.sequence)))

    def propose(self, most: int, config, generator, stop_tokens: frozenset[int], costs: StepCosts,
                plain_step: float | None = None):
        """A :class:`~rapidspec.drafting.drafter.Proposal` of up to ``most`` drafts after the tokens seen (fewer
        where the schedule expects a round not to pay). ``plain_step``: seconds of a vLLM step without drafts
        (:mod:`.costs`): a round the schedule chose, other than a probe, is dropped when a plain step is expected
        to give more tokens per second."""
        k = most
        if self.schedule is not None:
            self.schedule.costs = costs
            k = min(most, self.schedule.next_drafts())
            if k > 0 and plain_step is not None and not self.schedule.probed:
                acceptance = self.schedule.acceptance()
                rate = expected_tokens(acceptance, k) / expected_round_seconds(k, acceptance, costs, False)
                k = 0 if rate * plain_step < 1 else k
        proposal = self.drafter.propose(k, config, generator, stop_tokens) if k > 0 else NO_PROPOSAL
        self.drafts = proposal.tokens
        return proposal

    def join_if_ready(self) -> None:
        """Take the drafter prepared beside vLLM's steps once it is ready, fed the answer so far."""
        if self.preparing is None or not self.preparing.done():
            return
        self.drafter, self.preparing = self.preparing.result(), None
        if self.drafter is not None:
            self.drafter.commit([int(t) for t in self.seen[self.prompt_tokens:]])

    def close(self) -> None:
        if self.preparing is not None:  # the drafter goes back to its pool once it is ready
            self.preparing.add_done_callback(lambda done: done.result() and done.result().close(keep=True))
        elif self.drafter is not None:
            self.drafter.close(keep=True)


class Requests:
    """The running requests' :class:`RequestDrafts`, indexed by their first :data:`KEY_TOKENS` tokens."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[int, bytes], list[RequestDrafts]] = {}

    def __len__(self) -> int:
        return sum(len(group) for group in self._by_key.values())

    def match(self, tokens: np.ndarray, taken: set[int]) -> RequestDrafts | None:
        """The request ``tokens`` continue (the one that saw the most, not in ``taken``: ids already matched
        this step), or None for a new request."""
        row = np.asarray(tokens, dtype=np.int64)
        lengths = {length for length, _ in self._by_key}
        found = [r for length in lengths for r in self._by_key.get((length, row[:length].tobytes()), [])
                 if id(r) not in taken and r.extends(row)]
        return max(found, key=lambda r: len(r.seen)) if found else None

    def add(self, request: RequestDrafts) -> None:
        self._by_key.setdefault(request.key, []).append(request)

    def finished(self, running: set[int]) -> list[RequestDrafts]:
        """Close and return the requests whose ids are not in ``running`` (they have ended)."""
        ended = []
        for key in list(self._by_key):
            group = self._by_key[key]
            for request in [r for r in group if id(r) not in running]:
                request.close()
                group.remove(request)
                ended.append(request)
            if not group:
                del self._by_key[key]
        return ended
