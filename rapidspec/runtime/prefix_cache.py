"""A bounded store of target KV caches keyed by their token prefix.

After a generation the engine hands its target cache (prompt plus answer) to
the store; the next request whose prompt starts with the same tokens (the next
turn of a conversation, another question about the same document) starts from
a copy of it cropped to the shared prefix and prefills only the rest.

* ``lookup(token_ids)`` picks the entry sharing the longest prefix with
  ``token_ids`` (at least ``min_reused_tokens``) and returns an independent
  copy cropped to that prefix; the entry becomes the most recently used.
  Where ``take()`` says yes it hands over the entry itself instead (cropped, no
  longer the store's) when another entry shares as long a prefix, so one
  stays for a request that comes meanwhile: the questions that follow one
  another about a document then copy no keys and values (a copy of a 16K
  document's cache read and wrote 200 MB before the first token).
* ``store(cache)`` takes ownership of ``cache``. An entry whose tokens are a
  prefix of the new one is dropped (the new one serves every request the old
  one could); least recently used entries are evicted until the key/value
  bytes fit ``max_bytes``. A cache larger than ``max_bytes`` is not kept.

Example (``min_reused_tokens=2``)::

    store([1, 2, 3, 4])             entries: [1 2 3 4]
    lookup([1, 2, 3, 9, 9]) -> copy holding [1 2 3], reused 3
    store([1, 2, 3, 9, 9, 7])       entries: [1 2 3 4], [1 2 3 9 9 7]
    store([1, 2, 3, 4, 5])          entries: [1 2 3 9 9 7], [1 2 3 4 5]

Counters (``queries``, ``hits``, ``queried_tokens``, ``reused_tokens``,
``evictions``) feed the statistics and the server's metrics. Thread-safe: a
server's batched steps look up and store from several threads at once.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rapidspec.runtime.cache import KVCache, common_prefix_length

logger = logging.getLogger(__name__)

GIB = 1024**3


@dataclass
class PrefixCacheCounters:
    queries: int = 0
    hits: int = 0
    queried_tokens: int = 0
    reused_tokens: int = 0
    evictions: int = 0


class PrefixCache:
    """Least-recently-used target caches, at most ``max_bytes`` of keys and values in all."""

    def __init__(self, max_bytes: int, min_reused_tokens: int = 64) -> None:
        if max_bytes < 0:
            raise ValueError(f"the prefix cache size must be >= 0, got {max_bytes} bytes")
        self.max_bytes = int(max_bytes)
        self.min_reused_tokens = min_reused_tokens
        self.counters = PrefixCacheCounters()
        self._entries: OrderedDict[int, tuple[KVCache, int]] = OrderedDict()  # id -> (cache, bytes), oldest first
        self._next_id = 0
        self.bytes_used = 0  # kept up to date, so other threads may read it
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_token_ids(self) -> list[list[int]]:
        """The token sequences held, least recently used first."""
        with self._lock:
            return [entry.token_ids for entry, _ in self._entries.values()]

    def lookup(self, token_ids: Sequence[int], capacity: int | None = None,
               take: Callable[[], bool] | None = None) -> tuple[KVCache | None, int]:
        """A copy of the best entry cropped to the prefix it shares with ``token_ids``, and that length.

        The copy is allocated once, with room for ``capacity`` positions (None: what the entry holds).
        ``take``: asked under the store's lock, True gives the entry itself, cropped and no longer in the store,
        where another entry shares as many tokens with ``token_ids`` (the caller owns it; ``take`` says no while
        another thread may still read an entry).
        """
        with self._lock:
            return self._lookup(token_ids, capacity, take)

    def _lookup(self, token_ids: Sequence[int], capacity: int | None,
                take: Callable[[], bool] | None) -> tuple[KVCache | None, int]:
        self.counters.queries += 1
        self.counters.queried_tokens += len(token_ids)
        shared = {key: common_prefix_length(entry.token_ids, token_ids) for key, (entry, _) in self._entries.items()}
        best_key = max(shared, key=shared.get, default=None)  # the first of the longest: least recently used
        best_shared = shared.get(best_key, 0)
        if best_key is None or best_shared < self.min_reused_tokens:
            return None, 0
        self.counters.hits += 1
        self.counters.reused_tokens += best_shared
        if sum(n >= best_shared for n in shared.values()) > 1 and take is not None and take():
            cache, size = self._entries.pop(best_key)
            self.bytes_used -= size
            cache.crop(best_shared)
            return cache, best_shared
        self._entries.move_to_end(best_key)
        copy = self._entries[best_key][0].clone(capacity)
        copy.crop(best_shared)
        return copy, best_shared

    def longest_copy(self, tokens: int, capacity: int | None = None) -> tuple[KVCache, list[int]] | None:
        """A copy of the longest entry's first ``tokens - 1`` positions and that entry's first ``tokens`` token ids,
        or None when no entry holds ``tokens``; not a request's lookup (no counters, no recency)."""
        with self._lock:
            entry = max((entry for entry, _ in self._entries.values()), key=lambda e: e.length, default=None)
            if entry is None or entry.length < tokens:
                return None
            copy = entry.clone(capacity)
            copy.crop(tokens - 1)
            return copy, list(entry.token_ids[:tokens])

    def store(self, cache: KVCache) -> None:
        """Keep ``cache`` (owned by the store from now on); see the module docstring."""
        with self._lock:
            self._store(cache)

    def _store(self, cache: KVCache) -> None:
        held = cache.token_ids
        if len(held) < self.min_reused_tokens:
            return
        size = cache.memory_bytes()
        if size > self.max_bytes:
            logger.info("prefix cache: a %d-token cache (%.2f GiB) exceeds the %.2f GiB bound; not kept",
                        len(held), size / GIB, self.max_bytes / GIB)
            return
        for key in [k for k, (entry, _) in self._entries.items() if _is_prefix(entry.token_ids, held)]:
            self.bytes_used -= self._entries.pop(key)[1]
        self._entries[self._next_id] = (cache, size)
        self._next_id += 1
        self.bytes_used += size
        while self.bytes_used > self.max_bytes:
            self.bytes_used -= self._entries.popitem(last=False)[1][1]
            self.counters.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes_used = 0


def _is_prefix(short: Sequence[int], long: Sequence[int]) -> bool:
    return len(short) <= len(long) and common_prefix_length(short, long) == len(short)
