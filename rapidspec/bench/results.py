"""What ``rapidspec bench`` records: one timed run, the medians per mode and input, the whole report.

Plain dataclasses shared by the timing harness (:mod:`rapidspec.bench.speed`),
the ``llama.cpp`` peer (:mod:`rapidspec.bench.llama_peer`), the CLI's
tables and the figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rapidspec.bench.inputs import Sweep


@dataclass
class Measurement:
    """One timed generation of one variant (engine stats or the hf-assisted equivalents)."""

    token_ids: tuple[int, ...]
    text: str
    prompt_tokens_target: int
    prompt_tokens_drafter: int
    retrieval_seconds: float
    target_prefill_seconds: float
    drafter_prefill_seconds: float | None
    decode_seconds: float
    total_seconds: float
    new_tokens: int
    decode_tokens_per_second: float | None
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    accept_seconds: float = 0.0
    bookkeeping_seconds: float = 0.0
    peak_rss_bytes: int = 0
    peak_cuda_bytes: int | None = None


@dataclass
class Result:
    """One variant at one input: medians over the repeats, and comparisons with ``lc``."""

    label: str
    mode: str
    length: int  # requested prompt length (0 for --data records)
    item_index: int
    repeats: int
    prompt_tokens_target: int
    prompt_tokens_drafter: int
    new_tokens: int
    retrieval_seconds: float
    target_prefill_seconds: float
    drafter_prefill_seconds: float | None
    decode_seconds: float
    total_seconds: float
    decode_tokens_per_second: float | None
    rounds: int
    acceptance_rate: float | None
    mean_accepted_length: float | None
    eta: float | None = None
    gamma: int | None = None
    sweep_value: float | int | None = None
    decode_speedup: float | None = None
    end_to_end_speedup: float | None = None
    equals_lc: bool | None = None
    # highest over the repeats: resident memory of the whole process, and CUDA allocations
    peak_rss_gib: float = 0.0
    peak_cuda_gib: float | None = None
    # --profile: medians of the decode split, in total and per round
    profile: dict[str, float] | None = None
    text: str = ""
    token_ids: tuple[int, ...] = field(default=(), repr=False)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("token_ids")
        return out


@dataclass
class BenchReport:
    """Everything ``rapidspec bench`` measured."""

    model: str
    drafter: str
    device: str
    dtype: str
    repeats: int
    max_new_tokens: int
    ignore_eos: bool
    shared_prefill: bool
    gamma: int
    eta: float
    sweep: Sweep | None
    results: list[Result]
    draft_confidence: float = 0.0

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "drafter": self.drafter,
            "device": self.device,
            "dtype": self.dtype,
            "repeats": self.repeats,
            "max_new_tokens": self.max_new_tokens,
            "ignore_eos": self.ignore_eos,
            "shared_prefill": self.shared_prefill,
            "gamma": self.gamma,
            "eta": self.eta,
            "draft_confidence": self.draft_confidence,
            "sweep": asdict(self.sweep) if self.sweep else None,
            "results": [r.to_dict() for r in self.results],
        }
