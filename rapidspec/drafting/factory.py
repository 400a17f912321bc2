"""Which drafter a generation gets: the engine asks :class:`DrafterFactory`, it never builds one.

The factory owns what drafts for an engine: the drafter source (None for
self-speculation, a loaded model, or a name loaded by torch on first use),
the backend chosen once from ``auto`` (:func:`~rapidspec.drafting.backends.choose_backend`),
a pool per backend (made on first use, keeping the last cache for the next
prompt) and the drafter's relation to the target, which decides the default
eta (:mod:`.eta_default`). :meth:`DrafterFactory.start` returns the drafter of
one generation for the mode's drafter kind (:mod:`.modes`): a model drafter
(:class:`~rapidspec.drafting.drafter.ModelDrafter`), a lookup drafter, or None.
A llama.cpp drafter (its own threads, outside torch's) may prefill while the
target prefills (:meth:`DrafterFactory.start_beside`): ``prefill="auto"`` does
so where the CPU has a core to spare for each drafter thread beyond torch's
threads, since on a CPU without them the two prefills only contend.
A new drafter kind is a class following :class:`~rapidspec.drafting.drafter.Drafter`
and a branch here, not in the engine.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from rapidspec.drafting.backends import LlamaCppDrafters, TorchDrafters
from rapidspec.models.backend import choose_backend, gguf_file
from rapidspec.drafting.eta_default import drafter_relation
from rapidspec.drafting.lookup import LookupDrafter
from rapidspec.config import DEFAULT_PREFILL_CHUNK_TOKENS, MODE_TABLE
from rapidspec.models.spec import ModelSpec
from rapidspec.models.vocabulary import check_same_vocabulary, logit_width
from rapidspec.runtime.threads import compute_threads, helper_thread

logger = logging.getLogger(__name__)


def spare_cores() -> int:
    """CPU cores this process may use beyond torch's threads (those the target's prefill keeps busy)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return usable - compute_threads()


def new_pool(backend: str, target, source, tokenizer, options: ModelSpec, torch_model: Callable[[], object],
             prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS, keep: bool = True,
             kv_cache: tuple[int, str | None] = (0, None), name: str | None = None):
    """The drafter pool of ``backend`` (``auto`` decided by :func:`~rapidspec.models.backend.choose_backend`) for
    ``source`` (None: the target's weights, a loaded model or a name) drafting for ``target`` (anything with a
    ``device``; its GGUF file when ``source`` is None): llama.cpp contexts of its GGUF file with the drafter options
    of ``options``, or torch caches of ``torch_model()``. The one place pools are made: an engine's factory and
    RAPID's proposer inside vLLM (:mod:`rapidspec.vllm.drafter_source`)."""
    backend = choose_backend(backend, target, source)
    name = name or ("self" if source is None else getattr(source, "label", str(source)))
    if backend == "llama.cpp":
        threads = compute_threads() if options.drafter_threads is None else options.drafter_threads
        return LlamaCppDrafters(gguf_file(target if source is None else source), threads, tokenizer, name, keep=keep,
                                gguf=options.drafter_gguf, kv_cache=kv_cache)
    return TorchDrafters(torch_model(), prefill_chunk_tokens, name, keep=keep)


class DrafterFactory:
    """The drafters of one engine over ``target``: see the module docstring."""

    def __init__(self, target, drafter=None, options: ModelSpec = ModelSpec(),
                 prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS, keep: bool = True,
                 kv_cache: tuple[int, str | None] = (0, None)) -> None:
        """``drafter``: None (self), a loaded model or a name; ``options``: the spec's models section, whose drafter
        options (backend, threads, prefill, GGUF choice) it reads, validated there; ``keep``: keep each
        backend's last cache for a later prompt; ``kv_cache``: (bytes, folder) where a llama.cpp pool keeps its
        contexts' states."""
        if drafter is not None and not isinstance(drafter, str) and drafter is not target:
            check_same_vocabulary(target.tokenizer, drafter.tokenizer)
        self.target = target
        self._source = drafter  # None, a loaded model, or a name (loaded on first torch use)
        self.options = options
        self.threads = compute_threads() if options.drafter_threads is None else options.drafter_threads
        self.prefill_chunk_tokens, self.keep, self.kv_cache = prefill_chunk_tokens, keep, kv_cache
        self._beside: ThreadPoolExecutor | None = None
        self.backend = choose_backend(options.drafter_backend, target, drafter)
        self._pools: dict[str, object] = {}
        self._relation: str | None = None
        # what is made on first use (pools, a drafter loaded by name, the relation, the prefill thread) is made
        # once: the server's preparing threads and the engine thread ask at the same time (re-entrant: a torch
        # pool loads the model)
        self._making = threading.RLock()
        # Logits beyond the smaller vocabulary (embedding padding) are never real tokens.
        self.vocab_size = min(logit_width(target.model), self.pool(self.backend).logit_width)

    @property
    def model(self):
        """The torch drafter model (the target for self-speculation), loaded on first use when given by name."""
        if isinstance(self._source, str):
            with self._making:
                if isinstance(self._source, str):
                    from rapidspec.models import load_model

                    loaded = load_model(self._source, dtype=self.target.dtype, device=self.target.device)
                    check_same_vocabulary(self.target.tokenizer, loaded.tokenizer)
                    self._source = loaded
        return self.target if self._source is None else self._source

    @property
    def relation(self) -> str:
        """``self``, ``larger`` or ``smaller`` (:mod:`.eta_default`), decided once."""
        if self._relation is None:
            with self._making:
                if self._relation is None:
                    self._relation = drafter_relation(self.target, self._source)
        return self._relation

    @property
    def label(self) -> str:
        """What drafts by default, e.g. ``self (llama.cpp, SmolLM2-135M-Instruct, Q8_0 copy of Q4_1)``."""
        return self.pool(self.backend).label

    def pool(self, backend: str):
        """The drafter pool of ``backend`` (``auto``: the default one), made on first use."""
        if backend == "auto":
            backend = self.backend
        pool = self._pools.get(backend)
        if pool is None:
            with self._making:
                pool = self._pools.get(backend) or self._make_pool(backend)
                self._pools[backend] = pool
        return pool

    def _make_pool(self, backend: str):
        """A new pool of ``backend``, checked once when it is made (not on every request)."""
        return new_pool(backend, self.target, self._source, self.target.tokenizer, self.options, lambda: self.model,
                        self.prefill_chunk_tokens, keep=self.keep, kv_cache=self.kv_cache)

    def max_context(self, config) -> int | None:
        """The drafter's window for ``config`` (None: no model drafter, or no limit of its own)."""
        if MODE_TABLE[config.mode].drafter_kind != "model":
            return None
        return self.pool(config.drafter_backend).max_context or None

    def drafter_kind(self, config) -> str | None:
        """``model``, ``lookup`` or None: what drafts in ``config.mode`` (:mod:`.modes`)."""
        return MODE_TABLE[config.mode].drafter_kind

    def start(self, prompts, config, stats, device: torch.device):
        """The drafter of this generation, prefilled on its prompt (None for modes without one)."""
        pending = self.begin(prompts, config, stats, device)
        if pending is None or isinstance(pending, LookupDrafter):
            return pending
        pending.advance(None)
        return pending.drafter()

    def begin(self, prompts, config, stats, device: torch.device):
        """The drafter of this generation before its prefill: a :class:`~.backends.PendingDrafter` for a
        model, a ready :class:`~.lookup.LookupDrafter`, or None for modes without one."""
        kind = self.drafter_kind(config)
        if kind is None or prompts.drafter_ids is None:
            return None
        if kind == "lookup":
            stats.drafter = "lookup"
            return LookupDrafter(list(prompts.drafter_ids), self.vocab_size, device)
        pool = self.pool(config.drafter_backend)
        stats.drafter = pool.label
        room = config.max_new_tokens + config.max_gamma + 2
        vocab = min(logit_width(self.target.model), pool.logit_width)
        pending = pool.begin(prompts.drafter_ids, room, vocab, device)
        stats.drafter_prefill_reused_tokens, stats.drafter_prefill_disk_tokens = pending.reused, pending.from_disk
        return pending

    def kept_prefix(self, prompts, config, kept: list[tuple[int, ...]]) -> int:
        """Tokens of the drafter's prompt the caches ``kept`` hold, by their tokens (0 without a model drafter)."""
        if self.drafter_kind(config) != "model" or prompts.drafter_ids is None:
            return 0
        return self.pool(config.drafter_backend).kept_prefix(prompts.drafter_ids, kept)

    def costs_key(self, config) -> str:
        """What a drafter's measured costs are kept under: its weights (the GGUF file, or the torch model's name,
        dtype, device and runtime) and llama.cpp's threads."""
        pool = self.pool(config.drafter_backend)
        if isinstance(pool, LlamaCppDrafters):
            return f"drafter {pool.model.path} ({pool.model.description}) on llama.cpp, {self.threads} threads"
        model = self.model
        return (f"drafter {model.label} (target {self.target.label}) {model.dtype} {model.device.type} "
                f"{model.runtime} on torch")

    def prefills_beside(self, config) -> bool:
        """Whether this generation's drafter prefills while the target prefills (module docstring)."""
        if self.options.drafter_prefill == "after" or MODE_TABLE[config.mode].drafter_kind != "model":
            return False
        backend = choose_backend(config.drafter_backend, self.target, self._source) \
            if config.drafter_backend != "auto" else self.backend
        if backend != "llama.cpp":
            return False
        return self.options.drafter_prefill == "beside" or spare_cores() >= self.threads

    def start_beside(self, prompts, config, stats, device: torch.device) -> Future | None:
        """:meth:`start` on the factory's own thread when :meth:`prefills_beside` (else None), retrieval first
        when ``prompts`` defer it; the future holds (the resolved prompts, the drafter, seconds it took)."""
        if not self.prefills_beside(config):
            return None
        stats.drafter_prefill_beside = True
        with self._making:
            if self._beside is None:
                # llama.cpp's team here has its own thread count; torch (retrieval's embedder) runs on this thread
                # alone, else it would keep a second team of torch's threads (rapidspec.runtime.threads)
                self._beside = ThreadPoolExecutor(1, thread_name_prefix="rapidspec-drafter-prefill",
                                                  initializer=helper_thread)

        def run():
            started = time.perf_counter()
            ready = prompts
            if ready.deferred is not None:  # retrieval first, on this thread too
                ready = ready.deferred.resolve()
            drafter = self.start(ready, config, stats, device)
            return ready, drafter, time.perf_counter() - started

        return self._beside.submit(run)

    def started(self, beside: Future | None, prompts, config, stats, device: torch.device):
        """(prompts, drafter) of the generation: from ``beside`` (:meth:`start_beside`) when given, else
        :meth:`start` now (synchronised with its device, so the time around this call is the drafter's prefill)."""
        if beside is not None:
            prompts, drafter, stats.drafter_prefill_own_seconds = beside.result()
            return prompts, drafter
        drafter = self.start(prompts, config, stats, device)
        if drafter is not None and drafter.device.type == "cuda":
            torch.cuda.synchronize(drafter.device)
        return prompts, drafter

    def clear(self) -> None:
        """Forget the caches the pools keep (the next drafter prefill starts from scratch)."""
        for pool in self._pools.values():
            pool.clear()


def drop_started(beside: Future | None) -> None:
    """Wait for a drafter started beside a prefill that failed or was stopped, and give its cache back."""
    if beside is None:
        return
    try:
        _, drafter, _ = beside.result()
    except Exception:  # noqa: BLE001  (the prefill's own error is the one raised)
        logger.debug("the drafter's prefill beside a stopped target prefill failed", exc_info=True)
        return
    if drafter is not None:
        drafter.close(keep=True)  # its prefill finished: the cache is consistent
