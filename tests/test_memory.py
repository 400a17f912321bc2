"""Peak memory measurement used by ``rapidspec bench``."""

from __future__ import annotations

import gc
import time

import psutil
import pytest
import torch

from rapidspec.evaluation.memory import PeakMemory


def test_peak_sees_a_temporary_allocation():
    gc.collect()  # garbage of earlier tests freed now cannot lower the RSS during the block
    before = psutil.Process().memory_info().rss
    with PeakMemory(interval_s=0.005) as peak:
        block = torch.ones(64 * 1024 * 1024)  # 256 MiB, touched
        time.sleep(0.1)  # twenty sampling intervals
        del block
    assert peak.peak_rss_bytes - before >= 200 * 1024 * 1024
    assert peak.peak_cuda_bytes is None


def test_cpu_devices_need_no_cuda():
    with PeakMemory(["cpu", torch.device("cpu")]) as peak:
        pass
    assert peak.peak_rss_bytes > 0 and peak.cuda_devices == []


def test_bad_interval_is_refused():
    with pytest.raises(ValueError):
        PeakMemory(interval_s=0)
