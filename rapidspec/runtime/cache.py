"""One owner per KV cache: append through the model, roll back, know what is held.

:class:`KVCache` wraps a transformers ``DynamicCache`` together with the token
ids it holds, so that "what the cache contains" is never a counter kept by
someone else. Rollback uses only the public ``Cache.crop``. It satisfies
:class:`~rapidspec.runtime.protocol.KVCacheProtocol`, as the lean runtime's
cache does; :class:`HeldTokens` is what the two share.

The cache's full-attention layers are :class:`GrowableLayer` (a subclass of
transformers' public ``DynamicLayer``): new keys and values are written into
room reserved ahead instead of concatenated, so a decode step no longer copies
the whole cache (at 16K tokens of Qwen2.5-1.5B that copy moved about 0.5 GB per
step; ``torch.cat`` was 20% of a draft step even at 1K tokens).

Convention used by the engine: after every round a cache holds a prefix of
the committed tokens; the rest (usually the last one or two, more for a drafter
after plain rounds of the ``cost`` gamma schedule) are fed at the start of its
next forward pass (``pending`` tokens).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Generator, Sequence

import torch
from transformers import DynamicCache, DynamicLayer

from rapidspec.runtime.errors import PrefillStopped

# Reserved room grows by this factor (and in multiples of ROOM_QUANTUM tokens).
ROOM_GROWTH = 1.5
#: Prompt tokens per prefill forward of a cache made without an engine (the engine passes its own,
#: :data:`rapidspec.config.DEFAULT_PREFILL_CHUNK_TOKENS`, the same number: tests/test_layout.py).
PREFILL_CHUNK_TOKENS = 2048
ROOM_QUANTUM = 256


class GrowableLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of buffers with room to spare.

    ``keys`` and ``values`` are always the first ``length`` positions of the
    buffers ([batch, kv_heads, length, head_dim]); ``update`` copies the new
    states into the room after them, growing the buffers by
    :data:`ROOM_GROWTH` when full. ``crop`` (inherited) shortens the views, and
    the next update overwrites what was cropped. Anything that replaces
    ``keys`` by a tensor that is not such a view (batch reordering, reset) is
    detected and the buffers are rebuilt from it. ``min_capacity`` (set by
    :meth:`KVCache.reserve`) makes the first allocation big enough for a
    whole generation.
    """

    min_capacity = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_room: torch.Tensor | None = None
        self._value_room: torch.Tensor | None = None

    def _views_of_room(self) -> bool:
        room = self._key_room
        return (
            room is not None
            and self.keys.dim() == 4
            and self.keys.data_ptr() == room.data_ptr()
            and self.keys.shape[:2] == room.shape[:2]
            and self.values.data_ptr() == self._value_room.data_ptr()
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self.get_seq_length()
        new = old + key_states.shape[-2]
        if old == 0 or not self._views_of_room() or new > self._key_room.shape[-2]:
            grown = int(ROOM_GROWTH * self._key_room.shape[-2]) if old and self._key_room is not None else 0
            capacity = -(-max(new, grown, self.min_capacity) // ROOM_QUANTUM) * ROOM_QUANTUM  # rounded up
            self._key_room = self._reserve(self.keys if old else None, key_states, capacity)
            self._value_room = self._reserve(self.values if old else None, value_states, capacity)
        self._key_room[:, :, old:new].copy_(key_states)
        self._value_room[:, :, old:new].copy_(value_states)
        self.keys = self._key_room[:, :, :new]
        self.values = self._value_room[:, :, :new]
        return self.keys, self.values

    @staticmethod
    def _reserve(held: torch.Tensor | None, like: torch.Tensor, capacity: int) -> torch.Tensor:
        """An empty [batch, heads, capacity, dim] buffer starting with ``held``."""
        batch, heads, _, dim = like.shape
        room = like.new_empty((batch, heads, capacity, dim))
        if held is not None:
            room[:, :, : held.shape[-2]].copy_(held)
        return room

    def reset(self) -> None:
        super().reset()
        self._key_room = self._value_room = None


def new_cache(config) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are :class:`GrowableLayer`.

    Other layer types (sliding windows, ...) are kept as transformers builds them.
    """
    cache = DynamicCache(config=config)
    cache.layers = [GrowableLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if not cache.layers:
        cache.layer_class_to_replicate = GrowableLayer
    return cache


class HeldTokens:
    """What every key/value cache shares: the token ids it holds, argument checks, chunked prefill.

    Subclasses call ``__init__`` and implement ``forward(token_ids, num_logits)``.
    """

    def __init__(self, prefill_chunk_tokens: int) -> None:
        if prefill_chunk_tokens < 1:
            raise ValueError("prefill_chunk_tokens must be >= 1")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._token_ids: list[int] = []

    @property
    def length(self) -> int:
        """Number of tokens whose keys/values are held."""
        return len(self._token_ids)

    @property
    def token_ids(self) -> list[int]:
        """The tokens held, in order (a copy)."""
        return list(self._token_ids)

    @staticmethod
    def _check_forward(token_ids: Sequence[int], num_logits: int) -> None:
        if not token_ids:
            raise ValueError("forward needs at least one token")
        if not 1 <= num_logits <= len(token_ids):
            raise ValueError(f"num_logits must be in [1, {len(token_ids)}], got {num_logits}")

    def reserve(self, length: int) -> None:
        """Make room for ``length`` positions now (nothing to do where memory is fixed at creation)."""

    def _check_crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {length}")

    def prefill_chunks(
        self,
        token_ids: Sequence[int],
        should_stop: Callable[[], bool] | None = None,
        progress: Callable[[int, int], None] | None = None,
        chunk_limit: Callable[[], int | None] | None = None,
    ) -> Generator[int, None, torch.Tensor | None]:
        """A generator over a chunked prefill: yields the tokens done after each chunk, returns what :meth:`prefill` does.

        The caller can do other work between chunks (the server interleaves requests this way); ``chunk_limit()``,
        asked before each chunk, may make it shorter than :attr:`prefill_chunk_tokens` (None: no limit). A chunk
        so limited runs through :meth:`forward_by_layer`: where that yields between layers, so does this, None.
        """
        logits = None
        total, start = len(token_ids), 0
        while start < total:
            if start and should_stop is not None and should_stop():
                raise PrefillStopped(f"prefill stopped after {start} of {total} tokens")
            if progress is not None and not start:
                progress(0, total)
            limit = None if chunk_limit is None else chunk_limit()
            size = self.prefill_chunk_tokens if not limit else max(1, min(limit, self.prefill_chunk_tokens))
            chunk = token_ids[start : start + size]
            logits = self.forward(chunk, num_logits=1) if not limit else (yield from self.forward_by_layer(chunk))
            start = min(start + size, total)
            if progress is not None:
                progress(start, total)
            yield start
        return logits

    def forward_by_layer(self, token_ids: Sequence[int], num_logits: int = 1) -> Generator[None, None, torch.Tensor]:
        """:meth:`forward` as a generator that a cache may pause between layers (this one runs it whole)."""
        return self.forward(token_ids, num_logits)
        yield  # unreachable: makes this a generator

    def prefill(
        self,
        token_ids: Sequence[int],
        should_stop: Callable[[], bool] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor | None:
        """Append a long sequence in chunks (bounded activation memory).

        Returns the logits after the last token ([1, V]), or None for no tokens.
        ``should_stop()`` is asked before every chunk after the first; when it
        says yes, :class:`PrefillStopped` is raised (the cache then holds the
        chunks done so far). ``progress(done, total)`` is called before the
        first chunk and after each one.
        """
        chunks = self.prefill_chunks(token_ids, should_stop, progress)
        while True:
            try:
                next(chunks)
            except StopIteration as finished:
                return finished.value


class KVCache(HeldTokens):
    """The key/value cache of one model over one token sequence (batch size 1)."""

    def __init__(self, model: torch.nn.Module, prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> None:
        super().__init__(prefill_chunk_tokens)
        self.model = model
        self._cache = new_cache(model.config)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def forward(self, token_ids: Sequence[int], num_logits: int = 1) -> torch.Tensor:
        """Append ``token_ids`` and return the logits of the last ``num_logits`` of them.

        Returns float32 logits of shape [num_logits, V] on :attr:`device` (the
        device of the input embeddings, also for models split over several
        GPUs); row j predicts the token after ``token_ids[len - num_logits + j]``.
        """
        self._check_forward(token_ids, num_logits)
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(
            input_ids=input_ids,
            past_key_values=self._cache,
            use_cache=True,
            logits_to_keep=num_logits,
        )
        self._token_ids.extend(map(int, token_ids))
        return out.logits[0, -num_logits:].to(self.device).float()  # [num_logits, V]

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` tokens (rollback of rejected tokens)."""
        self._check_crop(length)
        remove = self.length - length
        if remove:
            # transformers 5 crops by a negative count of tokens to remove.
            self._cache.crop(-remove)
            del self._token_ids[length:]

    def reserve(self, length: int) -> None:
        """Buffers allocated from now on hold at least ``length`` positions (one allocation per generation)."""
        for layer in getattr(self._cache, "layers", []):
            if isinstance(layer, GrowableLayer):
                layer.min_capacity = length

    def clone(self, capacity: int | None = None) -> "KVCache":
        """An independent copy (used to reuse a document prefix across questions).

        transformers' layers are copied whole (their reserved room too); ``capacity`` is the room
        they grow to when they next grow.
        """
        twin = KVCache.__new__(KVCache)
        twin.model = self.model
        twin.prefill_chunk_tokens = self.prefill_chunk_tokens
        twin._cache = copy.deepcopy(self._cache)
        twin._token_ids = list(self._token_ids)
        if capacity is not None:
            twin.reserve(capacity)
        return twin

    def held_kv(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values of positions [start, end) of every layer ([layers, kv_heads, end - start, head_dim]
        each); None where a layer is not a full-attention one (sliding windows, ...)."""
        layers = getattr(self._cache, "layers", [])
        if not layers or any(type(layer) is not GrowableLayer or not layer.is_initialized for layer in layers):
            return None
        keys = torch.stack([layer.keys[0, :, start:end] for layer in layers])
        return keys, torch.stack([layer.values[0, :, start:end] for layer in layers])

    def append_kv(self, token_ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append the keys and values of ``token_ids`` computed elsewhere ([layers, kv_heads, n, head_dim])."""
        for index in range(keys.shape[0]):
            self._cache.update(keys[index][None], values[index][None], index)
        self._token_ids.extend(map(int, token_ids))

    def memory_bytes(self) -> int:
        """Bytes allocated for the key/value tensors (reserved room included)."""
        storages = {}
        for layer in getattr(self._cache, "layers", []):
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    Example: ``[1, 2, 3, 4]`` and ``[1, 2, 5]`` -> 2.
    """
    n = min(len(a), len(b))
    if n == 0:
        return 0
    ta = torch.as_tensor(list(a[:n]))
    tb = torch.as_tensor(list(b[:n]))
    mismatch = (ta != tb).nonzero()
    return int(mismatch[0, 0]) if mismatch.numel() else n
