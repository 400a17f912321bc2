"""Statistics of an online serving benchmark, as ``vllm bench serve`` reports them.

Every request ends in one outcome: ``completed`` (an answer with a finish
reason), ``rejected`` (429, the server's queue was full) or ``error`` (any
other 4xx, a 5xx, an ``error`` event in the stream, a connection error, a
stream cut short, no answer within the time limit). An error with no answer
from the server (a connection error or timeout, a 5xx, an unreadable body, a
stream that ended without a finish reason) is also ``lost``.

Timings are taken on the client, from the moment a request is sent:

* TTFT: time to the first stream chunk carrying text;
* TPOT: per request, ``(latency - TTFT) / (output tokens - 1)``;
* ITL: every gap between consecutive chunks carrying text, pooled over the
  requests (per chunk: with speculative decoding a chunk may carry several
  tokens, so ITL >= TPOT; ``mean_output_tokens_per_chunk`` says by how much);
* E2EL: time to the end of the answer.

They are summarised over the completed requests (mean, median, p90, p95,
p99, in milliseconds); output token counts are the server's ``usage``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

OUTCOMES = ("completed", "rejected", "error")
PERCENTILES = (90, 95, 99)


@dataclass
class RequestResult:
    """What happened to one request; times are seconds since it was sent."""

    index: int
    outcome: str = "error"
    lost: bool = False
    status: int | None = None
    detail: str | None = None
    ttft: float | None = None
    latency: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # each chunk carrying text
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    session: str | None = None  # the x-session-id it was sent with
    speculative: dict | None = None  # the answer's metrics.speculative_decoding (vLLM's schema), when the server sent it

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first (None without a stream or with one token)."""
        if self.ttft is None or self.latency is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive chunks carrying text."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile with linear interpolation between ranks (numpy's default); None when empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(name: str, seconds: Sequence[float]) -> dict[str, float | None]:
    """``mean_NAME_ms``, ``median_NAME_ms`` and ``pQ_NAME_ms`` of ``seconds``, in milliseconds."""
    ms = [s * 1000 for s in seconds]
    out = {f"mean_{name}_ms": sum(ms) / len(ms) if ms else None, f"median_{name}_ms": percentile(ms, 50)}
    out.update({f"p{q}_{name}_ms": percentile(ms, q) for q in PERCENTILES})
    return out


def speculative_summary(metrics: Sequence[dict]) -> dict:
    """Drafted and accepted tokens over the answers that sent vLLM's ``metrics.speculative_decoding`` (each a dict
    with ``num_drafts``, ``num_draft_tokens``, ``num_accepted_draft_tokens``); {} when none did."""
    if not metrics:
        return {}
    count = lambda name: sum(int(m.get(name) or 0) for m in metrics)  # noqa: E731
    drafts, drafted, accepted = count("num_drafts"), count("num_draft_tokens"), count("num_accepted_draft_tokens")
    return {"spec_requests": len(metrics), "spec_num_drafts": drafts, "spec_num_draft_tokens": drafted,
            "spec_num_accepted_draft_tokens": accepted,
            "spec_draft_acceptance_rate": accepted / drafted if drafted else None,
            "spec_mean_acceptance_length": 1 + accepted / drafts if drafts else None}


def summarize(results: Sequence[RequestResult], duration: float) -> dict:
    """Counts, throughputs and latency distributions of a finished load (vLLM's key names)."""
    counts = {outcome: sum(r.outcome == outcome for r in results) for outcome in OUTCOMES}
    done = [r for r in results if r.outcome == "completed"]
    output_tokens = sum(r.output_tokens or 0 for r in done)
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    streamed = [r for r in done if r.chunk_times and r.output_tokens]
    chunks = sum(len(r.chunk_times) for r in streamed)
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    failed = next((r for r in results if r.outcome == "error"), None)
    summary = {
        "completed": counts["completed"],
        "rejected": counts["rejected"],
        "errors": counts["error"],
        "lost": sum(r.lost for r in results),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "cached_input_tokens": sum(r.cached_tokens or 0 for r in done),
        "total_output_tokens": output_tokens,
        "requests_without_usage": sum(r.output_tokens is None for r in done),
        "request_throughput": per_second(counts["completed"]),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
        "mean_output_tokens_per_chunk": sum(r.output_tokens for r in streamed) / chunks if chunks else None,
    }
    summary |= distribution("ttft", [r.ttft for r in done if r.ttft is not None])
    summary |= distribution("tpot", [t for r in done if (t := r.tpot) is not None])
    summary |= distribution("itl", [gap for r in done for gap in r.itls])
    summary |= distribution("e2el", [r.latency for r in done if r.latency is not None])
    summary |= speculative_summary([r.speculative for r in done if r.speculative])
    summary["first_error"] = None if failed is None else f"request {failed.index}: {failed.detail}"
    sessions: dict[str, list[RequestResult]] = {}
    for r in done:
        if r.session is not None:
            sessions.setdefault(r.session, []).append(r)
    if sessions:  # the share of each session's prompt tokens its replica found in its prefix cache
        summary["prefix_reuse_by_session"] = {
            session: (sum(r.cached_tokens or 0 for r in rs) / prompt if (prompt := sum(r.prompt_tokens or 0 for r in rs))
                      else None) for session, rs in sorted(sessions.items())}
    return summary
