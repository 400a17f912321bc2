"""How many generations one engine can hold at once: ``max_num_seqs`` bounded by the memory left for caches.

Each running request holds its target cache, allocated once for its prompt
and answer (at most the window), and the prefix cache may grow to its bound.
The worker admits ``concurrent_sequences(...)`` requests at once; the rest
wait in the queue. The drafters' caches are left out: each holds the
retrieved text and the answer, a small part of the window, and the caches
the drafter pool keeps for reuse hold at most
:data:`~rapidspec.drafting.backends.KEPT_BYTES` beyond the newest; a llama.cpp
drafter also keeps up to :data:`~rapidspec.runtime.llama_cpp.KEPT_IDLE_CONTEXTS`
freed contexts, cleared, for the next of their size (each sized for a
drafter's prompt and answer: about 100 MB at 8K tokens for the default model).
"""

from __future__ import annotations

import logging

import psutil
import torch

from rapidspec.runtime.prefix_cache import GIB

logger = logging.getLogger(__name__)


def kv_bytes_per_token(loaded) -> int:
    """Key/value bytes one position of ``loaded``'s cache takes (all layers, keys and values)."""
    config = loaded.model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2 * int(config.num_hidden_layers) * kv_heads * head_dim * loaded.dtype.itemsize


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for caches on ``device``: the GPU's free memory, or the machine's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def concurrent_sequences(max_num_seqs: int, window: int, per_token: int, free: int, prefix_cache_bytes: int) -> int:
    """``max_num_seqs`` or fewer: as many windows of ``per_token`` bytes as fit ``free`` less the prefix cache (>= 1)."""
    per_sequence = window * per_token
    fits = max(0, free - prefix_cache_bytes) // max(per_sequence, 1)
    slots = max(1, min(max_num_seqs, fits))
    if slots < max_num_seqs:
        logger.warning("max_num_seqs=%d: the free memory (%.2f GiB, less %.2f GiB for the prefix cache) holds %d "
                       "window(s) of %d tokens (%.2f GiB each); at most %d request(s) run at once, the others wait",
                       max_num_seqs, free / GIB, prefix_cache_bytes / GIB, fits, window, per_sequence / GIB, slots)
    return slots
