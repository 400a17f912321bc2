"""Where a drafter's cache comes from: torch (any device) or llama.cpp (CPU, a GGUF file as it is).

A backend makes the :class:`~rapidspec.drafting.drafter.ModelDrafter` of each
generation and keeps the cache of the last one when it closes, so the next
prompt prefills only what differs from it: another question about the same
document, the next turn of a chat (llama-server's slots do the same). Two
generations running at once each get a cache of their own.

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


class DrafterPool:
    """Makes drafters over caches of one kind and keeps the last closed cache for reuse (when ``keep``)."""

    label = ""
    max_context = 0
    logit_width = 0

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self._idle = None
        self._idle_lock = threading.Lock()  # a drafter may start on the factory's prefill thread

    def _new_cache(self, tokens: int):
        raise NotImplementedError

    def _fits(self, cache, tokens: int) -> bool:
        return True

    def start(self, prompt_ids, room: int, vocab_size: int, target_device: torch.device) -> tuple[ModelDrafter, int]:
        """A drafter over ``prompt_ids`` whose cache holds ``prompt_ids[:-1]``, and how many of them were reused.

        ``room``: tokens the answer may add (max new tokens and drafts).
        """
        wanted = list(prompt_ids[:-1])
        with self._idle_lock:
            cache, self._idle = self._idle, None
        if cache is None or not self._fits(cache, len(prompt_ids) + room):
            cache = self._new_cache(len(prompt_ids) + room)
        cache.reserve(len(prompt_ids) + room)  # allocated once for the whole generation
        reused = common_prefix_length(cache.token_ids, wanted)
        cache.crop(reused)
        cache.prefill(wanted[reused:])
        return ModelDrafter(cache, list(prompt_ids), vocab_size, target_device, on_close=self._keep), reused

    def _keep(self, cache) -> None:
        with self._idle_lock:
            self._idle = cache if self.keep else None

    def clear(self) -> None:
        """Forget the kept cache."""
        self._idle = None


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
                 gguf: str = "auto") -> None:
        """``gguf``: ``auto`` reads a fast-prefill copy of a file whose weights have none
        (:mod:`rapidspec.runtime.gguf_copy`), ``as-is`` the file itself."""
        from rapidspec.runtime.gguf_copy import copy_type, fast_prefill_copy, weight_type
        from rapidspec.runtime.llama_cpp import LlamaCppModel

        super().__init__(keep)
        try:
            self.model = LlamaCppModel(gguf_path, threads=threads)
        except ValueError as exc:
            raise RapidspecError(f"cannot use {gguf_path} as a llama.cpp drafter: {exc}") from None
        description, kind = self.model.description, copy_type(self.model.description)
        if gguf == "auto" and kind is not None:
            try:
                self.model = LlamaCppModel(fast_prefill_copy(gguf_path, kind, threads), threads=threads)
                description = f"{self.model.description}, from {weight_type(description)}"
            except (ValueError, OSError) as exc:  # e.g. a cache directory that cannot be written
                logger.warning("reading %s as it is: no %s copy for fast prefill (%s)", gguf_path, kind, exc)
        check_llama_vocabulary(target_tokenizer, self.model)
        self.label = f"{name} (llama.cpp, {description})"
        self.max_context = self.model.max_context
        self.logit_width = self.model.vocab_size

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
