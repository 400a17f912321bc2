"""A progress bar for long prefills, on stderr (rich), for ``generate``, ``chat``, ``bench`` and ``eval``.

:func:`prefill_bar` returns the ``prefill_progress`` callback the engine
takes, or None when nothing is to be shown: with ``--quiet``, or when stderr
is not a terminal (a pipe, a log file, CI). A prefill of fewer than
:data:`MIN_TOKENS` tokens shows nothing; a longer one shows a bar of tokens
prefilled that goes away when the prefill ends. Inside a command that already
shows a progress display (bench, eval) the bar is a task of that display.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

#: Prefills shorter than this show no bar (a few seconds at most on a CPU).
MIN_TOKENS = 4096


class PrefillBar:
    """``bar(done, total)``: called by the engine before the first prefill chunk and after each one."""

    def __init__(self, progress: Progress | None = None) -> None:
        self._own = progress is None
        self.progress = progress or Progress(
            TextColumn("prefill"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"), TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        self._task = None
        self._first: tuple[float, int] | None = None  # (time, tokens done) at the first call

    def __call__(self, done: int, total: int) -> None:
        if total < MIN_TOKENS:
            return
        if self._task is None:
            if self._own:
                self.progress.start()
            self._task = self.progress.add_task("prefill", total=total, rate="")
            self._first = (time.perf_counter(), done)
        elapsed, read = time.perf_counter() - self._first[0], done - self._first[1]
        rate = f"{read / elapsed:.0f} tokens/s" if elapsed > 0 and read > 0 else ""
        self.progress.update(self._task, completed=done, rate=rate)
        if done >= total:
            self.progress.remove_task(self._task)
            self._task = None
            if self._own:
                self.progress.stop()


def prefill_bar(quiet: bool, progress: Progress | None = None) -> PrefillBar | None:
    """The engine's ``prefill_progress`` callback, or None with ``quiet`` or when stderr is not a terminal."""
    if quiet or not sys.stderr.isatty():
        return None
    return PrefillBar(progress)
