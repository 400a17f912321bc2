"""What the drafter reads when it is not retrieved text: a StreamingLLM view (mode ``magicdec``).

MagicDec (Chen et al., 2024; the RAPID paper's baseline) drafts with the
target's weights over a StreamingLLM key/value cache: the first few "sink"
tokens of the prompt plus the most recent ones. Built as token ids, the view
is a prompt of its own: the drafter caches it with positions 0..budget-1,
which is how StreamingLLM positions a cache (by slot, not by the original
position). The view ends with the target's prompt, so both continue from the
same text and their drafts align token for token. As the answer grows the
drafter's cache grows with it (no eviction during one answer), so the
budget holds for the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence



def streaming_view(token_ids: Sequence[int], sink_tokens: int, budget_tokens: int) -> tuple[int, ...]:
    """The first ``sink_tokens`` and the last ``budget_tokens - sink_tokens`` of ``token_ids`` (all when they fit)."""
    if not 0 <= sink_tokens <= budget_tokens:
        raise ValueError(f"need 0 <= sink_tokens <= budget_tokens, got {sink_tokens} and {budget_tokens}")
    if len(token_ids) <= budget_tokens:
        return tuple(token_ids)
    recent = budget_tokens - sink_tokens
    return tuple(token_ids[:sink_tokens]) + tuple(token_ids[len(token_ids) - recent :])
