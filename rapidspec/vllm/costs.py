"""The step costs the proposer's ``cost`` schedule reads, measured as vLLM runs.

rapidspec's own engine calibrates its target's forward before it decodes
(:mod:`rapidspec.drafting.calibration`); inside vLLM the target is vLLM's, so
its cost is measured from outside: a vLLM step is the time from the end of
one ``propose`` call to the start of the next (its forward over every running
request's drafts, and its sampling). Steps that verify drafts are fitted as
``base + per_token * n`` over the tokens ``n`` they verify (least squares,
recent steps weighing most); steps without drafts are averaged apart, since
a step that verifies several tokens of a request can cost far more than a
plain one (vLLM 0.32 on a 2-core CPU: 90 ms for one token of the built-in
model at 7K tokens, about 150-300 ms with drafts). A drafter forward's cost
is the drafting time over the forwards it took. Before anything is measured
drafting is taken as free, so the first steps draft as many tokens as vLLM
takes.

Unlike rapidspec's calibrated costs these follow the machine's load, so the
number of drafts of a step can differ between two runs of one request; the
answer cannot: vLLM verifies every draft.
"""

from __future__ import annotations

import time

from rapidspec.drafting.gamma_schedule import StepCosts

#: Each new observation weighs 1, older ones this factor less per observation (about 20 steps' memory).
DECAY = 0.95
#: verify(1) when the fit says otherwise (StepCosts needs it above 0).
FLOOR_SECONDS = 1e-6


class DecayedLine:
    """Weighted least squares of ``y = base + slope * x`` (slope >= 0), older points decayed by :data:`DECAY`."""

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0  # decayed sums of 1, x, y, x^2, xy

    def add(self, x: float, y: float) -> None:
        self.w, self.x, self.y = DECAY * self.w + 1, DECAY * self.x + x, DECAY * self.y + y
        self.xx, self.xy = DECAY * self.xx + x * x, DECAY * self.xy + x * y

    def fit(self) -> tuple[float, float]:
        """(base, slope); (0, 0) before any point."""
        if self.w == 0:
            return 0.0, 0.0
        spread = self.w * self.xx - self.x * self.x
        slope = max(0.0, (self.w * self.xy - self.x * self.y) / spread) if spread > 1e-9 * self.w * self.w else 0.0
        return (self.y - slope * self.x) / self.w, slope


class StepClock:
    """Measures vLLM's steps and the drafter's forwards (module docstring)."""

    def __init__(self) -> None:
        self.verify = DecayedLine()  # steps that verify drafts
        self.plain = self.plain_weight = 0.0  # decayed sums of the seconds and count of steps without drafts
        self.draft_seconds = self.draft_forwards = 0.0  # decayed sums
        self._step_ended: float | None = None  # when the last propose call returned
        self._verified = 0  # tokens the step after it verifies: one per request, plus its drafts
        self._drafts = False  # whether that step verifies any draft

    def step_started(self) -> None:
        """A propose call begins: the vLLM step since the last one ends."""
        now = time.perf_counter()
        if self._step_ended is not None and self._verified > 0:
            if self._drafts:
                self.verify.add(self._verified, now - self._step_ended)
            else:
                self.plain = DECAY * self.plain + now - self._step_ended
                self.plain_weight = DECAY * self.plain_weight + 1
        self._step_ended = None

    def step_ended(self, verified: int, drafts: bool) -> None:
        """A propose call returns; vLLM's next step verifies ``verified`` tokens, drafts among them or not."""
        self._step_ended, self._verified, self._drafts = time.perf_counter(), verified, drafts

    def plain_step(self) -> float | None:
        """Seconds of a step without drafts, None before one was measured."""
        return self.plain / self.plain_weight if self.plain_weight else None

    def drafted(self, forwards: int, seconds: float) -> None:
        if forwards > 0:
            self.draft_seconds = DECAY * self.draft_seconds + seconds
            self.draft_forwards = DECAY * self.draft_forwards + forwards

    def costs(self) -> StepCosts:
        """The costs now: free drafting and a one-second step before anything is measured."""
        base, per_token = self.verify.fit()
        if self.verify.w == 0:
            base, per_token = 1.0, 0.0
        draft = self.draft_seconds / self.draft_forwards if self.draft_forwards else 0.0
        return StepCosts(draft, max(base, FLOOR_SECONDS), per_token)
