"""What every key/value cache offers: :class:`KVCacheProtocol`.

A cache holds one model's keys and values over one token sequence (batch size
1) and is its owner's only writer. The engine, the prefix cache and the
benchmarks use nothing else of a cache, so any class with these members can
stand in for :class:`~rapidspec.runtime.cache.KVCache` (transformers' forward)
or :class:`~rapidspec.runtime.lean_cache.LeanKVCache` (the lean forward).
The protocol is ``runtime_checkable``: ``isinstance(cache, KVCacheProtocol)``
checks that the members exist, not their signatures.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class KVCacheProtocol(Protocol):
    """The key/value cache of one model over one token sequence."""

    @property
    def length(self) -> int:
        """Number of tokens whose keys/values are held."""
        ...

    @property
    def token_ids(self) -> list[int]:
        """The tokens held, in order (a copy)."""
        ...

    @property
    def device(self) -> torch.device:
        """Where :meth:`forward` returns its logits (the device of the input embeddings)."""
        ...

    def forward(self, token_ids: Sequence[int], num_logits: int = 1) -> torch.Tensor:
        """Append ``token_ids`` (at least one) and return float32 logits [num_logits, V] on :attr:`device`.

        Row j predicts the token after ``token_ids[len - num_logits + j]``;
        ``1 <= num_logits <= len(token_ids)`` (else ``ValueError``).
        """
        ...

    def prefill(self, token_ids: Sequence[int], should_stop: Callable[[], bool] | None = None,
                progress: Callable[[int, int], None] | None = None) -> torch.Tensor | None:
        """Append a long sequence in chunks; the logits after its last token ([1, V]), or None for none.

        ``should_stop()``, asked between chunks, ends it early with :class:`~rapidspec.runtime.errors.PrefillStopped`;
        ``progress(done, total)`` hears of each chunk.
        """
        ...

    def prefill_chunks(self, token_ids: Sequence[int], should_stop: Callable[[], bool] | None = None,
                       progress: Callable[[int, int], None] | None = None,
                       chunk_limit: Callable[[], int | None] | None = None) -> Generator[int, None, torch.Tensor | None]:
        """:meth:`prefill` as a generator: yields the tokens done after each chunk and returns its logits;
        ``chunk_limit()``, asked before each chunk, may make it shorter (None: no limit)."""
        ...

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` tokens (``0 <= length <= self.length``, else ``ValueError``)."""
        ...

    def reserve(self, length: int) -> None:
        """Make room for ``length`` positions now, so no forward up to it grows (copies) the buffers."""
        ...

    def clone(self, capacity: int | None = None) -> KVCacheProtocol:
        """An independent copy holding the same tokens, with room for ``capacity`` positions (None: what it holds)."""
        ...

    def held_kv(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values of positions [start, end) ([layers, kv_heads, end - start, head_dim] each), or None
        where the cache's layers cannot be handed out so (what :mod:`~rapidspec.runtime.kv_store` writes)."""
        ...

    def append_kv(self, token_ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append the keys and values of ``token_ids`` computed elsewhere (what ``held_kv`` gave, read back)."""
        ...

    def memory_bytes(self) -> int:
        """Bytes allocated for the keys and values (reserved room included)."""
        ...
