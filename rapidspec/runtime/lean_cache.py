"""The key/value cache of the lean forward: preallocated buffers with room ahead.

:class:`LeanKVCache` satisfies :class:`~rapidspec.runtime.protocol.KVCacheProtocol`
like :class:`~rapidspec.runtime.cache.KVCache` (``forward``, ``prefill``,
``crop``, ``clone``, ``length``, ``token_ids``, ``device``, ``memory_bytes``)
and is its owner's only writer. Keys and values of all layers live in two
buffers [layers, kv_heads, capacity, head_dim]; a forward writes the new
positions in place and attends over the first ``length`` positions of each
head, whose [length, head_dim] blocks are contiguous. Inside a server step
batched with others (:mod:`rapidspec.runtime.batching`) the forward is one
row of a batched one. Rollback only shortens
``length``: the next forward overwrites what was cropped. The engine reserves
a generation's whole length (prompt, answer, one round of drafts) before its
prefill, so the buffers are allocated once; a forward past the capacity
grows them like the transformers path's
:class:`~rapidspec.runtime.cache.GrowableLayer` (by
:data:`~rapidspec.runtime.cache.ROOM_GROWTH`, in multiples of
:data:`~rapidspec.runtime.cache.ROOM_QUANTUM` tokens). A clone allocates only
what it holds, or the room it is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch

from rapidspec.runtime.cache import PREFILL_CHUNK_TOKENS, ROOM_GROWTH, ROOM_QUANTUM, HeldTokens
from rapidspec.runtime.batching import current_batcher
from rapidspec.runtime.lean import LeanModel, Row


class LeanKVCache(HeldTokens):
    """The key/value cache of one :class:`LeanModel` over one token sequence."""

    def __init__(self, lean: LeanModel, prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> None:
        super().__init__(prefill_chunk_tokens)
        self.lean = lean
        self.model = lean.model
        self._keys = self._values = self._empty(0)  # [layers, kv_heads, capacity, d]

    def _empty(self, capacity: int) -> torch.Tensor:
        lean = self.lean
        return torch.empty(
            lean.num_layers, lean.kv_heads, capacity, lean.head_dim, dtype=lean.dtype, device=lean.device
        )

    @property
    def device(self) -> torch.device:
        return self.lean.device

    @property
    def capacity(self) -> int:
        """Positions the buffers can hold before they grow."""
        return self._keys.shape[2]

    def reserve(self, length: int) -> None:
        """Make room for ``length`` positions: exactly that on an empty cache, else by ROOM_GROWTH (rounded up
        to ROOM_QUANTUM); a generation reserves its whole length first, so it never grows."""
        if length <= self.capacity:
            return
        grown = int(ROOM_GROWTH * self.capacity) if self.length else 0
        capacity = -(-max(length, grown) // ROOM_QUANTUM) * ROOM_QUANTUM
        keys, values = self._empty(capacity), self._empty(capacity)
        held = self.length
        keys[:, :, :held].copy_(self._keys[:, :, :held])
        values[:, :, :held].copy_(self._values[:, :, :held])
        self._keys, self._values = keys, values

    def forward(self, token_ids: Sequence[int], num_logits: int = 1) -> torch.Tensor:
        """Append ``token_ids`` and return float32 logits [num_logits, V] of the last ``num_logits`` of them."""
        row = self._row(token_ids, num_logits)
        batcher = current_batcher()  # a server step batched with others (rapidspec.runtime.batching)
        logits = self.lean.forward_rows([row])[0] if batcher is None else batcher.forward(self.lean, row)
        self._token_ids.extend(int(t) for t in token_ids)
        return logits.float()  # [num_logits, V]

    def forward_by_layer(self, token_ids: Sequence[int], num_logits: int = 1) -> Generator[None, None, torch.Tensor]:
        """:meth:`forward`, yielding after each layer, unless it runs in a batched server step (then it is one
        row of the batch, whole). Closed early, the cache holds what it held before."""
        if current_batcher() is not None:
            return self.forward(token_ids, num_logits)
        row = self._row(token_ids, num_logits)
        logits = (yield from self.lean.forward_rows_by_layer([row]))[0]
        self._token_ids.extend(int(t) for t in token_ids)
        return logits.float()  # [num_logits, V]

    def _row(self, token_ids: Sequence[int], num_logits: int) -> Row:
        """The forward's row: ``token_ids`` after the held tokens, room reserved for them."""
        self._check_forward(token_ids, num_logits)
        start = self.length
        self.reserve(start + len(token_ids))
        input_ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)  # [T]
        return Row(input_ids, self._keys, self._values, start, num_logits)

    def prefill_chunks(self, token_ids: Sequence[int], should_stop: Callable[[], bool] | None = None,
                       progress: Callable[[int, int], None] | None = None,
                       chunk_limit: Callable[[], int | None] | None = None) -> Generator[int, None, torch.Tensor | None]:
        """The chunked prefill of the base class, with room for all of ``token_ids`` reserved once."""
        self.reserve(self.length + len(token_ids))
        return (yield from super().prefill_chunks(token_ids, should_stop, progress, chunk_limit))

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` tokens (rollback of rejected tokens)."""
        self._check_crop(length)
        del self._token_ids[length:]

    def clone(self, capacity: int | None = None) -> "LeanKVCache":
        """An independent copy with room for ``capacity`` positions (None: exactly what it holds)."""
        twin = LeanKVCache(self.lean, self.prefill_chunk_tokens)
        size = max(self.length, capacity or 0)
        twin._keys, twin._values = self._empty(size), self._empty(size)
        twin._keys[:, :, : self.length].copy_(self._keys[:, :, : self.length])
        twin._values[:, :, : self.length].copy_(self._values[:, :, : self.length])
        twin._token_ids = list(self._token_ids)
        return twin

    def held_kv(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [start, end) ([layers, kv_heads, end - start, head_dim] each)."""
        return self._keys[:, :, start:end], self._values[:, :, start:end]

    def append_kv(self, token_ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append the keys and values of ``token_ids`` computed elsewhere ([layers, kv_heads, n, head_dim])."""
        start, count = self.length, len(token_ids)
        self.reserve(start + count)
        self._keys[:, :, start : start + count].copy_(keys)
        self._values[:, :, start : start + count].copy_(values)
        self._token_ids.extend(int(t) for t in token_ids)

    def memory_bytes(self) -> int:
        """Bytes allocated for the key/value buffers (reserved room included)."""
        return self._keys.nbytes + self._values.nbytes
