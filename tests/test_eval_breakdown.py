"""The Figure 2 breakdown: items split by lc and rag, each other run counted per group."""

from __future__ import annotations

import pytest

from rapidspec.evaluation.breakdown import breakdown, paired_gaps


def record(item, mode, score, eta=0.0, sweep=None, group="g"):
    return {"id": item, "group": group, "mode": mode, "eta": eta, "gamma": None if mode in ("lc", "rag") else 6,
            "sweep": sweep, "score": score}


def test_items_split_by_lc_and_rag_and_each_run_counted_per_group():
    truth = {  # item: (lc, rag, rapid)
        "a": (1, 1, 1), "b": (1, 0, 0), "c": (0, 1, 1), "d": (0, 0, 1), "e": (0, 0, 0), "f": (1, 0, 1),
    }
    records = []
    for item, (lc, rag, rapid) in truth.items():
        records += [record(item, "lc", lc), record(item, "rag", rag), record(item, "rapid", rapid, eta=2.0)]
    records.append(record("z", "rapid", 1.0, eta=2.0))  # no lc/rag: not counted
    (row,) = breakdown(records)
    assert row.items == {"both": 1, "lc only": 2, "rag only": 1, "neither": 2}
    assert row.right == {"both": 1, "lc only": 1, "rag only": 1, "neither": 1}
    assert row.n == 6 and row.only_here == 1 and row.lost == 1
    assert row.to_dict()["lost_vs_lc"] == 1


def test_graded_scores_sweeps_and_budget_points():
    records = [record("a", "lc", 0.4), record("a", "rag", 0.6, sweep="budget_tokens=256"),
               record("a", "rag", 0.2, sweep="budget_tokens=512"),
               record("a", "rapid", 0.5, eta=2.0, sweep="budget_tokens=256"),
               record("a", "rapid", 0.49, eta=2.0, sweep="budget_tokens=512")]
    rows = {row.sweep: row for row in breakdown(records)}
    assert rows["budget_tokens=256"].items["rag only"] == 1 and rows["budget_tokens=256"].right["rag only"] == 1
    assert rows["budget_tokens=512"].items["neither"] == 1 and rows["budget_tokens=512"].right["neither"] == 0


def test_paired_gaps_against_the_better_reference_and_lc():
    truth = {"a": (1, 1, 1), "b": (1, 0, 0), "c": (0, 1, 1), "d": (0, 0, 1), "e": (0, 0, 0), "f": (1, 0, 1)}
    records = [record(i, m, s[k], eta=2.0 if m == "rapid" else 0.0)
               for i, s in truth.items() for k, m in enumerate(("lc", "rag", "rapid"))]
    (row,) = breakdown(records)
    # lc 3/6, rag 2/6, rapid 4/6: +1/6 over the better reference (lc) and over lc.
    assert row.vs_best[0] == pytest.approx(1 / 6) and row.vs_lc[0] == pytest.approx(1 / 6)
    assert row.vs_best[1] <= row.vs_best[0] <= row.vs_best[2] and row.vs_lc[1] < 0 < row.vs_lc[2]


def test_paired_intervals_resample_items_together():
    # rapid equals lc on every item: the paired gap to lc is exactly 0 with a zero-width interval,
    # although the scores vary a lot across items (an unpaired interval would be wide).
    run = [1, 0, 1, 0, 1, 1, 0, 0, 1, 0] * 3
    rag = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0] * 3
    best, lc = paired_gaps(run, run, rag)
    assert lc == (0.0, 0.0, 0.0) and best == (0.0, 0.0, 0.0)
    best, _ = paired_gaps([0.0] * 30, run, [1.0] * 30)  # rag is the better reference: gap -1, exactly
    assert best == (-1.0, -1.0, -1.0)
