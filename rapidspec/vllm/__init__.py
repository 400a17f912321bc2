"""RAPID's drafter inside vLLM (docs/vllm.md): ``speculative_config={"method": "custom_class",
"model": "rapidspec.vllm.RapidProposer", ...}``; and where vLLM lives for rapidspec (:mod:`.environment`).

Importing this package does not import vLLM (rapidspec's own environment has none); :class:`RapidProposer`
is loaded on first use.
"""

from __future__ import annotations

__all__ = ["RapidProposer"]


def __getattr__(name: str):
    if name == "RapidProposer":
        from rapidspec.vllm.proposer import RapidProposer

        return RapidProposer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
