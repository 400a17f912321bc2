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

from rapidspec.drafting.drafter import NO_PROPOSAL, Drafter, ModelDrafter, Proposal
from rapidspec.drafting.streaming import streaming_view

__all__ = ["NO_PROPOSAL", "Drafter", "ModelDrafter", "Proposal", "streaming_view"]
