"""Who got each item right: the paper's Figure 2 breakdown, from eval records.

Items are split by the two references, ``lc`` (the target reading
everything) and ``rag`` (the model reading the retrieved text only, which is
what a self-speculating drafter reads): right in both, in ``lc`` only, in
``rag`` only, or in neither. For every other run (rapid, ragsd, magicdec, at
each η and sweep point) the breakdown counts how many items of each group it
got right. Its right answers in the "neither" group are the paper's
"RAPID only" successes; its wrong answers where ``lc`` was right are what it
lost against the target. An answer counts as right when its score is at least
:data:`RIGHT_AT` (accuracy is 0 or 1; F1, ROUGE-L and recall are graded).

Each row also carries the run's gaps on the same items, with paired
bootstrap 95% intervals (items resampled together across the runs, 1000
resamples, seeded): ``vs_best`` = mean(run) - max(mean(lc), mean(rag)), the
paper's claim that RAPID is at least as good as the better reference, and
``vs_lc`` = mean(run) - mean(lc). An interval that excludes 0 is a
difference these items establish.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Score from which an answer counts as right.
RIGHT_AT = 0.5
#: The groups, by (lc right, rag right).
GROUPS = {(True, True): "both", (True, False): "lc only", (False, True): "rag only", (False, False): "neither"}


@dataclass(frozen=True)
class BreakdownRow:
    """One run (task group, mode, eta, gamma, sweep point) against the lc/rag split of the same items."""

    group: str
    mode: str
    eta: float
    gamma: int | None
    sweep: str | None
    items: dict[str, int]  # group name -> items in it
    right: dict[str, int]  # group name -> items this run got right
    vs_best: tuple[float, float, float] = (float("nan"),) * 3  # (gap, low, high): run - max(lc, rag)
    vs_lc: tuple[float, float, float] = (float("nan"),) * 3  # (gap, low, high): run - lc

    @property
    def n(self) -> int:
        return sum(self.items.values())

    @property
    def only_here(self) -> int:
        """Right where neither lc nor rag was (the paper's "RAPID only")."""
        return self.right["neither"]

    @property
    def lost(self) -> int:
        """Wrong where lc was right."""
        return self.items["both"] + self.items["lc only"] - self.right["both"] - self.right["lc only"]

    def to_dict(self) -> dict:
        return {
            "group": self.group, "mode": self.mode, "eta": self.eta, "gamma": self.gamma, "sweep": self.sweep,
            "n": self.n, "items": dict(self.items), "right": dict(self.right), "only_here": self.only_here,
            "lost_vs_lc": self.lost, "vs_best": list(self.vs_best), "vs_lc": list(self.vs_lc),
        }


def gap_text(gap: tuple[float, float, float]) -> str:
    """``+0.067 [-0.033, +0.167]``: a gap and its interval."""
    return "{:+.3f} [{:+.3f}, {:+.3f}]".format(*gap)


def paired_gaps(run: Sequence[float], lc: Sequence[float], rag: Sequence[float], resamples: int = 1000,
                seed: int = 0) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """((gap, low, high) of mean(run) - max(mean(lc), mean(rag)), the same of mean(run) - mean(lc)).

    The three score lists are aligned by item; the percentile bootstrap resamples items, so each
    resample keeps an item's three scores together.
    """
    scores = np.asarray([run, lc, rag], dtype=float)  # [3, n]
    picks = np.random.default_rng(seed).integers(0, scores.shape[1], size=(resamples, scores.shape[1]))
    means = scores[:, picks].mean(axis=2)  # [3, resamples]
    full = scores.mean(axis=1)  # [3]
    out = []
    for gap, resampled in ((full[0] - max(full[1], full[2]), means[0] - np.maximum(means[1], means[2])),
                           (full[0] - full[1], means[0] - means[1])):
        low, high = np.percentile(resampled, [2.5, 97.5])
        out.append((float(gap), float(min(low, gap)), float(max(high, gap))))
    return out[0], out[1]


def breakdown(records: Sequence[dict]) -> list[BreakdownRow]:
    """Rows for every run other than lc and rag, over the items where lc and rag were both scored.

    A run at a ``budget_tokens`` sweep point is compared with rag at the same
    point when there is one, else with rag's only run.
    """
    reference: dict[tuple, float] = {}  # (mode, sweep, id) -> score
    runs: dict[tuple, dict[str, float]] = defaultdict(dict)  # (group, mode, eta, gamma, sweep) -> id -> score
    for record in records:
        if record["mode"] in ("lc", "rag"):
            reference[(record["mode"], record.get("sweep"), record["id"])] = record["score"]
        else:
            key = (record["group"], record["mode"], record["eta"], record["gamma"], record.get("sweep"))
            runs[key][record["id"]] = record["score"]
    rows = []
    for (group, mode, eta, gamma, sweep), answers in runs.items():
        items = dict.fromkeys(GROUPS.values(), 0)
        right = dict.fromkeys(GROUPS.values(), 0)
        aligned: list[tuple[float, float, float]] = []  # (run, lc, rag) per item
        for item_id, score in answers.items():
            lc = reference.get(("lc", None, item_id))
            rag = reference.get(("rag", sweep, item_id), reference.get(("rag", None, item_id)))
            if lc is None or rag is None:
                continue
            name = GROUPS[(lc >= RIGHT_AT, rag >= RIGHT_AT)]
            items[name] += 1
            right[name] += int(score >= RIGHT_AT)
            aligned.append((score, lc, rag))
        if aligned:
            gaps = paired_gaps(*zip(*aligned))
            rows.append(BreakdownRow(group, mode, eta, gamma, sweep, items, right, *gaps))
    return rows


_LENGTH = re.compile(r"@(\d+)$")


def speedups(records: Sequence[dict]) -> dict[tuple, float]:
    """Run key (group, mode, eta, gamma, sweep) -> median over items of decode tok/s over lc's on the same item."""
    lc = {r["id"]: r["stats"].get("decode_tokens_per_second") for r in records if r["mode"] == "lc"}
    ratios = defaultdict(list)
    for r in records:
        own, base = r["stats"].get("decode_tokens_per_second"), lc.get(r["id"])
        if own and base:
            ratios[(r["group"], r["mode"], r["eta"], r["gamma"], r.get("sweep"))].append(own / base)
    return {key: statistics.median(values) for key, values in ratios.items()}


def group_length(group: str) -> int | None:
    """The prompt length of a synthetic task group (``synthetic/niah_single@4096`` -> 4096), else None."""
    match = _LENGTH.search(group)
    return int(match.group(1)) if match else None
