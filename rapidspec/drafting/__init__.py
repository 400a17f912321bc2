"""Drafting: who proposes tokens in a round, from what, and with which cache.

* :mod:`.drafter`: the :class:`Drafter` protocol and :class:`ModelDrafter`, a model drafting over a key/value cache
  (torch or llama.cpp), with ``propose``, ``bonus_row``, ``commit``, ``close``.
* :mod:`.lookup`: prompt-lookup drafting (mode ``lookup``), no model.
* :mod:`.backends`: torch and llama.cpp caches, ``auto`` choice, vocabulary checks.
* :mod:`.streaming`: the StreamingLLM view mode ``magicdec`` drafts from.
* :mod:`.factory`: which drafter a generation gets (the mode table of :mod:`rapidspec.config` says which kind).
* :mod:`.eta_default`: the default eta by how the drafter relates to the target (self, larger, smaller).
* :mod:`.gamma_schedule`, :mod:`.calibration`, :mod:`.join`: how many tokens a round drafts, the machine's step
  costs, and when the drafter joins an answer.
"""

import importlib

_EXPORTS = {
    "NO_PROPOSAL": "rapidspec.drafting.drafter",
    "Drafter": "rapidspec.drafting.drafter",
    "ModelDrafter": "rapidspec.drafting.drafter",
    "Proposal": "rapidspec.drafting.drafter",
    "streaming_view": "rapidspec.drafting.streaming",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):  # torch loads with the drafters, not with the eta default or the join's arithmetic
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rapidspec.drafting' has no attribute {name!r}")
