"""When the drafter of one generation joins its rounds: the first token is the target's, the drafter joins when it pays.

A generation's first round is a plain target step, whatever the mode: its
token comes from the target's prefill (on a follow-up question, mostly the
prefix cache) and nothing RAPID needs stands in front of it. Between later
rounds :class:`DrafterJoin` prepares the drafter in bounded pieces, one per
round boundary:

1. retrieval, when the prompts were built without it (``PromptPair.deferred``);
2. the drafter's prefill, :func:`piece_tokens` tokens a piece (about one plain
   step, so no gap between two tokens grows beyond about two plain steps),
   from the kept cache sharing the longest prefix with its prompt;
3. the join: the drafter takes the answer so far and the rounds draft.

A piece runs only while the expected saving over the rest of the answer
exceeds what the preparation still costs (:func:`worth_preparing`), so a short
answer costs what lc costs. The costs come from the machine's calibration
(:mod:`.calibration`), the lengths from the config and the tokens so far, and
the conversation's earlier answers are read once, when the generation starts
(:mod:`.memory`): their expected acceptance and the drafter cache the previous
one left. The prefill's pieces are planned from that: the drafter joins at the
round the plan fixed, and the caches the pool actually holds (another request
may have taken or given back one meanwhile) change only how many tokens each
piece feeds. So the rounds of a generation are a function of the request
(with its conversation's earlier turns) and the machine's calibration, never
of the clock or of requests that ran before or beside it.

A llama.cpp drafter prefilling beside the target's prefill on spare cores
(:meth:`~.factory.DrafterFactory.prefills_beside`) joins at the first round
boundary, waiting for it there. ``DecodeConfig.drafter_start="first"`` prepares
everything before the first round (the paper's setting: every round drafts).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from concurrent.futures import Future

from rapidspec.drafting.calibration import DrafterCosts, TargetCosts
from rapidspec.drafting.factory import drop_started
from rapidspec.errors import RapidspecError
from rapidspec.drafting.gamma_schedule import (
    StepCosts,
    best_drafts,
    expected_round_seconds,
    expected_tokens,
)

logger = logging.getLogger(__name__)

#: A prefill piece feeds at least this many tokens (a chunk smaller than this costs mostly overhead).
MIN_PIECE_TOKENS = 16
#: Without ignore_eos an answer may end at any token: the decision expects at most max(tokens so far, this) more
#: (an answer that ran long is likely to run on), never more than max_new_tokens allows.
LENGTH_HORIZON = 32


def drafting_seconds_per_token(costs: StepCosts, acceptance: Sequence[float], max_gamma: int,
                               bonus_forward: bool) -> float:
    """Expected seconds per emitted token of the best drafting round (k >= 1) under ``costs`` and ``acceptance``.

    Example: a = [0.8] * 4, d = 0.01, v(n) = 0.05 + 0.005 n: k = 3 emits 1 + 0.8 + 0.64 + 0.512 = 2.952 tokens
    for 0.03 + 0.07 = 0.1 s, 0.034 s a token (k = 4: 0.0342) against a plain step's 0.055 s.
    """
    k = best_drafts(acceptance, costs, 1, max_gamma, bonus_forward)
    return expected_round_seconds(k, acceptance, costs, bonus_forward) / expected_tokens(acceptance, k)


def worth_preparing(prepare_seconds: float, plain_step: float, drafting_step: float, remaining_tokens: int) -> bool:
    """Whether preparing the drafter pays: the tokens left after the preparation's rounds, each
    ``plain_step - drafting_step`` seconds cheaper, save more than ``prepare_seconds``.

    The preparation runs a piece of about one plain step per round, so it takes
    ``ceil(prepare_seconds / plain_step)`` rounds, whose tokens come from plain steps.
    Example: 0.5 s to prepare, plain 0.05 s, drafting 0.025 s a token: 10 rounds; 40 tokens left save
    30 * 0.025 = 0.75 s > 0.5 s (worth it), 25 tokens left save 0.375 s (not).
    """
    saving = plain_step - drafting_step
    if saving <= 0 or remaining_tokens <= 1:
        return False
    rounds = math.ceil(prepare_seconds / plain_step) if plain_step > 0 else 0
    return (remaining_tokens - rounds) * saving > prepare_seconds


def expected_remaining(max_new_tokens: int, emitted: int, ignore_eos: bool) -> int:
    """Tokens the answer is expected to add: all it may with ``ignore_eos``, else at most
    max(``emitted``, :data:`LENGTH_HORIZON`). Example: 256 allowed, 10 so far: 32; 100 so far: 100; 240: 16."""
    left = max_new_tokens - emitted
    return left if ignore_eos else min(left, max(emitted, LENGTH_HORIZON))


def piece_tokens(plain_step: float, prefill_per_token: float) -> int:
    """Tokens of one prefill piece: what the drafter prefills in about one plain step (at least MIN_PIECE_TOKENS)."""
    if prefill_per_token <= 0:
        return 1 << 20
    return max(MIN_PIECE_TOKENS, int(plain_step / prefill_per_token))


class DrafterJoin:
    """Prepares the drafter of one generation between its rounds (module docstring).

    ``factory``: the engine's :class:`~.factory.DrafterFactory`; ``prompts``: the generation's PromptPair
    (maybe deferred); ``costs``: the engine's :class:`~.calibration.EngineCosts`; ``acceptance``: the prior
    a_1..a_max_gamma and ``kept``: the drafter caches the plan counts as kept, both from the conversation's
    earlier answers (:class:`~.memory.Turn`);
    ``beside``: a drafter prefilling beside the target's prefill.
    """

    def __init__(self, factory, prompts, config, stats, device, costs, acceptance: list[float],
                 kept: list[tuple[int, ...]], beside: Future | None = None) -> None:
        self.factory, self.prompts, self.config, self.stats, self.device = factory, prompts, config, stats, device
        self.costs = costs
        self.acceptance, self.kept, self.beside = acceptance, kept, beside
        self.done = factory.drafter_kind(config) is None  # joined, or never will
        self._pending = None  # a PendingDrafter while its prefill runs
        self._pieces_left = 0  # pieces the plan gives the prefill from here
        self.step_costs: StepCosts | None = None

    def now(self, target_cache, target_seq: list[int]):
        """Everything before the first round (``drafter_start="first"``): the generation's drafter, or None."""
        self.done = True
        if self.beside is None:
            self._resolve()
        drafter = self._started()
        if drafter is not None:
            self._step_costs(target_cache, target_seq)
        return drafter

    def between_rounds(self, target_cache, target_seq: list[int], answer: list[int]):
        """One bounded piece of preparation after a round; the drafter once it joins (it has taken ``answer``), else None.

        A request-level error of the preparation (retrieval refusing the request's budget, say) ends it: the answer
        goes on without the drafter (the target's tokens, as lc's) and ``stats.drafter_error`` says why.
        """
        remaining = expected_remaining(self.config.max_new_tokens, len(answer), self.config.ignore_eos)
        if self.done or remaining <= 1:
            return None
        try:
            return self._between_rounds(target_cache, target_seq, answer, remaining)
        except RapidspecError as err:
            logger.warning("answering without the drafter: %s", err)
            self.stats.drafter_error = str(err)
            self.close()
            return None

    def _between_rounds(self, target_cache, target_seq: list[int], answer: list[int], remaining: int):
        target, drafter = self._step_costs(target_cache, target_seq)  # the schedule plans with them once it joins
        if self.beside is not None:  # joins at the first boundary, whatever it cost (spare cores)
            return self._join(self._started(), answer)
        if drafter is None:  # lookup: no model, no prefill: drafts from the next round
            self._resolve()
            return self._join(self._started(), answer)
        piece = piece_tokens(target.verify(1), drafter.prefill_per_token)
        if self._pending is None:
            deferred = self.prompts.deferred
            if deferred is not None and deferred.embed_tokens == 0:
                self._resolve()  # one cheap piece (a query): then the decision knows the drafter's prompt
                deferred = None
            tokens = self._planned_tokens()
            if not self._worth(tokens * drafter.prefill_per_token + self._retrieval_seconds(), target, remaining):
                return None
            if deferred is not None:
                self._resolve()  # one piece: retrieval, embedding the document
                return None
            self._pending = self.factory.begin(self.prompts, self.config, self.stats, self.device)
            if self._pending is None:  # nothing to draft from
                self.done = True
                return None
            self._pieces_left = -(-tokens // piece)
        elif not self._worth(self._pieces_left * piece * drafter.prefill_per_token, target, remaining):
            return None  # the answer is nearly done: the rest of the prefill would not pay
        if self._pieces_left <= 1:  # the plan's last piece: whatever is left (a cache taken meanwhile)
            self._pending.advance(None)
            self._pieces_left = 0
        else:
            self._pending.advance(-(-self._pending.left // self._pieces_left))
            self._pieces_left -= 1
            return None
        pending, self._pending = self._pending, None
        return self._join(pending.drafter(), answer)

    def close(self) -> None:
        """The generation ended before the drafter joined: keep what its prefill wrote for the next prompt."""
        if self._pending is not None:
            self._pending.close()
            self._pending = None
        if self.beside is not None and not self.done:
            drop_started(self.beside)
        self.done = True

    # ------------------------------------------------------------ internals
    def _worth(self, prepare_seconds: float, target: TargetCosts, remaining: int) -> bool:
        drafting = drafting_seconds_per_token(self.step_costs, self.acceptance, self.config.max_gamma,
                                              self.config.eta_value > 0)
        return worth_preparing(prepare_seconds, target.verify(1), drafting, remaining)

    def _retrieval_seconds(self) -> float:
        deferred = self.prompts.deferred
        if deferred is None or deferred.embed_tokens == 0:
            return 0.0
        return deferred.embed_tokens * self.costs.embedding()

    def _step_costs(self, target_cache, target_seq: list[int]) -> tuple[TargetCosts, DrafterCosts | None]:
        """The calibrated costs the schedule plans with (:attr:`step_costs`); the target's and the drafter's
        returned (None for a lookup drafter, which costs nothing)."""
        target = self.costs.target(self.config, target_cache, target_seq)
        drafter = None if self.factory.drafter_kind(self.config) == "lookup" else self.costs.drafter(self.config)
        self.step_costs = StepCosts(0.0 if drafter is None else drafter.step, target.base, target.per_token)
        return target, drafter

    def _planned_tokens(self) -> int:
        """Tokens the drafter's prefill feeds by the plan: its prompt less what the conversation's previous answer
        left in a drafter cache (the retrieval budget while the prompt is not known yet)."""
        if self.prompts.deferred is not None:
            return self.prompts.deferred.drafter_tokens
        if self.prompts.drafter_ids is None:
            return 0
        return max(0, len(self.prompts.drafter_ids) - 1 - self.factory.kept_prefix(self.prompts, self.config, self.kept))

    def _resolve(self) -> None:
        if self.prompts.deferred is not None:
            self.prompts = self.prompts.deferred.resolve()
            self.stats.add_resolved_prompts(self.prompts)

    def _started(self):
        prompts, drafter = self.factory.started(self.beside, self.prompts, self.config, self.stats, self.device)
        if prompts is not self.prompts:
            self.prompts = prompts
            self.stats.add_resolved_prompts(prompts)
        return drafter

    def _join(self, drafter, answer: list[int]):
        self.done = True
        if drafter is not None and answer:
            drafter.commit(list(answer))  # the tokens the plain rounds emitted: fed with its first draft
        return drafter
