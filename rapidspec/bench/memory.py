"""Peak memory of a block of work, for ``rapidspec bench``.

:class:`PeakMemory` is a context manager that records, while its block runs:

* ``peak_rss_bytes``: the highest resident set size of the whole process
  (weights, KV caches, activations, Python), sampled by a background thread
  every ``interval_s`` seconds; the readings at entry and exit are included,
  so a block shorter than one interval still gets a value;
* ``peak_cuda_bytes``: for each CUDA device in use, the peak of
  ``torch.cuda.max_memory_allocated`` during the block (the counter is reset
  on entry), summed over devices; ``None`` without CUDA.

Sampling can miss a spike shorter than the interval; the figure is a lower
bound of the true peak, close to it for the multi-second generations
benchmarked here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import psutil
import torch

GIB = 1024**3


class PeakMemory:
    """``with PeakMemory(devices) as peak: ...`` then read ``peak.peak_rss_bytes``."""

    def __init__(self, devices: Iterable[torch.device | str] = (), interval_s: float = 0.02) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.interval_s = interval_s
        self.cuda_devices = sorted({torch.device(d) for d in devices if torch.device(d).type == "cuda"}, key=str)
        self.peak_rss_bytes = 0
        self.peak_cuda_bytes: int | None = None
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        self.peak_rss_bytes = max(self.peak_rss_bytes, self._process.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "PeakMemory":
        for device in self.cuda_devices:
            torch.cuda.reset_peak_memory_stats(device)
        self._sample()
        self._thread = threading.Thread(target=self._run, name="rapidspec-peak-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        if self.cuda_devices:
            self.peak_cuda_bytes = sum(torch.cuda.max_memory_allocated(d) for d in self.cuda_devices)
