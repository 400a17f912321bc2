"""How a model's forward runs: transformers' modules or the lean forward.

Contract: :func:`new_kv_cache` returns an empty cache satisfying
:class:`~rapidspec.runtime.protocol.KVCacheProtocol` (``forward``,
``prefill``, ``prefill_chunks``, ``crop``, ``reserve``, ``clone``, ``length``,
``token_ids``, ``device``, ``memory_bytes``) whichever forward the model runs,
so the engine, the prefix cache and the benchmarks never ask which one it is.
The package imports nothing from the rest of rapidspec; it raises its own
``ValueError`` subclasses (:mod:`~rapidspec.runtime.errors`) and reads the
cache directory itself (:mod:`~rapidspec.runtime.cache_dir`).

Modules:

* :mod:`~rapidspec.runtime.cache`: :class:`~rapidspec.runtime.cache.KVCache`,
  a transformers ``DynamicCache`` that grows in place, for transformers' forward.
* :mod:`~rapidspec.runtime.lean` and :mod:`~rapidspec.runtime.lean_cache`:
  the lean forward of llama and qwen2 models and its preallocated cache.
* :mod:`~rapidspec.runtime.attention`: grouped-query attention without
  repeating key/value heads (both forwards), whose path for short CPU queries
  is measured once per machine and kept in the cache directory.
* :mod:`~rapidspec.runtime.packed` and :mod:`~rapidspec.runtime.quantization`:
  prepacked float linear layers and int8/int4 weight-only layers.
* :mod:`~rapidspec.runtime.native_dtype`: the dtype a device computes in
  natively (bfloat16 or float32), for models and the retrieval embedder.
* :mod:`~rapidspec.runtime.llama_cpp` and :mod:`~rapidspec.runtime.gguf_copy`:
  GGUF models on llama.cpp, and the fast-prefill copy of a Q4_1 file;
  :mod:`~rapidspec.runtime.llama_log` sends llama.cpp's log to ``logging``.
* :mod:`~rapidspec.runtime.progress_bars`: transformers' model-loading bars
  only where the caller asked for progress.
* :mod:`~rapidspec.runtime.batching`: several generations' forwards as one.
* :mod:`~rapidspec.runtime.threads`: the one thread of a process that uses
  torch's (OpenMP) threads.
"""

from __future__ import annotations

from rapidspec.runtime.cache import PREFILL_CHUNK_TOKENS, KVCache
from rapidspec.runtime.protocol import KVCacheProtocol


def new_kv_cache(loaded, prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> KVCacheProtocol:
    """An empty cache of ``loaded`` (a :class:`~rapidspec.models.LoadedModel`).

    The lean runtime's cache when the model was loaded with one, else a
    :class:`~rapidspec.runtime.cache.KVCache` over transformers' forward.
    """
    lean = getattr(loaded, "lean", None)
    if lean is not None:
        from rapidspec.runtime.lean_cache import LeanKVCache

        return LeanKVCache(lean, prefill_chunk_tokens)
    return KVCache(loaded.model, prefill_chunk_tokens)
