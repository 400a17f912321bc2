"""benchmarks/soak.py checks the server's own request counters against what its clients sent."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def _soak(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # soak.py imports its neighbour soak_mix.py
    spec = importlib.util.spec_from_file_location("soak", BENCHMARKS / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_count_verdict_fails_on_a_request_the_server_did_not_count(monkeypatch):
    soak = _soak(monkeypatch)
    counters = {'rapidspec:request_success_total{finished_reason="length"}': 10.0,
                'rapidspec:request_failure_total{reason="cancelled"}': 3.0,
                'rapidspec:request_failure_total{reason="bad_request"}': 2.0,
                'rapidspec:request_failure_total{reason="queue_full"}': 0.0}
    name, passed, text = soak.count_verdict(15, counters)
    assert passed and text == "15 counted of 15 sent (reason=\"bad_request\" 2, reason=\"cancelled\" 3, finished_reason=\"length\" 10)"
    _, passed, text = soak.count_verdict(16, counters)  # a stream closed before its first byte, say
    assert not passed and text.startswith("15 counted of 16 sent")
    assert soak.count_verdict(0, {}) == (name, True, "0 counted of 0 sent (none)")
