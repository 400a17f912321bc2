"""Peak memory measurement used by ``rapidspec bench``."""

from __future__ import annotations

import mmap
import time

import psutil
import pytest
import torch

from rapidspec.bench.memory import PeakMemory


def test_peak_sees_a_temporary_allocation():
    """The block is a fresh anonymous mapping, touched page by page and unmapped: it adds 256 MiB to the
    resident set and gives them back whatever the allocator already holds (a torch tensor may reuse
    pages that a long-lived test process keeps resident, and then the resident set does not grow)."""
    rss = lambda: psutil.Process().memory_info().rss  # noqa: E731
    mib = 1024 * 1024
    with PeakMemory(interval_s=0.005) as peak:
        before = rss()
        block = mmap.mmap(-1, 256 * mib)
        pages = torch.frombuffer(block, dtype=torch.uint8)
        pages.fill_(1)  # every page resident
        during = rss()
        time.sleep(0.1)  # twenty sampling intervals
        del pages
        block.close()
        after = rss()
    assert during - before >= 200 * mib  # the block was resident
    assert peak.peak_rss_bytes >= during - 16 * mib  # the sampling thread saw it
    assert peak.peak_rss_bytes - max(before, after) >= 200 * mib  # and it was a peak above the memory around it
    assert peak.peak_cuda_bytes is None


def test_cpu_devices_need_no_cuda():
    with PeakMemory(["cpu", torch.device("cpu")]) as peak:
        pass
    assert peak.peak_rss_bytes > 0 and peak.cuda_devices == []


def test_bad_interval_is_refused():
    with pytest.raises(ValueError):
        PeakMemory(interval_s=0)
