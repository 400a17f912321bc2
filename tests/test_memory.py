"""Peak memory measurement used by ``rapidspec bench``."""

from __future__ import annotations

import time

import psutil
import pytest
import torch

from rapidspec.bench.memory import PeakMemory


def test_peak_sees_a_temporary_allocation():
    """Compared with readings next to the block: the one after it (other memory freed meanwhile moves the
    baseline before it) or, where the allocator keeps the freed pages mapped, the one just before it."""
    rss = lambda: psutil.Process().memory_info().rss  # noqa: E731
    mib = 1024 * 1024
    with PeakMemory(interval_s=0.005) as peak:
        before = rss()
        block = torch.ones(64 * mib)  # 256 MiB, touched
        during = rss()
        time.sleep(0.1)  # twenty sampling intervals
        del block
        after = rss()
    assert peak.peak_rss_bytes >= during - 16 * mib  # the sampling thread saw the block
    assert peak.peak_rss_bytes - min(before, after) >= 200 * mib  # and it was a peak above the memory around it
    assert peak.peak_cuda_bytes is None


def test_cpu_devices_need_no_cuda():
    with PeakMemory(["cpu", torch.device("cpu")]) as peak:
        pass
    assert peak.peak_rss_bytes > 0 and peak.cuda_devices == []


def test_bad_interval_is_refused():
    with pytest.raises(ValueError):
        PeakMemory(interval_s=0)
