"""How many tokens to draft each round: the schedules of ``DecodeConfig.gamma_schedule``.

``auto`` (the default) is ``cost``, or ``constant`` when the request has a seed.

* ``constant``: always ``gamma``.
* ``heuristic``: transformers' assisted-generation rule: +2 after a round that
  kept every draft, -1 otherwise, within [1, ``max_gamma``].
* ``cost``: a cost model, so that a round is never expected to cost more per
  token than a plain target step. Measured as the generation runs:

      d          seconds per drafter forward (one drafted token)
      v(n)       seconds to verify n tokens (target forward + acceptance math),
                 a weighted least-squares line base + per_token * n through the
                 running median of each n
      a_i        P(draft i accepted | drafts 1..i-1 accepted), from decayed
                 counts with a weak Beta prior

  A round of k drafts then emits on average E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j
  tokens and costs C(k) = k * d + v(k + 1) (+ d * prod_{j<=k} a_j when eta > 0:
  the drafter forward at the bonus position). The schedule drafts the k in
  [0, max_gamma] with the most tokens per second E(k) / C(k) (measured costs:
  at most EXTRAPOLATE_TOKENS more verified tokens than any round so far); k = 0 is a
  plain target step (E = 1, C = v(1)), so speculation has to beat it: a round
  is never expected to cost more per token than a plain step.

A schedule answering 0 asks the engine for a plain step: one target forward,
the token drawn from p, no drafter forward. With eta > 0 that token follows p,
not p^ (p^ needs the drafter's q at its position, which costs the drafter
forward the plain step is there to save); tokens of rounds that draft follow
p^ as always. Only ``cost`` answers 0, and only when it expects every drafting
round to be slower per token than the target alone: where the drafter's view
does not fit the answer (acceptance low) or drafting is dear.

The engine asks :meth:`next_drafts` before a round and reports the round to
:meth:`record`; the math below is pure functions so it can be checked by hand.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rapidspec.errors import RapidspecError
from rapidspec.stats import RoundRecord

# Beta prior of each a_i: this many pseudo-observations with mean FIRST_POSITION_PRIOR
# for a_1 and the estimate of a_{i-1} for a_i (deeper positions, seen less often,
# lean on their neighbour).
ACCEPTANCE_PRIOR_STRENGTH = 1.0
FIRST_POSITION_PRIOR = 0.5
# Before every drafting round the acceptance counts are multiplied by this, so an
# observation k rounds old weighs ACCEPTANCE_DECAY**k (about 10 rounds' memory).
ACCEPTANCE_DECAY = 0.9
# Running medians: verify seconds over the last VERIFY_WINDOW rounds that verified n
# tokens (per n), drafter seconds per forward over the last DRAFT_WINDOW rounds.
VERIFY_WINDOW = 8
DRAFT_WINDOW = 16
# After PROBE_EVERY - 1 plain rounds in a row the next round drafts PROBE_DRAFTS
# tokens, so the acceptance estimates can recover. A probe after which the costs
# still choose a plain step doubles the interval (up to MAX_PROBE_EVERY); a
# round the costs choose to draft resets it. Worst case: the probes' drafter
# steps (and the drafter's catch-up on the plain rounds' tokens) for nothing,
# once in 8, 16, 32, then every 64 rounds (on a 7K-token document a probe
# every 8 rounds cost about 10% of lc's speed).
PROBE_EVERY = 8
MAX_PROBE_EVERY = 64
PROBE_DRAFTS = 2
# A drafter step's cost d is measured on rounds whose first drafter forward fed at most this
# many tokens: after plain rounds the drafter first catches up on every token it missed, in
# one forward that costs several steps, and counting it as one step made d look dearer than
# it is (on a 26K-token document probes then never showed that drafting pays).
CATCH_UP_TOKENS = 2
# Measured costs plan rounds verifying at most this many tokens more than the largest
# round measured so far: the straight line v(n) is only trusted near its data (on the
# built-in model it underestimated long verifies and the schedule drafted too long).
EXTRAPOLATE_TOKENS = 2


@dataclass(frozen=True)
class StepCosts:
    """Seconds of a drafter forward and of verifying n tokens: ``verify(n) = verify_base + verify_per_token * n``."""

    draft_step: float
    verify_base: float
    verify_per_token: float

    def __post_init__(self) -> None:
        if not all(math.isfinite(x) for x in (self.draft_step, self.verify_base, self.verify_per_token)):
            raise RapidspecError("step costs must be finite numbers")
        if self.draft_step < 0 or self.verify_per_token < 0 or self.verify(1) <= 0:
            raise RapidspecError(f"step costs must be >= 0 with verify(1) > 0, got {self}")

    def verify(self, tokens: int) -> float:
        return self.verify_base + self.verify_per_token * tokens


# ----------------------------------------------------------------- pure math
def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j, tokens a round of k drafts emits on average.

    ``acceptance``: [>= k] conditional acceptance a_1, a_2, ...
    Example: a = [0.8, 0.5], k = 2 -> 1 + 0.8 + 0.8 * 0.5 = 2.2.
    """
    total, survive = 1.0, 1.0
    for a in acceptance[:k]:
        survive *= a
        total += survive
    return total


def all_accepted_probability(acceptance: Sequence[float], k: int) -> float:
    """prod_{j<=k} a_j (1 for k = 0)."""
    return math.prod(acceptance[:k])


def expected_round_seconds(k: int, acceptance: Sequence[float], costs: StepCosts, bonus_forward: bool) -> float:
    """C(k) = k * d + v(k + 1), plus d * P(all k accepted) when the bonus position needs q (eta > 0)."""
    seconds = k * costs.draft_step + costs.verify(k + 1)
    if bonus_forward and k > 0:
        seconds += costs.draft_step * all_accepted_probability(acceptance, k)
    return seconds


def best_drafts(acceptance: Sequence[float], costs: StepCosts, k_min: int, k_max: int, bonus_forward: bool) -> int:
    """The k in [k_min, k_max] maximising E(k) / C(k), expected tokens per second (the smallest on ties).

    ``acceptance``: [>= k_max]. One pass: E(k) and prod_{j<=k} a_j are carried
    from k - 1 (the same numbers as :func:`expected_tokens` and
    :func:`expected_round_seconds`, without their O(k) sums per k).
    """
    best, best_rate = k_min, -1.0
    tokens, survive = 1.0, 1.0  # E(k), prod_{j<=k} a_j
    for k in range(k_max + 1):
        if k > 0:
            survive *= acceptance[k - 1]
            tokens += survive
        if k < k_min:
            continue
        seconds = k * costs.draft_step + costs.verify(k + 1)
        if bonus_forward and k > 0:
            seconds += costs.draft_step * survive
        if tokens / seconds > best_rate:
            best, best_rate = k, tokens / seconds
    return best


def decayed_acceptance_counts(
    accepted_weight: Sequence[float], observed_weight: Sequence[float], drafted: int, accepted: int, decay: float
) -> tuple[list[float], list[float]]:
    """Counts of one position each ([P], [P]) after a round that drafted ``drafted`` and kept ``accepted``.

    Every count is first multiplied by ``decay``. Positions 1..accepted saw an
    acceptance, position accepted + 1 (when drafted) a rejection; later
    positions were not reached, so a_i, conditional on reaching i, learns nothing.
    Example: decay 0.5, counts ([4, 2, 2], [4, 4, 2]), drafted 3, accepted 1
    -> ([3, 1, 1], [3, 3, 1]): position 1 accepted, 2 rejected, 3 not reached.
    """
    accepted_out = [w * decay for w in accepted_weight]
    observed_out = [w * decay for w in observed_weight]
    for position in range(min(drafted, accepted + 1, len(observed_out))):
        observed_out[position] += 1.0
        if position < accepted:
            accepted_out[position] += 1.0
    return accepted_out, observed_out


def acceptance_estimates(
    accepted_weight: Sequence[float],
    observed_weight: Sequence[float],
    prior_strength: float = ACCEPTANCE_PRIOR_STRENGTH,
    first_prior: float = FIRST_POSITION_PRIOR,
) -> list[float]:
    """Posterior means a_i = (s * prior_i + accepted_i) / (s + observed_i) ([P] -> [P]).

    prior_1 = ``first_prior``, prior_i = a_{i-1}. With no observations every
    a_i is ``first_prior``. Example: s = 1, accepted [3, 0], observed [3, 0] ->
    a_1 = (0.5 + 3) / 4 = 0.875, a_2 = 0.875 (unseen: its neighbour's value).
    """
    estimates, prior = [], first_prior
    for accepted, observed in zip(accepted_weight, observed_weight):
        prior = (prior_strength * prior + accepted) / (prior_strength + observed)
        estimates.append(prior)
    return estimates


def verify_line(points: Sequence[tuple[int, float, float]]) -> tuple[float, float] | None:
    """(base, per_token) of the weighted least-squares line through ``points`` of (n, seconds, weight).

    None when fewer than two distinct n have weight (no slope). Both stay
    >= 0: a negative slope (noise) becomes 0 with the weighted mean as base, a
    negative base 0 with the line through the origin.
    Example: [(1, 0.2, 1), (3, 0.3, 1)] -> (0.15, 0.05).
    """
    weight = sum(w for _, _, w in points)
    if len({n for n, _, w in points if w > 0}) < 2:
        return None
    mean_n = sum(w * n for n, _, w in points) / weight
    mean_s = sum(w * s for _, s, w in points) / weight
    spread = sum(w * (n - mean_n) ** 2 for n, _, w in points)
    slope = max(0.0, sum(w * (n - mean_n) * (s - mean_s) for n, s, w in points) / spread)
    if mean_s - slope * mean_n < 0:
        return 0.0, sum(w * n * s for n, s, w in points) / sum(w * n * n for n, _, w in points)
    return mean_s - slope * mean_n, slope


def calibration_drafts(verified: Sequence[int], k_min: int, k_max: int) -> int:
    """The smallest k in [k_min, k_max] verifying a token count not in ``verified`` (k_min if none).

    Used while one round size only has been measured, to learn v(n)'s slope.
    """
    return next((k for k in range(k_min, k_max + 1) if k + 1 not in verified), k_min)


# ------------------------------------------------------------- the schedules
class GammaSchedule(Protocol):
    def next_drafts(self) -> int:
        """Drafts for the next round (the engine caps it by the tokens left)."""

    def record(self, round_: RoundRecord) -> None:
        """Learn from the round just done."""


class ConstantSchedule:
    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def next_drafts(self) -> int:
        return self.gamma

    def record(self, round_: RoundRecord) -> None:
        pass


class HeuristicSchedule:
    """+2 after a round that kept all its drafts, -1 otherwise, within [1, max_gamma].

    As transformers' ``num_assistant_tokens_schedule="heuristic"``: the step
    applies to the current gamma, and "kept all" is judged on the drafts the
    round made, so a round cut short by ``draft_confidence`` (or the token
    limit) whose drafts were all kept still grows gamma.
    """

    def __init__(self, gamma: int, max_gamma: int) -> None:
        self.gamma, self.max_gamma = gamma, max_gamma

    def next_drafts(self) -> int:
        return self.gamma

    def record(self, round_: RoundRecord) -> None:
        if round_.drafted:
            grow = round_.accepted == round_.drafted
            self.gamma = min(self.max_gamma, self.gamma + 2) if grow else max(1, self.gamma - 1)


class CostSchedule:
    """The ``cost`` schedule: running estimates of d, v(n) and a_i, and the choice of k.

    The first round drafts ``gamma``; its costs are not recorded (first calls
    warm kernels and allocators). Until a drafter step and two round sizes have
    been measured, rounds draft ``gamma`` and then one calibration size.
    ``fixed_costs`` replaces the measured costs (tests, what-if analysis).
    """

    def __init__(self, gamma: int, max_gamma: int, eta: float, fixed_costs: StepCosts | None = None) -> None:
        self.gamma, self.max_gamma, self.fixed_costs = gamma, max_gamma, fixed_costs
        self.k_min, self.bonus_forward = 0, eta > 0  # k = 0: a plain step (module docstring)
        self.accepted_weight = [0.0] * max_gamma  # [max_gamma] decayed accepted counts per position
        self.observed_weight = [0.0] * max_gamma  # [max_gamma] decayed reached counts per position
        self.draft_step_samples: deque[float] = deque(maxlen=DRAFT_WINDOW)
        self.verify_samples: dict[int, deque[float]] = {}  # n verified -> recent seconds
        self.rounds = 0
        self.plain_streak = 0  # plain rounds in a row just done
        self.probe_every = PROBE_EVERY  # the interval now (see MAX_PROBE_EVERY)
        self.probed = False  # whether the last round was a probe

    def acceptance(self) -> list[float]:
        return acceptance_estimates(self.accepted_weight, self.observed_weight)

    def costs(self) -> StepCosts | None:
        """The step costs to plan with, None while they are not all measured."""
        if self.fixed_costs is not None:
            return self.fixed_costs
        points = [(n, statistics.median(s), len(s)) for n, s in self.verify_samples.items()]
        line = verify_line(points)
        if not self.draft_step_samples or line is None or line[0] + line[1] <= 0:
            return None
        return StepCosts(statistics.median(self.draft_step_samples), *line)

    def next_drafts(self) -> int:
        if self.rounds == 0:
            return self.gamma
        if self.plain_streak >= self.probe_every - 1:
            self.probed = True
            return min(PROBE_DRAFTS, self.max_gamma)
        costs = self.costs()
        if costs is None:
            if not self.draft_step_samples or not self.verify_samples:
                return self.gamma
            # calibrating with drafts keeps eta > 0's tokens on p^ until the costs say a plain step pays
            return calibration_drafts(list(self.verify_samples), int(self.bonus_forward), self.max_gamma)
        k_max = self.max_gamma
        if self.fixed_costs is None:  # round k verifies k + 1 tokens
            k_max = max(self.k_min, min(k_max, max(self.verify_samples) - 1 + EXTRAPOLATE_TOKENS))
        k = best_drafts(self.acceptance(), costs, self.k_min, k_max, self.bonus_forward)
        if k > 0:
            self.probe_every = PROBE_EVERY
        elif self.probed:
            self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
        self.probed = False
        return k

    def record(self, round_: RoundRecord) -> None:
        self.rounds += 1
        if round_.drafted:
            self.plain_streak = 0
            self.accepted_weight, self.observed_weight = decayed_acceptance_counts(
                self.accepted_weight, self.observed_weight, round_.drafted, round_.accepted, ACCEPTANCE_DECAY
            )
        else:
            self.plain_streak += 1
        if self.rounds == 1:
            return
        if round_.drafter_forwards and round_.drafter_caught_up <= CATCH_UP_TOKENS:
            self.draft_step_samples.append(round_.draft_seconds / round_.drafter_forwards)
        verify_seconds = round_.verify_seconds + round_.accept_seconds
        self.verify_samples.setdefault(round_.verified, deque(maxlen=VERIFY_WINDOW)).append(verify_seconds)


def new_schedule(config) -> GammaSchedule:
    """The schedule ``config.resolved_gamma_schedule`` names (``config``: a :class:`~rapidspec.config.DecodeConfig`)."""
    name = config.resolved_gamma_schedule
    if name == "heuristic":
        return HeuristicSchedule(config.gamma, config.max_gamma)
    if name == "cost":
        return CostSchedule(config.gamma, config.max_gamma, config.effective_eta)
    return ConstantSchedule(config.gamma)
