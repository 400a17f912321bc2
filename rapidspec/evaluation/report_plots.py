"""Figures of one results file for :mod:`rapidspec.evaluation.report` (matplotlib, headless).

* score against η (rapid's η sweep), lc and rag as horizontal references;
* score against the retrieval budget (a ``budget_tokens`` sweep), per mode;
* decode speedup against the target's prompt length (synthetic tasks carry
  their length), per mode.

Each is drawn only when the file has the runs it needs.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from rapidspec.evaluation.breakdown import group_length, speedups
from rapidspec.errors import RapidspecError


def pyplot():
    """matplotlib.pyplot on the headless Agg backend, or a one-line error naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RapidspecError("plots need matplotlib: pip install 'rapidspec[plot]'") from None
    return plt


def _mean_by(records, key) -> dict:
    values = defaultdict(list)
    for record in records:
        k = key(record)
        if k is not None:
            values[k].append(record["score"])
    return {k: statistics.fmean(v) for k, v in values.items()}


def _sweep_value(record, name: str) -> float | None:
    sweep = record.get("sweep") or ""
    return float(sweep.split("=", 1)[1]) if sweep.startswith(f"{name}=") else None


def plot_file(records: list[dict], stem: Path, figures: tuple[str, ...] = ("eta", "budget", "speedup")) -> list[Path]:
    """Write the ``figures`` these runs allow as ``{stem}_{eta,budget,speedup}.png``; their paths."""

    plt = pyplot()
    written = []

    def save(fig, suffix: str) -> None:
        path = stem.with_name(f"{stem.name}_{suffix}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    eta = _mean_by([r for r in records if r["mode"] == "rapid"], lambda r: _sweep_value(r, "eta"))
    if "eta" in figures and len(eta) > 1:
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        xs = sorted(eta)
        ax.plot(xs, [eta[x] for x in xs], marker="o", label="rapid")
        for mode, style in (("lc", "--"), ("rag", ":")):
            reference = [r["score"] for r in records if r["mode"] == mode and r.get("sweep") is None]
            if reference:
                ax.axhline(statistics.fmean(reference), linestyle=style, color="grey", label=mode)
        ax.set(xlabel="η", ylabel="mean score", title="score against η")
        ax.legend()
        save(fig, "eta")

    budgets = defaultdict(dict)
    for (mode, value), score in _mean_by(records, lambda r: (r["mode"], _sweep_value(r, "budget_tokens"))
                                         if _sweep_value(r, "budget_tokens") is not None else None).items():
        budgets[mode][value] = score
    if "budget" in figures and any(len(points) > 1 for points in budgets.values()):
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for mode, points in budgets.items():
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], marker="o", label=mode)
        ax.set(xscale="log", xlabel="retrieved tokens (budget)", ylabel="mean score", title="score against retrieval length")
        ax.legend()
        save(fig, "budget")

    by_length = defaultdict(lambda: defaultdict(list))  # label -> length -> speedups
    for (group, mode, eta_value, _, sweep), speedup in speedups(records).items():
        length = group_length(group)
        if length is not None and mode != "lc":
            by_length[mode + (f" {sweep}" if sweep else "")][length].append(speedup)
    if "speedup" in figures and any(len(points) > 1 for points in by_length.values()):
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for label, points in by_length.items():
            xs = sorted(points)
            ax.plot(xs, [statistics.median(points[x]) for x in xs], marker="o", label=label)
        ax.axhline(1.0, color="grey", linestyle="--")
        ax.set(xscale="log", xlabel="target prompt tokens", ylabel="decode speedup vs lc", title="speedup against context length")
        ax.legend(fontsize="small")
        save(fig, "speedup")
    return written
