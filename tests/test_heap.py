"""The heap trimmer: at most once per interval, nothing where the C library has no malloc_trim."""

from __future__ import annotations

import platform

import pytest

import rapidspec.runtime.heap as heap
from rapidspec.runtime.heap import HeapTrimmer


def test_trims_at_most_once_per_interval(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "_malloc_trim", lambda: calls.append)
    clock = iter([0.0, 5.0, 10.5, 10.6, 12.0, 21.0, 21.1])
    monkeypatch.setattr(heap.time, "monotonic", lambda: next(clock))
    trimmer = HeapTrimmer(every_s=10.0)  # made at 0.0
    assert not trimmer.maybe_trim()  # 5.0
    assert trimmer.maybe_trim()  # 10.5, done at 10.6
    assert not trimmer.maybe_trim()  # 12.0
    assert trimmer.maybe_trim()  # 21.0
    assert calls == [0, 0] and trimmer.trims == 2


def test_nothing_where_there_is_no_malloc_trim(monkeypatch):
    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)
    trimmer = HeapTrimmer(every_s=0.0)
    assert not trimmer.available and not trimmer.maybe_trim()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_the_real_trim_runs_on_glibc():
    trimmer = HeapTrimmer(every_s=0.0)
    assert trimmer.available and trimmer.maybe_trim() and trimmer.trims == 1
