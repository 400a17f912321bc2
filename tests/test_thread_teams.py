"""benchmarks/thread_teams.py: one arm on the tiny model (the timing itself is the benchmark's, not a test's)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location("thread_teams", Path(__file__).parents[1] / "benchmarks" / "thread_teams.py")
thread_teams = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(thread_teams)


def test_an_arm_decodes_before_and_after_a_helper_threads_copy(tiny_model_dir):
    row = thread_teams.one_arm("helper_thread", str(tiny_model_dir), tokens=300, answers=2, new_tokens=4)
    assert row["arm"] == "helper_thread" and row["helper_threads"] == 1  # the helper ran torch on itself alone
    assert len(row["before_ms"]) == len(row["after_ms"]) == 2
    assert row["before_median_ms"] > 0 and row["after_median_ms"] > 0
