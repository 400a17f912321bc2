"""One computing thread per process: torch's and llama.cpp's OpenMP threads belong to it alone.

torch and llama.cpp share one OpenMP runtime (libgomp, loaded once), which
gives every thread that runs a parallel region a team of threads of its own
and keeps it. Once the teams hold more threads than the process has CPUs,
libgomp stops letting idle team threads spin, so every small parallel region
(a decode step runs hundreds) waits for threads to wake up. Measured on a
2-core machine (2026-11-26): a bfloat16 linear layer over 4 rows took 2x as
long on a second thread as on the first, and a decode round of the built-in
model about 2x as long on a server's engine thread as in a script's main
thread, because the main thread had loaded the models with a team of its own.

So a process that computes on another thread than its main one (the
server's engine thread) gives that thread torch's threads
(:func:`computing_thread`) and every other thread that may touch torch one
(:func:`helper_thread`, before its first tensor operation: loading models on
the main thread, preparing requests, writing key/value blocks to disk, the
drafter's prefill beside the target's). In one process, once a long-lived helper
thread had copied with torch's threads, every later decode step took 2x as long
(`benchmarks/thread_teams.py`). :func:`compute_threads` is the number of
threads the computing thread uses (torch's count when first asked), which is
also the default of a llama.cpp drafter's threads.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)

#: How much lower a background thread's scheduling priority is than its process's (Linux's nice, per thread; 19 at most).
BACKGROUND_NICENESS = 10

_lock = threading.Lock()
_compute_threads: int | None = None


def compute_threads() -> int:
    """The intra-op threads of the computing thread: torch's count the first time this is asked."""
    global _compute_threads
    with _lock:
        if _compute_threads is None:
            _compute_threads = torch.get_num_threads()
        return _compute_threads


def _use_threads(count: int) -> None:
    # get_num_threads() first: torch sets a thread's count from a process-wide value on the thread's first
    # parallel operation, which would undo a count set before it.
    torch.get_num_threads()
    torch.set_num_threads(count)


def helper_thread() -> None:
    """This thread runs torch operations on itself alone (no OpenMP team of its own)."""
    compute_threads()
    _use_threads(1)


def background_thread() -> None:
    """A helper thread (:func:`helper_thread`) whose work may wait for the computing thread's: the kernel runs it
    at a lower priority (Linux's nice is per thread), so preparing a large request (sizing, retrieving, embedding
    its texts) takes the cores only when the running requests' steps leave them. Where priorities cannot be set,
    a helper thread as before."""
    helper_thread()
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + BACKGROUND_NICENESS))
    except (AttributeError, OSError) as err:  # not Linux, or not permitted
        logger.debug("a background thread keeps its priority: %s", err)


def computing_thread() -> None:
    """This thread is the one that computes: torch's threads (:func:`compute_threads`) are its."""
    _use_threads(compute_threads())
