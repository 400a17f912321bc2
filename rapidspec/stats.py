"""What every generation reports.

Counting follows vLLM's ``SpecDecodingStats``: a *round* drafts some tokens,
the target verifies them in one forward pass, ``accepted`` of them are kept and
one more token (the correction or the bonus) is emitted by the target.
``mean_accepted_length = 1 + accepted / rounds``. A *plain round* drafted
nothing (the ``cost`` gamma schedule found drafting not worth it, or one token
was left): one target step; it counts as a round. Rounds are counted from the
drafter's join (``drafter_joined_at`` answer tokens came before it, from
plain target steps; :mod:`rapidspec.drafting.join`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class RoundRecord:
    """What one draft/verify round did and cost, as the engine measured it."""

    drafted: int  # drafts verified (k; 0 = a plain round)
    accepted: int  # leading drafts kept (<= drafted)
    draft_seconds: float  # drafter time, the forward at the bonus position included
    drafter_forwards: int  # drafter forward passes in draft_seconds
    verify_seconds: float  # the target forward
    accept_seconds: float  # the acceptance math of step 4, drafter time excluded
    verified: int  # tokens the target forward fed (pending + drafted)
    drafter_caught_up: int = 0  # tokens the drafter's first forward fed before drafting


@dataclass
class GenerationStats:
    """Counters and timings of one generation (filled in while it runs)."""

    mode: str = "lc"
    eta: float = 0.0
    eta_source: str | None = None  # rapid: "given" or the default's reason (rapidspec.drafting.eta_default)
    gamma: int = 0
    gamma_schedule: str = "constant"
    prompt_tokens_target: int = 0
    prompt_tokens_drafter: int = 0
    document_tokens_truncated: int = 0
    retrieved_tokens: int = 0
    retrieved_chunks: int = 0
    target_prefill_reused_tokens: int = 0  # not prefilled: read from the prefix cache or from disk
    target_prefill_disk_tokens: int = 0  # of those, read from the key/value blocks on disk
    drafter_prefill_reused_tokens: int = 0
    drafter_prefill_disk_tokens: int = 0  # of those, read from a llama.cpp state on disk
    drafter: str = ""  # what drafted: the drafter's label and backend, or "lookup"
    retrieval_seconds: float = 0.0
    target_prefill_seconds: float = 0.0
    drafter_prefill_seconds: float = 0.0  # with the drafter prefilling beside the target: the wait after it
    drafter_prefill_own_seconds: float = 0.0  # the drafter's prefill itself, when it ran beside the target's
    drafter_prefill_beside: bool = False
    decode_seconds: float = 0.0  # the rounds alone: retrieval and drafter prefill between them are counted above
    time_to_first_token: float = 0.0  # seconds from the start of the generation (its prefill) to its first token
    drafter_joined_at: int | None = None  # answer tokens before the first drafting round (None: it never joined)
    drafter_join_seconds: float | None = None  # seconds from the start of the generation to that round
    drafter_error: str | None = None  # why the drafter's preparation stopped (the answer went on without it)
    # Where decode time goes (see ``rapidspec bench --profile``).
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    accept_seconds: float = 0.0
    new_tokens: int = 0
    rounds: int = 0
    plain_rounds: int = 0  # rounds that drafted nothing
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    lookup_drafted_tokens: int = 0  # drafted by prompt lookup over the target's text before the drafter joined
    lookup_accepted_tokens: int = 0  # of those, kept
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    stop_reason: str = ""

    @classmethod
    def starting(cls, config, prompts) -> GenerationStats:
        """The stats of decoding ``prompts`` (a PromptPair) with ``config`` (a resolved DecodeConfig), before the first round."""
        stats = cls(mode=config.mode, eta=config.eta_value, gamma=config.gamma, gamma_schedule=config.gamma_schedule)
        stats.prompt_tokens_target = len(prompts.target_ids)
        stats.document_tokens_truncated = prompts.truncated_tokens
        stats.add_resolved_prompts(prompts)
        return stats

    def add_resolved_prompts(self, prompts) -> None:
        """The drafter's prompt and retrieval of ``prompts`` (known once a deferred retrieval ran)."""
        self.prompt_tokens_drafter = len(prompts.drafter_ids) if prompts.drafter_ids is not None else 0
        if (found := prompts.retrieval) is not None:
            self.retrieval_seconds, self.retrieved_tokens = found.seconds, found.num_tokens
            self.retrieved_chunks = len(found.chunks)

    def add_round(self, round_: RoundRecord) -> None:
        """Count a round and add its times to draft, verify and accept seconds."""
        self.record_round(round_.drafted, round_.accepted)
        self.draft_seconds += round_.draft_seconds
        self.verify_seconds += round_.verify_seconds
        self.accept_seconds += round_.accept_seconds

    def record_round(self, drafted: int, accepted: int) -> None:
        """Count one round that drafted ``drafted`` tokens (0: a plain round) and kept ``accepted``."""
        self.rounds += 1
        self.plain_rounds += int(drafted == 0)
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for position in range(drafted):
            self.drafted_per_position[position] += 1
            if position < accepted:
                self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted (None when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """1 + accepted / rounds: tokens emitted per target forward pass."""
        return 1.0 + self.accepted_tokens / self.rounds if self.rounds else None

    @property
    def mean_drafts_per_round(self) -> float | None:
        """drafted / rounds: the mean k a gamma schedule drafted, plain rounds counting 0."""
        return self.drafted_tokens / self.rounds if self.rounds else None

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of drafts at position i (0-based) that were accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def speculative_decoding(self) -> dict:
        """The per-request speculative metrics in the schema of vLLM's OpenAI server (``metrics.speculative_decoding``).

        Counted over the rounds that drafted (``num_drafts``); ``mean_acceptance_length`` = 1 + accepted / drafts
        (None without drafts); ``acceptance_histogram[i]``: drafting rounds that accepted exactly i drafts.
        Example: two rounds of 3 drafts accepting 3 and 1 -> accepted per position [2, 1, 1], histogram [0, 1, 0, 1].
        """
        drafts = self.rounds - self.plain_rounds
        reached = [drafts] + list(self.accepted_per_position)  # rounds accepting at least i drafts
        histogram = [reached[i] - (reached[i + 1] if i + 1 < len(reached) else 0) for i in range(len(reached))]
        return {
            "num_drafts": drafts,
            "num_draft_tokens": self.drafted_tokens,
            "num_accepted_draft_tokens": self.accepted_tokens,
            "mean_acceptance_length": 1.0 + self.accepted_tokens / drafts if drafts else None,
            "draft_acceptance_rate": self.acceptance_rate,
            "acceptance_histogram": histogram if drafts else [],
        }

    @property
    def decode_tokens_per_second(self) -> float | None:
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else None

    @property
    def total_seconds(self) -> float:
        return self.retrieval_seconds + self.target_prefill_seconds + self.drafter_prefill_seconds + self.decode_seconds

    @property
    def bookkeeping_seconds(self) -> float:
        """Decode time outside drafting, verification and acceptance math."""
        return max(0.0, self.decode_seconds - self.draft_seconds - self.verify_seconds - self.accept_seconds)

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in (
            "acceptance_rate",
            "mean_accepted_length",
            "mean_drafts_per_round",
            "per_position_acceptance",
            "decode_tokens_per_second",
            "total_seconds",
            "bookkeeping_seconds",
        ):
            out[name] = getattr(self, name)
        return out
