"""How many tokens a served prefill feeds in one step of the worker.

A request that arrives while another prefills waits for that prefill's
current piece before its own first step (:mod:`rapidspec.server.worker`); on
the lean runtime a piece yields between its layers
(:meth:`~rapidspec.runtime.lean_cache.LeanKVCache.forward_by_layer`), so it
waits for one layer of it. A piece is kept short: about :data:`PIECE_S` seconds at the rate the last
piece ran (whole chunks where the device is fast), but never under
:data:`ALONE_MIN_TOKENS` once grown there, growing at most twofold from one
piece to the next, from ``shared`` tokens. While other requests run
or wait a piece is ``shared`` tokens (``ServerConfig.shared_prefill_tokens``),
so their steps come between the pieces; 0 turns pieces off (whole chunks).
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Seconds a served prefill's piece lasts, about, while no other request runs or waits.
PIECE_S = 1.0
#: Fewest tokens of a piece while no other request runs or waits, where a second holds fewer: after 30K cached
#: tokens the default model prefilled 35.9 tokens/s in 64-token pieces, 37.4 in 128, 45.0 in 256 and 48.7 in whole
#: 2,048-token chunks (its CPU flash attention runs short queries slowly), so a 32K-token document served alone in
#: pieces of a second took 550 s to its first token against 393 s in whole chunks (docs/serving.md).
ALONE_MIN_TOKENS = 256


class PrefillPieces:
    """``chunk_limit`` for one served prefill (asked before each chunk; None: no limit)."""

    def __init__(self, shared: int, crowded: Callable[[], bool], piece_s: float = PIECE_S,
                 clock: Callable[[], float] = time.perf_counter, alone_min: int = ALONE_MIN_TOKENS) -> None:
        self.shared = shared
        self.crowded = crowded
        self.piece_s = piece_s
        self.alone_min = alone_min
        self.clock = clock
        self._last: tuple[float, int] | None = None  # when the last piece was asked for, and its limit

    def __call__(self) -> int | None:
        if not self.shared:
            return None
        now = self.clock()
        last, limit = self._last, self.shared
        if last is not None and not self.crowded():
            asked, tokens = last
            rate = tokens / max(now - asked, 1e-6)  # tokens/s of the last piece (and of the steps between)
            limit = max(self.shared, min(2 * tokens, max(self.alone_min, int(rate * self.piece_s))))
        self._last = (now, limit)
        return limit
