"""Give the C heap's free memory back to the system, for a process that serves for hours.

A server allocates and frees tensors of every size all day (caches sized to
each prompt, logits of each round, prefix-cache entries coming and going), from
several threads. glibc's malloc keeps what is freed in its arenas for reuse,
and after a large block is freed it raises its mmap threshold, so later
blocks of that size come from the arenas too: the resident set then creeps up
under a steady load although nothing leaks. :class:`HeapTrimmer` calls glibc's
``malloc_trim(0)`` (which returns the free pages of every arena to the
system) at most once per ``every_s`` seconds, from the thread that asks
(the server's engine thread, after a request ends). Where the C library is not
glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time

logger = logging.getLogger(__name__)

#: Seconds between two trims at most once per this (a trim of a few GiB heap takes milliseconds).
DEFAULT_EVERY_S = 10.0


def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrimmer:
    """``maybe_trim()`` returns the heap's free pages to the system, at most once per ``every_s`` seconds."""

    def __init__(self, every_s: float = DEFAULT_EVERY_S) -> None:
        self.every_s = every_s
        self._trim = _malloc_trim()
        self._last = time.monotonic()
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def maybe_trim(self) -> bool:
        """Trim if ``every_s`` has passed since the last trim; whether it trimmed."""
        now = time.monotonic()
        if self._trim is None or now - self._last < self.every_s:
            return False
        self._trim(0)
        self._last = time.monotonic()
        self.trims += 1
        logger.debug("heap trimmed in %.1f ms", 1000 * (self._last - now))
        return True
