"""How many tokens to draft each round: the schedules of ``DecodeConfig.gamma_schedule``.

``auto`` (the default) is ``cost``.

* ``constant``: always ``gamma``.
* ``heuristic``: transformers' assisted-generation rule: +2 after a round that
  kept every draft, -1 otherwise, within [1, ``max_gamma``].
* ``cost``: a cost model, so that a round is never expected to cost more per
  token than a plain target step:

      d          seconds per drafter forward (one drafted token)
      v(n)       seconds to verify n tokens, base + per_token * n
      a_i        P(draft i accepted | drafts 1..i-1 accepted), from the answer's
                 own decayed counts with a weak Beta prior

  d and v(n) are the machine's calibrated costs (:mod:`.calibration`), never
  a round's measured time, so the same request gets the same rounds alone,
  in a batch or on a busy machine. A round of k drafts then emits on average
  E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens and costs C(k) = k * d + v(k + 1)
  (+ d * prod_{j<=k} a_j when eta > 0: the drafter forward at the bonus
  position). The schedule drafts the k in [0, max_gamma] with the most tokens
  per second E(k) / C(k); k = 0 is a plain target step (E = 1, C = v(1)), so
  speculation has to beat it.

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
    """The ``cost`` schedule: the answer's acceptance estimates a_i, the calibrated ``costs``, and the choice of k.

    The first round drafts ``gamma`` (the drafter joined because drafting was expected to pay); later rounds
    choose k from the costs and the answer's own acceptance.
    """

    def __init__(self, gamma: int, max_gamma: int, eta: float, costs: StepCosts) -> None:
        self.gamma, self.max_gamma, self.costs = gamma, max_gamma, costs
        self.k_min, self.bonus_forward = 0, eta > 0  # k = 0: a plain step (module docstring)
        self.accepted_weight = [0.0] * max_gamma  # [max_gamma] decayed accepted counts per position
        self.observed_weight = [0.0] * max_gamma  # [max_gamma] decayed reached counts per position
        self.rounds = 0
        self.plain_streak = 0  # plain rounds in a row just done
        self.probe_every = PROBE_EVERY  # the interval now (see MAX_PROBE_EVERY)
        self.probed = False  # whether the last round was a probe

    def acceptance(self) -> list[float]:
        return acceptance_estimates(self.accepted_weight, self.observed_weight)

    def next_drafts(self) -> int:
        if self.rounds == 0:
            return self.gamma
        if self.plain_streak >= self.probe_every - 1:
            self.probed = True
            return min(PROBE_DRAFTS, self.max_gamma)
        k = best_drafts(self.acceptance(), self.costs, self.k_min, self.max_gamma, self.bonus_forward)
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


def new_schedule(config, costs: StepCosts) -> GammaSchedule:
    """The schedule ``config.gamma_schedule`` names (``config``: a :class:`~rapidspec.config.DecodeConfig` resolved by
    :func:`rapidspec.engine.resolve`, so ``auto`` is decided; ``costs``: the machine's step costs, read by ``cost``)."""
    name = config.gamma_schedule
    if name == "heuristic":
        return HeuristicSchedule(config.gamma, config.max_gamma)
    if name == "cost":
        return CostSchedule(config.gamma, config.max_gamma, config.eta_value, costs)
    if name == "constant":
        return ConstantSchedule(config.gamma)
    raise ValueError(f"gamma_schedule {name!r} is decided by the engine: resolve the config first (rapidspec.engine.resolve)")
