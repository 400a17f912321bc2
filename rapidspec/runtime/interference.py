"""How much of the machine other processes took while this one measured something.

A cost measured while another process computes is too high, and a decision
made from it (rapidspec.drafting.calibration) would follow it for as long as
it is kept. :class:`Watch` reads the machine's CPU time (``/proc/stat``) and
this process's own (all its threads, :func:`os.times`) before and after a
measurement; the busy time that is not this process's is the others' share of
the machine. The load average at the start is kept beside it, for people.

Linux only: elsewhere, or over a window too short for the kernel's clock
ticks to tell (:data:`MIN_WINDOW_S`), the share is unknown (None).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

#: Shorter windows are not judged: /proc/stat counts in clock ticks (10 ms at the usual 100 Hz).
MIN_WINDOW_S = 0.1
#: A measurement during which other processes took more than this share of the machine's CPU time is busy.
BUSY_SHARE = 0.1
STAT_FILE = "/proc/stat"


@dataclass(frozen=True)
class CpuTimes:
    """The machine's busy and total CPU seconds (all CPUs) and this process's, at one moment."""

    busy: float
    total: float
    own: float


def others_share(before: CpuTimes, after: CpuTimes) -> float:
    """The share of the machine's CPU time between ``before`` and ``after`` that other processes used, in [0, 1].

    Example: 2 CPUs for 1 s (total 2.0), 1.8 s busy of which 0.9 s this process's -> 0.45.
    """
    total = after.total - before.total
    if total <= 0:
        return 0.0
    others = (after.busy - before.busy) - (after.own - before.own)
    return min(1.0, max(0.0, others / total))


def read_times(stat_file: str = STAT_FILE) -> CpuTimes | None:
    """Now's :class:`CpuTimes`, or None where ``stat_file`` cannot be read (not Linux)."""
    try:
        with open(stat_file, encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        return None
    ticks = [int(v) for v in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
    # guest time (fields 9 and 10) is already counted in user and nice
    total = sum(ticks[:8])
    hertz = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return CpuTimes(busy=(total - idle) / hertz, total=total / hertz, own=own.user + own.system)


def load_average() -> float | None:
    """The machine's 1-minute load average, or None where the system has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


class Watch:
    """``with Watch() as w: measure()``; then ``w.others`` (the others' share, None when unknown), ``w.load`` (the
    load average at the start) and ``w.busy`` (the others took more than :data:`BUSY_SHARE`)."""

    def __init__(self, stat_file: str = STAT_FILE) -> None:
        self.stat_file = stat_file
        self.others: float | None = None
        self.load: float | None = None
        self._before: CpuTimes | None = None
        self._started = 0.0

    def __enter__(self) -> Watch:
        self.load = load_average()
        self._before = read_times(self.stat_file)
        self._started = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        after = read_times(self.stat_file)
        if self._before is not None and after is not None and time.monotonic() - self._started >= MIN_WINDOW_S:
            self.others = round(others_share(self._before, after), 3)

    @property
    def busy(self) -> bool:
        return self.others is not None and self.others > BUSY_SHARE
