"""The decode loop and what its rounds share: settings, caches, drafter, schedule, grammar and what they gather.

:meth:`rapidspec.Rapid.decode` prefills, makes one :class:`Rounds` per generation and runs
:func:`run_rounds` over it: 2 draft, 3 verify, 4 accept, 5 commit, round after round, until the answer ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

from rapidspec.config import DecodeConfig
from rapidspec.drafting import NO_PROPOSAL
from rapidspec.drafting.drafter import Proposal
from rapidspec.drafting.gamma_schedule import CostSchedule, GammaSchedule, StepCosts, new_schedule
from rapidspec.outputs import GenerationOutput, StreamChunk
from rapidspec.stats import GenerationStats, RoundRecord
from rapidspec.text_stream import TextAssembler, cut_answer
from rapidspec.verification import sampling
from rapidspec.verification.logprobs import round_logprobs
from rapidspec.verification.processors import NO_PROCESSORS, LogitsProcessors


def sync(device: torch.device) -> None:
    """Wait for ``device`` (CUDA runs asynchronously; CPU needs nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Rounds:
    """What the rounds of one generation share: its settings, caches, drafter, schedule and what it gathers.

    ``drafter`` and ``schedule`` are None until the drafter joins (:meth:`prepare_drafter`, :mod:`rapidspec.drafting.join`).
    """

    # the generation's settings
    started: float  # time.perf_counter() when the generation started
    config: DecodeConfig
    params: sampling.SamplingParams
    stats: GenerationStats
    generator: torch.Generator
    stop_tokens: frozenset[int]
    vocab: int
    out_of_time: Callable[[], bool]
    processors: LogitsProcessors = NO_PROCESSORS  # a grammar's masks, the penalties
    sync: bool = False  # wait for the devices around each step (profiling: exact times)
    # the target
    target_cache: object = None
    target_seq: list[int] = field(default_factory=list)
    # who drafts: lookup until the drafter joins (join prepares it), then the drafter with its schedule
    join: object | None = None  # the drafter's preparation (rapidspec.drafting.join.DrafterJoin)
    lookup: object | None = None  # a LookupDrafter over the target's sequence, drafting until the drafter joins
    lookup_schedule: GammaSchedule | None = None  # its schedule, made once the target's step costs are known
    drafter: object | None = None
    schedule: GammaSchedule | None = None
    fixed_schedule: GammaSchedule | None = None  # the caller's schedule, used once the drafter joins
    # what the rounds gather
    prepare_seconds: float = 0.0  # time between rounds spent preparing the drafter (retrieval, prefill, calibration)
    logprobs: list = field(default_factory=list)

    def drafting_now(self) -> tuple[object | None, GammaSchedule | None, sampling.SamplingParams]:
        """Who drafts the next round, its schedule and the parameters its drafts are verified with: the drafter
        once it joined; before, prompt lookup over the target's own sequence once the target's step costs are
        known (with eta = 0: each token follows the target's p, as a plain step's does, so the answer is what
        plain rounds would give, sooner where the text repeats); else no one (a plain step)."""
        if self.drafter is not None:
            return self.drafter, self.schedule, self.params
        costs = None if self.join is None else self.join.step_costs
        if self.lookup is None or costs is None:
            return None, None, self.params
        if self.lookup_schedule is None:
            free = StepCosts(0.0, costs.verify_base, costs.verify_per_token)  # a lookup costs next to nothing
            self.lookup_schedule = CostSchedule(self.config.gamma, self.config.max_gamma, 0.0, free)
        return self.lookup, self.lookup_schedule, replace(self.params, eta=0.0)

    def prepare_drafter(self, prompt_length: int) -> None:
        """One bounded piece of the drafter's preparation after a round (:meth:`~rapidspec.drafting.join.DrafterJoin.between_rounds`);
        on its join the drafter and a schedule over the calibrated costs take part in the next rounds. Its time
        counts as retrieval or drafter prefill, not decoding."""
        if self.drafter is not None or self.join is None or self.join.done:
            return
        started, retrieval_before = time.perf_counter(), self.stats.retrieval_seconds
        drafter = self.join.between_rounds(self.target_cache, self.target_seq, self.target_seq[prompt_length:])
        if drafter is not None:
            self._joined(drafter, len(self.target_seq) - prompt_length)
        seconds = time.perf_counter() - started
        self.prepare_seconds += seconds
        self.stats.drafter_prefill_seconds += max(0.0, seconds - (self.stats.retrieval_seconds - retrieval_before))

    def prepare_drafter_now(self) -> None:
        """``drafter_start="first"``: retrieval and the drafter's prefill before the first round (counted as drafter
        prefill; with a drafter prefilling beside the target's, the wait after it)."""
        started = time.perf_counter()
        drafter = self.join.now(self.target_cache, self.target_seq)
        if drafter is not None:
            self._joined(drafter, 0)
        self.stats.drafter_prefill_seconds = time.perf_counter() - started

    def _joined(self, drafter, after_tokens: int) -> None:
        """The drafter takes part from the next round, with the caller's schedule or one over the calibrated costs."""
        if self.sync:
            sync(drafter.device)
        self.drafter, self.vocab = drafter, drafter.vocab_size
        self.schedule = self.fixed_schedule or new_schedule(self.config, self.join.step_costs)
        self.stats.drafter_joined_at = after_tokens
        self.stats.drafter_join_seconds = time.perf_counter() - self.started

    def wait_for_drafter(self) -> None:
        if self.sync and self.drafter is not None:
            sync(self.drafter.device)

    def record_round(self, drafter, schedule, drafted: int, accepted: int, proposal, asked_bonus: bool,
                     times: tuple, fed: int) -> RoundRecord:
        """The round as measured (the bonus row's time is drafting time), counted in the statistics and in the
        schedule of whoever drafted it (without one every round is a plain step, counted nowhere; lookup rounds
        before the drafter joined count apart, as ``lookup_drafted_tokens`` and ``lookup_accepted_tokens``)."""
        t0, t1, t2 = times
        if drafter is None:
            return RoundRecord(0, 0, 0.0, 0, t2 - t1, time.perf_counter() - t2, fed)
        if self.sync:
            sync(self.target_cache.device)
        bonus = drafter.bonus_seconds if asked_bonus else 0.0
        measured = RoundRecord(drafted, accepted, t1 - t0 + bonus, proposal.forwards + int(asked_bonus), t2 - t1,
                               time.perf_counter() - t2 - bonus, fed, proposal.caught_up)
        if drafter is self.drafter:
            self.stats.add_round(measured)
        else:
            self.stats.lookup_drafted_tokens += drafted
            self.stats.lookup_accepted_tokens += accepted
        schedule.record(measured)
        return measured

    def logprobs_of(self, target_logits, draft_rows, bonus_row, emitted: list[int], params) -> tuple:
        """The log-probabilities of a round's emitted tokens when the config asks for them, kept for the output."""
        if self.config.logprobs is None or not emitted:
            return ()
        out = round_logprobs(target_logits, draft_rows, bonus_row, emitted, params, self.config.logprobs,
                             self.vocab)
        self.logprobs.extend(out)
        return out


@dataclass(frozen=True)
class Round:
    """One round as verified (steps 2-4): the proposal, how many drafts were accepted, the token after them, the
    target's processed rows, the drafter's bonus row when it was asked for, and the round's record."""

    proposal: Proposal
    accepted: int
    next_token: int
    target_logits: torch.Tensor  # [k + 1, V]
    bonus_row: torch.Tensor | None
    params: sampling.SamplingParams
    record: RoundRecord

    @property
    def tokens(self) -> list[int]:
        return self.proposal.tokens[: self.accepted] + [self.next_token]


def run_round(run: Rounds, remaining: int) -> Round:
    """Draft, one target forward over [pending, drafts], verify, and the bonus token (step 4 needs it when every
    draft was accepted, or no one drafted: a plain step)."""
    active, schedule, params = run.drafting_now()  # the drafter, or lookup until it joins, or no one
    seq, cache, processors = run.target_seq, run.target_cache, run.processors
    # 2 draft
    t0 = time.perf_counter()
    requested = 0 if active is None else schedule.next_drafts()
    proposal = (NO_PROPOSAL if active is None else active.propose(
        min(requested, remaining - 1), run.config, run.generator, run.stop_tokens, processors))
    run.wait_for_drafter()
    # 3 verify: one target forward; each row processed (grammar, penalties) along the drafts, as the drafter's were
    t1 = time.perf_counter()
    fed = seq[cache.length :] + proposal.tokens
    logits = processors.rows(cache.forward(fed, num_logits=len(proposal.tokens) + 1)[:, : run.vocab], proposal.tokens)
    if run.sync:
        sync(cache.device)
    # 4 accept; with eta > 0 and every draft accepted, p^ at k + 1 needs the drafter's row there
    t2 = time.perf_counter()
    verdict = sampling.verify(logits, proposal.tokens, proposal.rows, params, run.generator)
    next_token, bonus_row = verdict.next_token, None
    asked = next_token is None and requested > 0  # a schedule asking for 0 drafts asks for a plain step: p, no row
    if next_token is None:
        if asked:
            bonus_row = active.bonus_row(run.config, run.stop_tokens, run.sync, processors)
        next_token = sampling.bonus_token(logits, verdict.accepted, bonus_row, params, run.generator)
    record = run.record_round(active, schedule, len(proposal.tokens), verdict.accepted, proposal, asked,
                              (t0, t1, t2), len(fed))
    return Round(proposal, verdict.accepted, next_token, logits, bonus_row, params, record)


def commit_round(run: Rounds, round_: Round, remaining: int, assembler: TextAssembler) -> tuple[list[int], str, str | None]:
    """Step 5: the round's emitted tokens, their text and why the answer finished (None: it goes on), cut at an
    end of answer, a stop string, a complete grammar, ``max_new_tokens`` or the time limit; the processors, the
    target's sequence and cache and whoever drafts follow the emitted tokens."""
    emitted, finished = cut_answer(round_.tokens, remaining, run.stop_tokens)
    text, stopped = assembler.add(emitted)
    if stopped:
        emitted, finished = emitted[: assembler.kept], "stop"  # no tokens after the stop string
    if run.processors.commit(emitted):  # the answer completes its grammar
        finished = finished or "stop"
    if not finished and run.out_of_time():
        finished = "time"
    if finished and not stopped:
        text += assembler.flush()
    run.target_seq.extend(emitted)
    run.target_cache.crop(min(run.target_cache.length, len(run.target_seq) - 1))
    if run.drafter is not None:
        run.drafter.commit(emitted)
    elif run.lookup is not None:
        run.lookup.commit(emitted)
    return emitted, text, finished


def run_rounds(run: Rounds, prompts, tokenizer, observer=None) -> Iterator[StreamChunk]:
    """Steps 2-5 of :meth:`rapidspec.Rapid.decode` until the answer ends, then the final chunk with the output.

    ``prompts``: the generation's :class:`~rapidspec.prompting.prompts.PromptPair`; ``tokenizer`` decodes the answer;
    ``observer`` as in :meth:`~rapidspec.Rapid.decode`.
    """
    config, stats, seq = run.config, run.stats, run.target_seq
    prompt_length, assembler, finished = len(seq), TextAssembler(tokenizer, config.stop), None
    started = time.perf_counter()
    while not finished:
        if len(seq) > prompt_length:  # the drafter's preparation: one bounded piece between two rounds
            run.prepare_drafter(prompt_length)
        remaining = config.max_new_tokens - (len(seq) - prompt_length)
        round_ = run_round(run, remaining)
        emitted, text, finished = commit_round(run, round_, remaining, assembler)
        logprobs = run.logprobs_of(round_.target_logits, round_.proposal.rows, round_.bonus_row, emitted,
                                   round_.params)
        if observer is not None:
            drafter = run.drafter
            observer(run.target_cache, seq, getattr(drafter, "cache", None), getattr(drafter, "sequence", None))
        if emitted and not stats.time_to_first_token:
            stats.time_to_first_token = time.perf_counter() - run.started
        if text or emitted:
            yield StreamChunk(text=text, token_ids=tuple(emitted), logprobs=logprobs, round=round_.record)
    sync(run.target_cache.device)
    stats.decode_seconds = time.perf_counter() - started - run.prepare_seconds
    stats.new_tokens, stats.stop_reason = len(seq) - prompt_length, finished
    yield StreamChunk(text="", token_ids=(), output=_output(run, prompt_length, assembler))


def _output(run: Rounds, prompt_length: int, assembler: TextAssembler) -> GenerationOutput:
    generated = tuple(run.target_seq[prompt_length:])
    prompts = run.join.prompts  # with the drafter's prompt and retrieval once they were prepared
    if run.drafter is not None:
        assert tuple(run.drafter.sequence[len(prompts.drafter_ids) :]) == generated
    logprobs = None if run.config.logprobs is None else tuple(run.logprobs)
    return GenerationOutput(assembler.text, generated, run.stats, run.config, prompts.retrieval,
                            prompts.retrieved_turns, logprobs)
