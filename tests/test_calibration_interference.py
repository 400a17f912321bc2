"""Step costs that a busy machine cannot poison (rapidspec.drafting.calibration, rapidspec.runtime.interference).

A measurement beside other busy processes is marked busy (the share of the CPUs they took is read from
/proc/stat); a busy entry is measured again once RECHECK_S have passed since any process measured or checked it,
a quiet measurement replaces it and a busy one never replaces a quiet one. ``rapidspec calibrate`` measures on purpose, shows and forgets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rapidspec.cli import main
from rapidspec.drafting.calibration import CostBook, DrafterCosts, TargetCosts
from rapidspec.runtime import interference
from rapidspec.runtime.interference import CpuTimes, Watch, others_share, read_times


def test_others_share_is_the_busy_time_that_is_not_ours():
    before = CpuTimes(busy=10.0, total=20.0, own=3.0)
    assert others_share(before, CpuTimes(busy=11.8, total=22.0, own=3.9)) == pytest.approx(0.45)
    assert others_share(before, CpuTimes(busy=11.0, total=22.0, own=4.0)) == 0.0  # all ours
    assert others_share(before, CpuTimes(busy=10.0, total=20.0, own=3.0)) == 0.0  # no time passed
    assert others_share(before, CpuTimes(busy=14.0, total=22.0, own=3.0)) == 1.0  # clamped


def test_cpu_times_from_a_stat_file(tmp_path):
    stat = tmp_path / "stat"
    hertz = os.sysconf("SC_CLK_TCK")
    stat.write_text(f"cpu  {3 * hertz} 0 {hertz} {4 * hertz} {hertz} 0 0 0 {hertz} 0\ncpu0 1 2 3 4\n")
    times = read_times(str(stat))
    assert (times.busy, times.total) == (4.0, 9.0)  # guest time is inside user time: not counted twice
    assert read_times(str(tmp_path / "missing")) is None
    with Watch(str(tmp_path / "missing")) as watch:
        time.sleep(interference.MIN_WINDOW_S)
    assert watch.others is None and not watch.busy  # unknown where the kernel's counters cannot be read


def _spin_for(seconds: float) -> None:
    end = time.perf_counter() + seconds
    a = torch.randn(256, 256)
    while time.perf_counter() < end:
        a @ a


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="the others' share is read from Linux's /proc/stat")
def test_a_measurement_beside_busy_processes_is_marked_busy_and_replaced_by_a_quiet_one(tmp_path, monkeypatch):
    """One spinning process per CPU (bounded: killed after the measurement, 60 s at most) takes well over half the
    machine while this one measures for 0.5 s: the entry is marked busy (others' share > 10%; with n spinners the
    fair scheduler leaves them about n / (n + 1), so this fails only on a machine that never runs them). A later
    process's quiet measurement, once RECHECK_S have passed (its watch told quiet: the other test worker may be
    computing), replaces it."""
    from rapidspec.drafting import calibration

    path = tmp_path / "costs.json"
    spinners = [subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 60\nwhile time.time() < end: pass"])
                for _ in range(min(os.cpu_count() or 1, 16))]
    try:
        time.sleep(0.3)  # they are running
        busy = CostBook(path).get(DrafterCosts, "drafter x", lambda: (_spin_for(0.5), DrafterCosts(0.02, 0.001))[1])
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert busy == DrafterCosts(0.02, 0.001)
    (entry,) = json.loads(path.read_text())["machines"].popitem()[1].values()
    assert entry["busy"] is True and entry["others"] > interference.BUSY_SHARE and entry["measured_at"]

    monkeypatch.setattr(calibration, "RECHECK_S", 0.0)
    quiet = CostBook(path, watch=lambda: _Told(0.01))
    assert quiet.get(DrafterCosts, "drafter x", lambda: DrafterCosts(0.01, 0.0005)) == DrafterCosts(0.01, 0.0005)
    (entry,) = json.loads(path.read_text())["machines"].popitem()[1].values()
    assert entry["busy"] is False and entry["step"] == 0.01


class _Told(Watch):
    """A watch that reports a given share of the others (the policy's tests need no busy machine)."""

    def __init__(self, others: float) -> None:
        super().__init__()
        self.told = others

    def __exit__(self, *exc) -> None:
        self.others = self.told


def _book(path, others: float) -> CostBook:
    return CostBook(path, watch=lambda: _Told(others))


def test_a_busy_measurement_never_replaces_a_quiet_one_and_two_busy_keep_the_lower(tmp_path, monkeypatch):
    from rapidspec.drafting import calibration

    monkeypatch.setattr(calibration, "RECHECK_S", 0.0)  # every new process checks a busy entry again
    path, calls = tmp_path / "costs.json", []

    def measure(value):
        def run():
            calls.append(value)
            return TargetCosts(value, 0.0)
        return run

    assert _book(path, 0.02).get(TargetCosts, "t", measure(0.10)).base == 0.10  # quiet, kept
    assert _book(path, 0.6).get(TargetCosts, "t", measure(0.30)).base == 0.10 and calls == [0.10]  # read, not measured
    again = _book(path, 0.6)
    assert again.get(TargetCosts, "t", measure(0.30), again=True).base == 0.10  # measured on purpose, busy: not kept
    assert calls == [0.10, 0.30] and next(iter(again.not_kept.values()))["busy"]

    path.unlink()
    assert _book(path, 0.5).get(TargetCosts, "t", measure(0.20)).base == 0.20  # busy: kept for now
    assert _book(path, 0.5).get(TargetCosts, "t", measure(0.40)).base == 0.20  # busy again, higher: the lower stays
    assert _book(path, 0.5).get(TargetCosts, "t", measure(0.15)).base == 0.15  # busy again, lower: it replaces
    assert _book(path, 0.0).get(TargetCosts, "t", measure(0.12)).base == 0.12  # quiet at last: replaces
    assert _book(path, 0.5).get(TargetCosts, "t", measure(0.50)).base == 0.12 and calls[-1] == 0.12  # and stays


def test_a_busy_entry_of_this_process_is_measured_again_after_the_recheck_time(tmp_path, monkeypatch):
    from rapidspec.drafting import calibration

    book, calls = _book(tmp_path / "costs.json", 0.5), []
    measure = lambda: calls.append(1) or 0.001  # noqa: E731
    book.get(float, "embedder", measure)
    book.get(float, "embedder", measure)
    assert len(calls) == 1  # busy, but measured by this process a moment ago
    monkeypatch.setattr(calibration, "RECHECK_S", 0.0)
    book.get(float, "embedder", measure)
    assert len(calls) == 2
    (entry,) = book.entries()
    assert entry["busy"] and entry["value"] == 0.001 and entry["key"].startswith("embedder")


def test_a_busy_entry_is_checked_once_per_recheck_time_whichever_process_asks(tmp_path, monkeypatch):
    """On a machine that stays busy, a new process reads a busy entry measured or checked less than RECHECK_S
    ago; once that has passed, one process measures again and, keeping the lower entry, marks it checked."""
    from rapidspec.drafting import calibration

    path, calls = tmp_path / "costs.json", []
    measure = lambda value: lambda: calls.append(value) or value  # noqa: E731
    assert _book(path, 0.5).get(float, "embedder", measure(0.002)) == 0.002  # busy, kept
    assert _book(path, 0.5).get(float, "embedder", measure(0.003)) == 0.002 and calls == [0.002]  # read: too soon
    monkeypatch.setattr(calibration, "RECHECK_S", 0.0)
    assert _book(path, 0.5).get(float, "embedder", measure(0.004)) == 0.002 and calls == [0.002, 0.004]  # checked
    (entry,) = json.loads(path.read_text())["machines"].popitem()[1].values()
    assert entry["value"] == 0.002 and entry["checked_at"] >= entry["measured_at"]
    monkeypatch.setattr(calibration, "RECHECK_S", 600.0)
    assert _book(path, 0.5).get(float, "embedder", measure(0.001)) == 0.002 and len(calls) == 2  # checked just now
    entry["checked_at"] = "2000-01-01T00:00:00+00:00"  # long ago
    path.write_text(json.dumps({**json.loads(path.read_text()), "machines": {
        machine: {key: entry for key in entries} for machine, entries in json.loads(path.read_text())["machines"].items()}}))
    assert _book(path, 0.5).get(float, "embedder", measure(0.001)) == 0.001 and calls[-1] == 0.001  # due: lower wins


def test_rapidspec_calibrate_measures_shows_and_forgets(tiny_model_dir, tmp_path, monkeypatch, capsys):
    step_costs_file = tmp_path / "step_costs.json"
    monkeypatch.setenv("RAPIDSPEC_STEP_COSTS", str(step_costs_file))
    common = ["--target", str(tiny_model_dir), "--drafter", str(tiny_model_dir), "--retrieval", "bm25"]
    assert main(["calibrate", *common, "--contexts", "64,300", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    keys = [e["key"] for e in measured["entries"]]
    assert any(k.startswith("drafter") for k in keys) and len([k for k in keys if "verify at 512 tokens" in k]) == 1
    assert all({"measured_at", "load", "others", "busy"} <= set(e) for e in measured["entries"])
    assert len(keys) == 2  # 64 and 300 tokens share the 512-token bucket; bm25 embeds nothing

    assert main(["calibrate", "--show", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert sorted(e["key"] for e in shown["entries"]) == sorted(keys) and shown["file"] == str(step_costs_file)
    assert main(["calibrate", "--show"]) == 0
    text = capsys.readouterr().out
    assert "verify at 512 tokens" in text and "measured 20" in text and "load" in text

    assert main(["calibrate", "--clear"]) == 0
    assert "forgot 2" in capsys.readouterr().out
    assert main(["calibrate", "--show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == []


@pytest.mark.parametrize(("args", "message"), [
    (["--contexts", "1k"], "--contexts takes token counts"),
    (["--contexts", "1"], "--contexts takes token counts of at least 2"),
    (["--contexts", "100000"], "must be 2 to 4087 tokens"),  # beyond the tiny model's window: after it loads
    (["--show", "--clear"], "do not go together"),
])
def test_calibrate_mistakes_are_one_line(tiny_model_dir, args, message, capsys):
    assert main(["calibrate", "--target", str(tiny_model_dir), "--quiet", *args]) == 2
    errors = [line for line in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in line]
    assert len(errors) == 1 and message in errors[0]  # one line (a model's loading bars aside, where it loaded)
