"""``rapidspec bench``'s tables: one row per input and mode, and where speculative decode time goes."""

from __future__ import annotations

from rich.table import Table

from rapidspec.bench.results import BenchReport


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def results_table(report: BenchReport) -> Table:
    """One row per input and mode: prefill, decode speed, acceptance, speedups and equality with lc."""
    what = f"rapid, {report.sweep.param} sweep" if report.sweep else "modes"
    table = Table(title=(
        f"rapidspec bench ({what}): {report.model}, drafter {report.drafter}, {report.device} {report.dtype}, "
        f"gamma {report.gamma}, eta {report.eta:g}, "
        f"{f'draft confidence {report.draft_confidence:g}, ' if report.draft_confidence else ''}"
        f"{report.max_new_tokens} new tokens"
        f"{' (EOS ignored)' if report.ignore_eos else ''}, median of {report.repeats}"
        f"{', target prefill shared' if report.shared_prefill else ''}"
    ))
    for name in ("prompt tok", "mode", "target prefill s", "drafter prefill s", "decode tok/s", "accept rate",
                 "mean acc len", "decode speedup", "e2e speedup", "= lc", "peak GiB"):
        table.add_column(name, justify="left" if name == "mode" else "right")
    previous = None
    for r in report.results:
        if previous is not None and r.item_index != previous:
            table.add_section()
        previous = r.item_index
        table.add_row(
            str(r.prompt_tokens_target),
            r.label,
            _fmt(r.target_prefill_seconds, ".2f"),
            _fmt(r.drafter_prefill_seconds, ".2f"),
            _fmt(r.decode_tokens_per_second, ".2f"),
            _fmt(r.acceptance_rate, ".1%"),
            _fmt(r.mean_accepted_length, ".2f"),
            _fmt(r.decode_speedup, ".2f") + ("x" if r.decode_speedup is not None else ""),
            _fmt(r.end_to_end_speedup, ".2f") + ("x" if r.end_to_end_speedup is not None else ""),
            {True: "yes", False: "no", None: "-"}[r.equals_lc],
            f"{r.peak_rss_gib:.2f}" + (f" (cuda {r.peak_cuda_gib:.2f})" if r.peak_cuda_gib is not None else ""),
        )
    return table


def profile_table(report: BenchReport) -> Table:
    """Where speculative decode time goes: ms per round and seconds in total, per phase."""
    table = Table(title="decode time split (ms per round / s in total)")
    for name in ("prompt tok", "mode", "rounds", "draft", "verify", "accept math", "bookkeeping"):
        table.add_column(name, justify="left" if name == "mode" else "right")
    for r in report.results:
        if not r.profile:
            continue
        cells = [
            f"{r.profile[f'{phase}_ms_per_round']:.1f} / {r.profile[f'{phase}_seconds']:.2f}"
            for phase in ("draft", "verify", "accept", "bookkeeping")
        ]
        table.add_row(str(r.prompt_tokens_target), r.label, str(r.rounds), *cells)
    return table
