"""How a model's forward runs: transformers' modules or the lean forward.

Both paths sit behind the same cache interface (``forward``, ``prefill``,
``crop``, ``clone``, ``length``, ``token_ids``, ``device``, ``memory_bytes``),
so the engine, the prefix cache and the benchmarks never ask which one runs.
"""

from __future__ import annotations

from rapidspec.cache import KVCache


def new_kv_cache(loaded, prefill_chunk_tokens: int = 2048):
    """An empty cache of ``loaded`` (a :class:`~rapidspec.models.LoadedModel`).

    The lean runtime's cache when the model was loaded with one, else a
    :class:`~rapidspec.cache.KVCache` over transformers' forward.
    """
    lean = getattr(loaded, "lean", None)
    if lean is not None:
        from rapidspec.runtime.lean_cache import LeanKVCache

        return LeanKVCache(lean, prefill_chunk_tokens)
    return KVCache(loaded.model, prefill_chunk_tokens)
