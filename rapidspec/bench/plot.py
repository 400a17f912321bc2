"""Figures of a :class:`rapidspec.bench.speed.BenchReport` (matplotlib, headless).

* Modes: decode throughput and speedup against target prompt length, one line
  per mode (as Figures 1 and 3 of the RAPID paper); end-to-end speedup dashed.
* Sweeps: decode speedup and acceptance rate against the swept value, one line
  per length.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from rapidspec.evaluation.report_plots import pyplot


def plot_report(report, path: str | Path) -> Path:
    """Write the figure of ``report`` to ``path`` (format from the suffix) and return the path."""
    plt = pyplot()
    path = Path(path)
    title = (
        f"{report.model} (drafter: {report.drafter}), {report.device} {report.dtype}, "
        f"{report.max_new_tokens} new tokens, median of {report.repeats}"
    )
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    if report.sweep is None:
        _plot_modes(report, left, right)
    else:
        _plot_sweep(report, left, right)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_modes(report, throughput_ax, speedup_ax) -> None:
    lines = defaultdict(list)  # label -> [(prompt tokens, result)]
    lc_tokens = {r.item_index: r.prompt_tokens_target for r in report.results if r.label == "lc"}
    for r in report.results:
        lines[r.label].append((lc_tokens.get(r.item_index, r.prompt_tokens_target), r))
    for label, points in lines.items():
        points.sort(key=lambda p: p[0])
        xs = [x for x, _ in points]
        line, = throughput_ax.plot(xs, [r.decode_tokens_per_second or 0 for _, r in points], marker="o", label=label)
        if label == "lc":
            speedup_ax.axhline(1.0, color=line.get_color(), linewidth=1, label="lc (= 1)")
            continue
        speedup_ax.plot(xs, [r.decode_speedup or 0 for _, r in points], marker="o", color=line.get_color(),
                        label=f"{label} decode")
        speedup_ax.plot(xs, [r.end_to_end_speedup or 0 for _, r in points], marker="x", linestyle="--",
                        color=line.get_color(), alpha=0.6, label=f"{label} end to end")
    throughput_ax.set(xlabel="target prompt tokens", ylabel="decode tokens/s", title="Decode throughput")
    speedup_ax.set(xlabel="target prompt tokens", ylabel="speedup vs lc (same run)", title="Speedup over lc")
    for ax in (throughput_ax, speedup_ax):
        ax.grid(alpha=0.3)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({x for points in lines.values() for x, _ in points}))
        ax.get_xaxis().set_major_formatter("{x:.0f}")
        ax.minorticks_off()
    throughput_ax.set_ylim(bottom=0)
    speedup_ax.set_ylim(bottom=0)
    throughput_ax.legend(fontsize=8)
    speedup_ax.legend(fontsize=7, ncol=2)


def _plot_sweep(report, speedup_ax, acceptance_ax) -> None:
    param = report.sweep.param
    by_item = defaultdict(list)
    lc_tokens = {r.item_index: r.prompt_tokens_target for r in report.results if r.label == "lc"}
    for r in report.results:
        if r.sweep_value is not None:
            by_item[r.item_index].append(r)
    for index, results in sorted(by_item.items()):
        results.sort(key=lambda r: r.sweep_value)
        xs = [r.sweep_value for r in results]
        name = f"{lc_tokens.get(index, '?')} tokens"
        line, = speedup_ax.plot(xs, [r.decode_speedup or 0 for r in results], marker="o", label=name)
        for r in results:  # hollow marker: the answer differs from lc's
            if r.equals_lc is False:
                speedup_ax.plot([r.sweep_value], [r.decode_speedup or 0], marker="o", markersize=11,
                                markerfacecolor="none", color=line.get_color())
        acceptance_ax.plot(xs, [r.acceptance_rate or 0 for r in results], marker="o", label=name)
    speedup_ax.axhline(1.0, color="grey", linewidth=1)
    speedup_ax.set_ylim(bottom=0)
    speedup_ax.set(xlabel=param, ylabel="decode speedup vs lc", title=f"rapid: speed against {param} (ring: answer != lc)")
    acceptance_ax.set(xlabel=param, ylabel="acceptance rate", title=f"rapid: acceptance against {param}", ylim=(0, 1.05))
    for ax in (speedup_ax, acceptance_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
