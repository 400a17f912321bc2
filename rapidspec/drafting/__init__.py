"""Drafting: who proposes tokens in a round, from what, and with which cache.

* :mod:`.modes`: the one table of modes (what the target reads, the drafter
  kind, whether eta may be > 0).
* :mod:`.drafter`: the :class:`Drafter` protocol and :class:`ModelDrafter`, a model drafting over a key/value cache
  (torch or llama.cpp), with ``propose``, ``bonus_row``, ``commit``, ``close``.
* :mod:`.lookup`: prompt-lookup drafting (mode ``lookup``), no model.
* :mod:`.backends`: torch and llama.cpp caches, ``auto`` choice, vocabulary checks.
* :mod:`.streaming`: the StreamingLLM view mode ``magicdec`` drafts from.
* :mod:`.eta_default`: the default eta by how the drafter relates to the target (self, larger, smaller).
"""

from rapidspec.drafting.drafter import NO_PROPOSAL, Drafter, ModelDrafter, Proposal
from rapidspec.drafting.modes import (
    MODE_TABLE,
    MODES,
    TARGET_READS_RETRIEVED,
    USES_DRAFTER,
    USES_RETRIEVAL,
    ModeSpec,
)
from rapidspec.drafting.streaming import DEFAULT_SINK_TOKENS, DEFAULT_STREAMING_TOKENS, streaming_view

__all__ = [
    "DEFAULT_SINK_TOKENS",
    "DEFAULT_STREAMING_TOKENS",
    "MODES",
    "MODE_TABLE",
    "NO_PROPOSAL",
    "TARGET_READS_RETRIEVED",
    "USES_DRAFTER",
    "USES_RETRIEVAL",
    "Drafter",
    "ModelDrafter",
    "ModeSpec",
    "Proposal",
    "streaming_view",
]
