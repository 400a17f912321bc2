"""One owner per KV cache: append through the model, roll back, know what is held.

:class:`KVCache` wraps a transformers ``DynamicCache`` together with the token
ids it holds, so that "what the cache contains" is never a counter kept by
someone else. Rollback uses only the public ``Cache.crop``.

Convention used by the engine: after every round a cache holds every
committed token except possibly the last one or two, which are fed at the start
of the next forward pass (``pending`` tokens).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import DynamicCache


class KVCache:
    """The key/value cache of one model over one token sequence (batch size 1)."""

    def __init__(self, model: torch.nn.Module, prefill_chunk_tokens: int = 2048) -> None:
        if prefill_chunk_tokens < 1:
            raise ValueError("prefill_chunk_tokens must be >= 1")
        self.model = model
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._cache = DynamicCache(config=model.config)
        self._token_ids: list[int] = []

    @property
    def length(self) -> int:
        """Number of tokens whose keys/values are held."""
        return len(self._token_ids)

    @property
    def token_ids(self) -> list[int]:
        """The tokens held, in order (a copy)."""
        return list(self._token_ids)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def forward(self, token_ids: Sequence[int], num_logits: int = 1) -> torch.Tensor:
        """Append ``token_ids`` and return the logits of the last ``num_logits`` of them.

        Returns float32 logits of shape [num_logits, V] on :attr:`device` (the
        device of the input embeddings, also for models split over several
        GPUs); row j predicts the token after ``token_ids[len - num_logits + j]``.
        """
        if not token_ids:
            raise ValueError("forward needs at least one token")
        if not 1 <= num_logits <= len(token_ids):
            raise ValueError(f"num_logits must be in [1, {len(token_ids)}], got {num_logits}")
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(
            input_ids=input_ids,
            past_key_values=self._cache,
            use_cache=True,
            logits_to_keep=num_logits,
        )
        self._token_ids.extend(int(t) for t in token_ids)
        return out.logits[0, -num_logits:].to(self.device).float()  # [num_logits, V]

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor | None:
        """Append a long sequence in chunks (bounded activation memory).

        Returns the logits after the last token ([1, V]), or None for no tokens.
        """
        logits = None
        for start in range(0, len(token_ids), self.prefill_chunk_tokens):
            logits = self.forward(token_ids[start : start + self.prefill_chunk_tokens], num_logits=1)
        return logits

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` tokens (rollback of rejected tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {length}")
        remove = self.length - length
        if remove:
            # transformers 5 crops by a negative count of tokens to remove.
            self._cache.crop(-remove)
            del self._token_ids[length:]

    def clone(self) -> "KVCache":
        """An independent copy (used to reuse a document prefix across questions)."""
        twin = KVCache.__new__(KVCache)
        twin.model = self.model
        twin.prefill_chunk_tokens = self.prefill_chunk_tokens
        twin._cache = copy.deepcopy(self._cache)
        twin._token_ids = list(self._token_ids)
        return twin

    def memory_bytes(self) -> int:
        """Bytes held by the key/value tensors."""
        total = 0
        for layer in getattr(self._cache, "layers", []):
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
        return total


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
