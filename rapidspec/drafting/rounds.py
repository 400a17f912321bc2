"""What the rounds of one generation share: its settings, caches, drafter, schedule, grammar and what it gathers.

The engine's decode loop (:meth:`rapidspec.Rapid.decode`) makes one
:class:`Rounds` per generation and passes it through every round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rapidspec import sampling
from rapidspec.config import DecodeConfig
from rapidspec.drafting.gamma_schedule import GammaSchedule
from rapidspec.logprobs import round_logprobs
from rapidspec.stats import GenerationStats, RoundRecord


def sync(device: torch.device) -> None:
    """Wait for ``device`` (CUDA runs asynchronously; CPU needs nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Rounds:
    """What the rounds of one generation share: its settings, caches, drafter, schedule and what it gathers.

    ``drafter`` and ``schedule`` are None until the drafter joins (:meth:`prepare_drafter`, :mod:`.join`).
    """

    started: float  # time.perf_counter() when the generation started
    config: DecodeConfig
    params: sampling.SamplingParams
    stats: GenerationStats
    generator: torch.Generator
    target_cache: object
    target_seq: list[int]
    drafter: object | None
    schedule: GammaSchedule | None
    stop_tokens: frozenset[int]
    sync: bool  # wait for the devices around each step (profiling: exact times)
    vocab: int
    out_of_time: Callable[[], bool]
    grammar: object | None = None  # a rapidspec.grammar.GrammarState when the answer is constrained
    join: object | None = None  # the drafter's preparation (rapidspec.drafting.join.DrafterJoin)
    fixed_schedule: GammaSchedule | None = None  # the caller's schedule, used once the drafter joins
    prepare_seconds: float = 0.0  # time between rounds spent preparing the drafter (retrieval, prefill, calibration)
    logprobs: list = field(default_factory=list)

    def prepare_drafter(self, prompt_length: int, new_schedule) -> None:
        """One bounded piece of the drafter's preparation after a round (:meth:`~.join.DrafterJoin.between_rounds`);
        on its join the drafter and a schedule over the calibrated costs take part in the next rounds. Its time
        counts as retrieval or drafter prefill, not decoding."""
        if self.drafter is not None or self.join is None or self.join.done:
            return
        started, retrieval_before = time.perf_counter(), self.stats.retrieval_seconds
        drafter = self.join.between_rounds(self.target_cache, self.target_seq, self.target_seq[prompt_length:])
        if drafter is not None:
            self._joined(drafter, len(self.target_seq) - prompt_length, new_schedule)
        seconds = time.perf_counter() - started
        self.prepare_seconds += seconds
        self.stats.drafter_prefill_seconds += max(0.0, seconds - (self.stats.retrieval_seconds - retrieval_before))

    def prepare_drafter_now(self, new_schedule) -> None:
        """``drafter_start="first"``: retrieval and the drafter's prefill before the first round (counted as drafter
        prefill; with a drafter prefilling beside the target's, the wait after it)."""
        started = time.perf_counter()
        drafter = self.join.now(self.target_cache, self.target_seq)
        if drafter is not None:
            self._joined(drafter, 0, new_schedule)
        self.stats.drafter_prefill_seconds = time.perf_counter() - started

    def _joined(self, drafter, after_tokens: int, new_schedule) -> None:
        """The drafter takes part from the next round, with the caller's schedule or one over the calibrated costs."""
        if self.sync and drafter.cache is not None:
            sync(drafter.device)
        self.drafter, self.vocab = drafter, drafter.vocab_size
        self.schedule = self.fixed_schedule or new_schedule(self.config, self.join.step_costs)
        self.stats.drafter_joined_at = after_tokens
        self.stats.drafter_join_seconds = time.perf_counter() - self.started

    def wait_for_drafter(self) -> None:
        if self.sync and self.drafter is not None and self.drafter.cache is not None:
            sync(self.drafter.device)

    def record_round(self, drafted: int, accepted: int, proposal, asked_bonus: bool, times: tuple,
                     fed: int) -> RoundRecord:
        """The round as measured (the bonus row's time is drafting time), counted in the statistics and the gamma
        schedule when the generation drafts (without a drafter every round is a plain step, counted nowhere)."""
        t0, t1, t2 = times
        if self.drafter is None:
            return RoundRecord(0, 0, 0.0, 0, t2 - t1, time.perf_counter() - t2, fed)
        if self.sync:
            sync(self.target_cache.device)
        bonus = self.drafter.bonus_seconds if asked_bonus else 0.0
        measured = RoundRecord(drafted, accepted, t1 - t0 + bonus, proposal.forwards + int(asked_bonus), t2 - t1,
                               time.perf_counter() - t2 - bonus, fed, proposal.caught_up)
        self.stats.add_round(measured)
        self.schedule.record(measured)
        return measured

    def logprobs_of(self, target_logits, draft_rows, bonus_row, emitted: list[int]) -> tuple:
        """The log-probabilities of a round's emitted tokens when the config asks for them, kept for the output."""
        if self.config.logprobs is None or not emitted:
            return ()
        out = round_logprobs(target_logits, draft_rows, bonus_row, emitted, self.params, self.config.logprobs,
                             self.vocab)
        self.logprobs.extend(out)
        return out
