"""A GGUF model on llama.cpp, behind the same key/value-cache protocol as the torch caches.

Used where llama.cpp is the fastest engine for a job: the drafter on CPU (a
drafter step is a few hundred small PyTorch calls, which llama.cpp does in
one graph) and the ``llama.cpp`` peer of ``rapidspec bench``. Through
``llama-cpp-python``'s low-level API only:

* :class:`LlamaCppModel` loads a GGUF file as it is (no conversion) and
  reads its vocabulary, so callers can check it against the target's.
* :class:`LlamaCppContext` is one ``llama_context`` over one token sequence
  (sequence 0) with ``forward``, ``prefill``, ``crop``, ``length``,
  ``token_ids``, ``device``: the protocol of :mod:`rapidspec.runtime`.
  Rollback is ``llama_memory_seq_rm`` (tens of microseconds; the logits that
  follow are those of a fresh context over the kept tokens). A freed
  context is kept, cleared, for the model's next context of its size
  (:data:`KEPT_IDLE_CONTEXTS`): a request's drafter does not wait for
  llama.cpp to allocate and plan a new one.

Flash attention is off by default: on CPU it made a drafter step slower.
Inside a server's batched tick (:mod:`rapidspec.runtime.batching`) a context
decodes a step on one thread: the step's thread computes alone there
(:mod:`rapidspec.runtime.threads`), and the decode gate lets as many contexts
decode at once as there are cores; a prefill (:data:`SERVED_PREFILL_TOKENS`
or more) is handed to the tick's serving thread and runs on all the
context's threads.
Logits come back as float32 torch tensors on the CPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from rapidspec.runtime.batching import current_batcher
from rapidspec.runtime.cache import HeldTokens
from rapidspec.runtime.llama_log import route_llama_log

logger = logging.getLogger(__name__)

#: Tokens per llama_decode call during prefill (llama.cpp's n_batch).
BATCH_TOKENS = 512
#: Inside a server's batched tick, a feed of at least this many tokens (a prefill) runs on the serving thread.
SERVED_PREFILL_TOKENS = 64
#: Contexts are sized in multiples of this many tokens.
CONTEXT_QUANTUM = 1024
#: Freed contexts a model keeps, cleared, for its next ``new_context`` of the same size (the oldest goes first):
#: creating one took 58 ms at 8K tokens for Qwen2.5-Coder 0.5B on 2 cores, clearing a kept one microseconds.
KEPT_IDLE_CONTEXTS = 2


_gates: dict[int, threading.BoundedSemaphore] = {}
_gates_lock = threading.Lock()


def decode_gate(threads: int) -> threading.BoundedSemaphore:
    """How many llama.cpp contexts of ``threads`` threads may decode at once: as many as the CPU has cores for.

    llama.cpp's threads wait for each other by spinning, so two contexts
    decoding at once on cores they must share (a server's batched steps
    drafting for several requests) slow each other far more than taking
    turns does; beyond the cores, they take turns.
    """
    with _gates_lock:
        if threads not in _gates:
            _gates[threads] = threading.BoundedSemaphore(max(1, (os.cpu_count() or 1) // threads))
        return _gates[threads]


def llama_cpp_available() -> bool:
    """Whether ``llama-cpp-python`` can be imported (it is an optional, natively built dependency)."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def bindings():
    """The ``llama_cpp`` module, with llama.cpp's log sent to Python's logging (:mod:`.llama_log`)."""
    import llama_cpp

    route_llama_log(llama_cpp)
    return llama_cpp


class LlamaCppModel:
    """The weights of one GGUF file on llama.cpp (CPU), shared by its contexts."""

    def __init__(self, path: str | Path, threads: int = 2, flash_attention: bool = False) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        ll = bindings()
        self._ll = ll
        self.path = Path(path)
        self.threads = threads
        self.flash_attention = flash_attention
        ll.llama_backend_init()
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 0
        self._model = ll.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {self.path}")
        self._vocab = ll.llama_model_get_vocab(self._model)
        self.vocab_size = int(ll.llama_vocab_n_tokens(self._vocab))
        self.max_context = int(ll.llama_model_n_ctx_train(self._model))
        buffer = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self._model, buffer, len(buffer))
        self.description = buffer.value.decode("utf-8", "replace")  # e.g. "llama 256M Q4_1"
        self._idle: list[tuple[int, int, object]] = []  # (capacity, threads, llama_context), oldest first
        self._idle_lock = threading.Lock()

    def token_texts(self, count: int | None = None) -> list[str]:
        """The text of the first ``count`` tokens of the vocabulary (all by default), as the GGUF stores it."""
        n = self.vocab_size if count is None else min(count, self.vocab_size)
        get = self._ll.llama_vocab_get_text
        return [(get(self._vocab, i) or b"").decode("utf-8", "replace") for i in range(n)]

    def new_context(self, n_ctx: int) -> LlamaCppContext:
        """A context with room for ``n_ctx`` tokens (rounded up to :data:`CONTEXT_QUANTUM`, at most the training window)."""
        return LlamaCppContext(self, n_ctx)

    def _take_idle(self, capacity: int) -> tuple[int, object] | None:
        """A kept context of ``capacity`` tokens (its threads and handle), or None."""
        with self._idle_lock:
            for index, (size, threads, ctx) in enumerate(self._idle):
                if size == capacity:
                    del self._idle[index]
                    return threads, ctx
        return None

    def _keep_or_free(self, capacity: int, threads: int, ctx) -> None:
        """Keep a freed context, its memory cleared, for a later ``new_context``; beyond the bound free the oldest.
        Called from ``__del__``: where a collection runs inside ``_take_idle`` the lock is held, and it is freed."""
        if not self._idle_lock.acquire(blocking=False):
            self._ll.llama_free(ctx)
            return
        try:
            self._ll.llama_memory_clear(self._ll.llama_get_memory(ctx), False)  # cells free; their data is never read
            self._idle.append((capacity, threads, ctx))
            while len(self._idle) > KEPT_IDLE_CONTEXTS:
                self._ll.llama_free(self._idle.pop(0)[2])
        finally:
            self._idle_lock.release()

    def __del__(self) -> None:
        for _, _, ctx in getattr(self, "_idle", ()):
            self._ll.llama_free(ctx)
        model = getattr(self, "_model", None)
        if model:
            self._ll.llama_model_free(model)
            self._model = None


class LlamaCppContext(HeldTokens):
    """One llama.cpp context over one token sequence; the only writer of its key/value memory."""

    def __init__(self, model: LlamaCppModel, n_ctx: int) -> None:
        super().__init__(BATCH_TOKENS)
        ll = model._ll
        self._ll = ll
        self.model = model
        capacity = -(-max(n_ctx, 1) // CONTEXT_QUANTUM) * CONTEXT_QUANTUM
        if model.max_context > 0:
            capacity = min(capacity, max(model.max_context, n_ctx))
        self._threads = model.threads
        kept = model._take_idle(capacity)
        if kept is not None:
            self._threads, self._ctx = kept
        else:
            params = ll.llama_context_default_params()
            params.n_ctx = capacity
            params.n_batch = params.n_ubatch = BATCH_TOKENS
            params.n_threads = params.n_threads_batch = model.threads
            params.flash_attn_type = (ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if model.flash_attention
                                      else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED)
            params.no_perf = True
            self._ctx = ll.llama_init_from_model(model._model, params)
            if not self._ctx:
                raise RuntimeError(f"llama.cpp could not create a context of {capacity} tokens for {model.path}")
        self._capacity_asked = capacity
        self.capacity = int(ll.llama_n_ctx(self._ctx))
        self._memory = ll.llama_get_memory(self._ctx)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, token_ids: Sequence[int], num_logits: int = 1) -> torch.Tensor:
        """Append ``token_ids`` and return float32 logits [1, V] after the last of them (``num_logits`` must be 1)."""
        self._check_forward(token_ids, num_logits)
        if num_logits != 1:
            raise ValueError("a llama.cpp context returns the logits of the last token only")
        if self.length + len(token_ids) > self.capacity:
            raise ValueError(f"{self.length + len(token_ids)} tokens exceed the context's {self.capacity}")
        batcher = current_batcher()
        if batcher is None:
            return self._decode(token_ids, self.model.threads)
        if len(token_ids) >= SERVED_PREFILL_TOKENS:  # a prefill: on the tick's serving thread, with all threads
            return batcher.call(lambda: self._decode(token_ids, self.model.threads))
        return self._decode(token_ids, 1)  # a step on the step's own thread, which computes alone

    def _decode(self, token_ids: Sequence[int], threads: int) -> torch.Tensor:
        ll = self._ll
        if threads != self._threads:
            ll.llama_set_n_threads(self._ctx, threads, threads)
            self._threads = threads
        for start in range(0, len(token_ids), BATCH_TOKENS):
            part = [int(t) for t in token_ids[start : start + BATCH_TOKENS]]
            array = (ll.llama_token * len(part))(*part)
            with decode_gate(threads):
                status = ll.llama_decode(self._ctx, ll.llama_batch_get_one(array, len(part)))
            if status != 0:
                self.crop(self.length)  # keep memory and token list in step after a partial failure
                raise RuntimeError(f"llama_decode failed with status {status}")
            self._token_ids.extend(part)
        pointer = ll.llama_get_logits_ith(self._ctx, -1)
        logits = np.ctypeslib.as_array(pointer, shape=(self.model.vocab_size,))
        return torch.from_numpy(logits.copy())[None]  # [1, V]

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` tokens (rollback of rejected tokens)."""
        self._check_crop(length)
        self._ll.llama_memory_seq_rm(self._memory, 0, length, -1)
        del self._token_ids[length:]

    def clone(self, capacity: int | None = None) -> LlamaCppContext:
        """A new context holding the same tokens (recomputed: llama.cpp contexts are not copied)."""
        twin = LlamaCppContext(self.model, max(self.capacity, capacity or 0))
        twin.prefill(self._token_ids)
        return twin

    def state(self) -> bytes:
        """The key/value state of the tokens held, as llama.cpp's state API writes a sequence
        (:mod:`~rapidspec.runtime.llama_state_store` keeps it on disk)."""
        ll = self._ll
        size = int(ll.llama_state_seq_get_size(self._ctx, 0))
        buffer = (ctypes.c_uint8 * size)()
        written = int(ll.llama_state_seq_get_data(self._ctx, buffer, size, 0))
        return ctypes.string_at(buffer, written)

    def load_state(self, data: bytes, token_ids: Sequence[int]) -> bool:
        """Hold ``token_ids`` from their ``data`` (:meth:`state` of a context of the same file) instead of what the
        context held; False, holding nothing, when llama.cpp refuses the data or it does not hold that many tokens."""
        ll = self._ll
        if len(token_ids) > self.capacity:
            return False
        self.crop(0)
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        read = int(ll.llama_state_seq_set_data(self._ctx, buffer, len(data), 0))
        if read != len(data) or int(ll.llama_memory_seq_pos_max(self._memory, 0)) != len(token_ids) - 1:
            ll.llama_memory_clear(self._memory, False)
            return False
        self._token_ids = [int(t) for t in token_ids]
        return True

    def memory_bytes(self) -> int:
        """Bytes of the key/value memory llama.cpp reports for this context (0 if it does not say)."""
        size = getattr(self._ll, "llama_state_get_size", None)
        return int(size(self._ctx)) if size is not None else 0

    def __del__(self) -> None:
        ctx = getattr(self, "_ctx", None)
        if ctx:
            self._ctx = None
            self.model._keep_or_free(self._capacity_asked, self._threads, ctx)
