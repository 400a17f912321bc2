"""Human-readable statistics tables (rich) shared by generate, demo and bench."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from rapidspec.stats import GenerationStats


def _prefill(seconds: float, reused: int, disk: int) -> str:
    """Seconds, and the prompt tokens not prefilled (kept from an earlier prompt or, of those, read from disk)."""
    if not reused:
        return f"{seconds:.2f}"
    return f"{seconds:.2f} (reused {reused} tok{f', {disk} from disk' if disk else ''})"


# (label, how to read the value from a GenerationStats)
ROWS: tuple[tuple[str, object], ...] = (
    ("eta (why)", lambda s: f"{s.eta:g} ({s.eta_source})" if s.eta_source else f"{s.eta:g}"),
    ("prompt tokens (target / drafter)", lambda s: f"{s.prompt_tokens_target} / {s.prompt_tokens_drafter or '-'}"),
    ("retrieved tokens (chunks)", lambda s: f"{s.retrieved_tokens} ({s.retrieved_chunks})" if s.retrieved_chunks else "-"),
    ("retrieval s", lambda s: f"{s.retrieval_seconds:.2f}"),
    ("target prefill s", lambda s: _prefill(s.target_prefill_seconds, s.target_prefill_reused_tokens,
                                              s.target_prefill_disk_tokens)),
    ("drafter prefill s", lambda s: _prefill(s.drafter_prefill_seconds, s.drafter_prefill_reused_tokens,
                                               s.drafter_prefill_disk_tokens)),
    ("decode s", lambda s: f"{s.decode_seconds:.2f}"),
    ("time to first token s", lambda s: f"{s.time_to_first_token:.2f}"),
    ("drafter joined after (s)", lambda s: "-" if s.drafter_joined_at is None
     else f"{s.drafter_joined_at} tok ({s.drafter_join_seconds:.2f})"),
    ("new tokens", lambda s: str(s.new_tokens)),
    ("decode tokens/s", lambda s: _num(s.decode_tokens_per_second, "{:.2f}")),
    ("rounds", lambda s: str(s.rounds)),
    ("drafts per round (plain rounds)", lambda s: f"{s.mean_drafts_per_round:.2f} ({s.plain_rounds})" if s.drafted_tokens else "-"),
    ("drafted / accepted", lambda s: f"{s.drafted_tokens} / {s.accepted_tokens}" if s.drafted_tokens else "-"),
    ("acceptance rate", lambda s: _num(s.acceptance_rate, "{:.1%}")),
    ("mean accepted length", lambda s: _num(s.mean_accepted_length, "{:.2f}")),
    ("per-position acceptance", lambda s: " ".join(f"{a:.2f}" for a in s.per_position_acceptance) or "-"),
    ("stop reason", lambda s: s.stop_reason),
)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def stats_table(columns: Sequence[tuple[str, GenerationStats]], title: str | None = None) -> Table:
    """A table with one column per (name, stats) pair."""
    table = Table(title=title)
    table.add_column("")
    for name, _ in columns:
        table.add_column(name, justify="right")
    for label, read in ROWS:
        table.add_row(label, *(read(stats) for _, stats in columns))
    return table
