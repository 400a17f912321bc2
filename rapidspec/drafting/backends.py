"""Where a drafter's cache comes from: torch (any device) or llama.cpp (CPU, a GGUF file as it is).

A backend makes the :class:`~rapidspec.drafting.drafter.ModelDrafter` of each
generation and keeps the caches of the last ones when they close (up to
:data:`KEPT_CACHES`, :data:`KEPT_BYTES` in all), so a new prompt starts from
the kept cache sharing its longest prefix and prefills only what differs:
another question about the same document whose retrieved text starts the
same, the next turn of a chat (llama-server's slots and prompt cache do the
same). Generations running at once each get a cache of their own. A llama.cpp
pool also keeps closed caches on disk for later processes, and starts a new
prompt from the one there that shares more with it
(:mod:`rapidspec.runtime.llama_state_store`).

Which backend drafts is decided once, with the models
(:func:`rapidspec.models.backend.choose_backend`). llama.cpp's vocabulary is
checked against the target's token for token.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from rapidspec.drafting.drafter import ModelDrafter
from rapidspec.errors import RapidspecError
from rapidspec.runtime.cache import common_prefix_length

logger = logging.getLogger(__name__)


#: Closed drafter caches a pool keeps for later generations (the server's running requests each hold one more).
KEPT_CACHES = 8
#: The most bytes of key/value memory the kept caches may hold together: the oldest go first beyond it (the
#: newest is kept whatever its size, so a long document's drafter cache serves its next question).
KEPT_BYTES = 512 * 2**20
#: A kept cache is reused when it shares this many tokens with the new prompt, or half of a shorter prompt
#: (or the pool is full).
REUSE_MIN_TOKENS = 128


class DrafterPool:
    """Makes drafters over caches of one kind and keeps closed caches for reuse (when ``keep``): a new drafter
    starts from the kept cache sharing the longest prefix with its prompt (:meth:`_take`)."""

    label = ""
    max_context = 0
    logit_width = 0
    store = None  # closed caches on disk for later processes (LlamaCppDrafters: rapidspec.runtime.llama_state_store)

    def __init__(self, keep: bool = True, kept_caches: int = KEPT_CACHES, kept_bytes: int = KEPT_BYTES,
                 reuse_min_tokens: int = REUSE_MIN_TOKENS) -> None:
        self.keep = keep
        self.kept_caches, self.kept_bytes, self.reuse_min_tokens = kept_caches, kept_bytes, reuse_min_tokens
        self._idle: list[tuple[object, int]] = []  # (cache, bytes), oldest first
        self._idle_lock = threading.Lock()  # drafters start and close on several threads (server steps, prefills)

    def _new_cache(self, tokens: int):
        raise NotImplementedError

    def _fits(self, cache, tokens: int) -> bool:
        return True

    def begin(self, prompt_ids, room: int, vocab_size: int, target_device: torch.device) -> PendingDrafter:
        """A drafter over ``prompt_ids`` whose prefill runs in pieces (:class:`PendingDrafter`), from the kept
        cache sharing the longest prefix with ``prompt_ids[:-1]``. ``room``: tokens the answer may add."""
        wanted = list(prompt_ids[:-1])
        cache = self._take(wanted, len(prompt_ids) + room)
        if cache is None:
            cache = self._new_cache(len(prompt_ids) + room)
        cache.reserve(len(prompt_ids) + room)  # allocated once for the whole generation
        cache.crop(common_prefix_length(cache.token_ids, wanted))
        from_disk = self.store.extend(cache, wanted) if self.store is not None else 0
        return PendingDrafter(self, cache, list(prompt_ids), vocab_size, target_device, from_disk)

    def start(self, prompt_ids, room: int, vocab_size: int, target_device: torch.device) -> tuple[ModelDrafter, int]:
        """A drafter over ``prompt_ids`` whose cache holds ``prompt_ids[:-1]``, and how many of them were reused."""
        pending = self.begin(prompt_ids, room, vocab_size, target_device)
        reused = pending.reused
        pending.advance(None)
        return pending.drafter(), reused

    def kept_prefix(self, prompt_ids, kept: list[tuple[int, ...]]) -> int:
        """Tokens of ``prompt_ids[:-1]`` that :meth:`begin` would reuse from caches holding ``kept`` (tokens each)."""
        wanted = list(prompt_ids[:-1])
        best = max((common_prefix_length(tokens, wanted) for tokens in kept), default=0)
        return best if self._worth_reusing(best, wanted) else 0

    def _worth_reusing(self, shared: int, wanted: list[int]) -> bool:
        """Whether a kept cache sharing ``shared`` tokens is taken for ``wanted``: :attr:`reuse_min_tokens` of
        them, or half of a shorter prompt."""
        return shared >= min(self.reuse_min_tokens, len(wanted) / 2)

    def new_cache(self, tokens: int):
        """A fresh cache with room for ``tokens`` (never kept: measuring costs)."""
        return self._new_cache(tokens)

    def _take(self, wanted: list[int], tokens: int):
        """A kept cache of at least ``tokens`` positions for ``wanted``, or None (make a new one).

        The one sharing the longest prefix when it shares :attr:`reuse_min_tokens` or half of ``wanted``; else,
        when the pool is full, the oldest (it would be the next to go); else None, so that a prompt sharing
        little (the template's header) does not spend a cache another prompt would reuse (a new llama.cpp
        context costs about as much as prefilling 30 tokens).
        """
        with self._idle_lock:
            fitting = [i for i, (cache, _) in enumerate(self._idle) if self._fits(cache, tokens)]
            if not fitting:
                return None
            shared = [common_prefix_length(self._idle[i][0].token_ids, wanted) for i in fitting]
            best = fitting[shared.index(max(shared))]  # ties: the oldest
            if self._worth_reusing(max(shared), wanted):
                return self._idle.pop(best)[0]
            return self._idle.pop(fitting[0])[0] if len(self._idle) >= self.kept_caches else None

    def _keep(self, cache) -> None:
        if not self.keep:
            return
        if self.store is not None:
            self.store.write(cache)  # its state is copied now: the cache may be taken again once it is kept
        size = cache.memory_bytes()
        with self._idle_lock:
            self._idle.append((cache, size))
            while len(self._idle) > 1 and (len(self._idle) > self.kept_caches
                                           or sum(b for _, b in self._idle) > self.kept_bytes):
                self._idle.pop(0)  # the newest stays, whatever its size

    @property
    def kept(self) -> int:
        """How many closed caches the pool holds."""
        return len(self._idle)

    def clear(self) -> None:
        """Forget the kept caches."""
        with self._idle_lock:
            self._idle = []


class PendingDrafter:
    """A drafter whose prefill runs in pieces between rounds: its cache holds a prefix of ``prompt_ids[:-1]``.

    :meth:`advance` prefills up to n more tokens (None: all); once :attr:`ready`, :meth:`drafter` gives the
    :class:`~rapidspec.drafting.drafter.ModelDrafter`; :meth:`close` hands an unfinished cache back to its pool
    (what it holds is a consistent prefix, which the next prompt may reuse).
    """

    def __init__(self, pool: DrafterPool, cache, prompt_ids: list[int], vocab_size: int,
                 target_device: torch.device, from_disk: int = 0) -> None:
        self.pool, self.cache, self.prompt_ids = pool, cache, prompt_ids
        self.vocab_size, self.target_device = vocab_size, target_device
        self.reused, self.from_disk = cache.length, from_disk  # tokens not prefilled; of those, read from disk

    @property
    def left(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.prompt_ids) - 1 - self.cache.length

    @property
    def ready(self) -> bool:
        return self.left <= 0

    def advance(self, tokens: int | None) -> None:
        start = self.cache.length
        end = len(self.prompt_ids) - 1 if tokens is None else min(len(self.prompt_ids) - 1, start + tokens)
        if end > start:
            self.cache.prefill(self.prompt_ids[start:end])

    def drafter(self) -> ModelDrafter:
        return ModelDrafter(self.cache, self.prompt_ids, self.vocab_size, self.target_device, on_close=self.pool._keep)

    def close(self) -> None:
        self.pool._keep(self.cache)


class TorchDrafters(DrafterPool):
    """Drafters over the runtime's torch caches of a loaded model (the target itself for self-speculation)."""

    def __init__(self, loaded, prefill_chunk_tokens: int, label: str, keep: bool = True) -> None:
        from rapidspec.models.vocabulary import logit_width

        super().__init__(keep)
        self.loaded = loaded
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.label = label
        self.max_context = loaded.max_context
        self.logit_width = logit_width(loaded.model)

    def _new_cache(self, tokens: int):
        from rapidspec.runtime import new_kv_cache

        return new_kv_cache(self.loaded, self.prefill_chunk_tokens)


class LlamaCppDrafters(DrafterPool):
    """Drafters over llama.cpp contexts of one GGUF file."""

    def __init__(self, gguf_path: Path, threads: int, target_tokenizer, name: str, keep: bool = True,
                 gguf: str = "auto", kv_cache: tuple[int, str | None] = (0, None)) -> None:
        """``gguf``: ``auto`` reads a fast-prefill copy of a file whose weights have none
        (:mod:`rapidspec.runtime.gguf_copy`), ``as-is`` the file itself. ``kv_cache``: (bytes, folder) of the
        key/value folder the closed contexts' states are kept in (:mod:`rapidspec.runtime.llama_state_store`),
        with ``keep``; 0 bytes: none."""
        from rapidspec.runtime.gguf_copy import copy_type, fast_prefill_copy, model_name, weights_label
        from rapidspec.runtime.llama_cpp import LlamaCppModel

        super().__init__(keep)
        try:
            self.model = LlamaCppModel(gguf_path, threads=threads)
        except ValueError as exc:
            raise RapidspecError(f"cannot use {gguf_path} as a llama.cpp drafter: {exc}") from None
        weights, kind = weights_label(self.model.description), copy_type(self.model.description)
        if gguf == "auto" and kind is not None:
            try:
                copy = fast_prefill_copy(gguf_path, kind, threads)  # None: the cache cannot take it (logged once)
                if copy is not None:
                    source = self.model.description
                    self.model = LlamaCppModel(copy, threads=threads)
                    weights = weights_label(self.model.description, source)
            except (ValueError, OSError) as exc:
                logger.warning("reading %s as it is: no %s copy for fast prefill (%s)", gguf_path, kind, exc)
        check_llama_vocabulary(target_tokenizer, self.model)
        # e.g. "self (llama.cpp, SmolLM2-135M-Instruct, Q8_0 copy of Q4_1)"
        self.label = f"{name} (llama.cpp, {model_name(gguf_path)}, {weights})"
        self.max_context = self.model.max_context
        self.logit_width = self.model.vocab_size
        if keep and kv_cache[0]:
            from rapidspec.runtime.llama_state_store import for_llama_model

            self.store = for_llama_model(self.model, self.label, *kv_cache)

    def _new_cache(self, tokens: int):
        return self.model.new_context(tokens)

    def _fits(self, cache, tokens: int) -> bool:
        return cache.capacity >= tokens


def check_llama_vocabulary(target_tokenizer, model) -> None:
    """Raise :class:`RapidspecError` unless the GGUF's tokens equal the target tokenizer's, id for id."""
    count = len(target_tokenizer)
    if model.vocab_size < count:
        raise RapidspecError(
            f"the llama.cpp drafter {model.path.name} has {model.vocab_size} tokens, the target's tokenizer "
            f"{count}: use a drafter with the target's vocabulary"
        )
    target_tokens = target_tokenizer.convert_ids_to_tokens(list(range(count)))
    for index, (ours, theirs) in enumerate(zip(target_tokens, model.token_texts(count))):
        if ours != theirs:
            raise RapidspecError(
                f"the llama.cpp drafter {model.path.name}'s vocabulary differs from the target's at token {index} "
                f"({theirs!r} against {ours!r}): use a drafter with the target's vocabulary"
            )
