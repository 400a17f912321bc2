"""What :class:`~rapidspec.vllm.RapidProposer` reads besides vLLM's own configuration.

vLLM builds a ``custom_class`` proposer from its ``VllmConfig`` alone, so
rapidspec's options come from the environment variable
``RAPIDSPEC_VLLM_OPTIONS``, a JSON object (unset or ``{}``: the defaults)::

    RAPIDSPEC_VLLM_OPTIONS='{"drafter": "builtin", "retrieval": {"budget_tokens": 1024}}' vllm serve ...

vLLM starts its engine core in a process of its own, which inherits the
variable.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields

from rapidspec.config import DRAFTER_BACKENDS
from rapidspec.errors import RapidspecError
from rapidspec.prompting.conversation import DEFAULT_RECENT_MESSAGES
from rapidspec.retrieval import RetrievalConfig

ENV_VARIABLE = "RAPIDSPEC_VLLM_OPTIONS"
#: ``cost``: rapidspec's cost model picks each round's drafts in [0, num_speculative_tokens]
#: (:mod:`rapidspec.drafting.gamma_schedule`); ``constant``: always num_speculative_tokens.
SCHEDULES = ("cost", "constant")
#: ``beside``: a new request's retrieval and drafter prefill run on the proposer's own thread while vLLM goes on
#: (the request gets drafts once they are done); ``inline``: in the step that first sees it, which waits.
PREPARES = ("beside", "inline")


@dataclass(frozen=True)
class ProposerOptions:
    """The proposer's options, validated on construction.

    ``drafter``: a rapidspec model name (``builtin``, ``builtin:qwen2.5-coder-0.5b``), a GGUF file or a
    model folder; None: the ``gguf`` (else ``model``) named by ``rapidspec.json`` in vLLM's model folder
    (``rapidspec models export`` writes it), else vLLM's model folder itself (self-speculation).
    ``drafter_backend``: ``auto`` (llama.cpp where vLLM runs on the CPU and the drafter has a GGUF file, else
    torch on vLLM's device), ``llama.cpp`` or ``torch``. ``drafter_threads``: llama.cpp's threads (None:
    torch's thread count). ``schedule``: :data:`SCHEDULES`. ``retrieval``: as rapidspec's retrieval options.
    ``recent_messages``: earlier chat messages the drafter reads verbatim (as ``rapidspec chat``).
    ``prepare``: :data:`PREPARES`.
    """

    drafter: str | None = None
    drafter_backend: str = "auto"
    drafter_threads: int | None = None
    schedule: str = "cost"
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    recent_messages: int = DEFAULT_RECENT_MESSAGES
    prepare: str = "beside"

    def __post_init__(self) -> None:
        if self.drafter is not None and (not isinstance(self.drafter, str) or not self.drafter.strip()):
            raise RapidspecError(f"drafter must be a model name or path, got {self.drafter!r}")
        if self.drafter_backend not in DRAFTER_BACKENDS:
            raise RapidspecError(f"drafter_backend must be one of {', '.join(DRAFTER_BACKENDS)}, "
                                 f"got {self.drafter_backend!r}")
        if self.drafter_threads is not None and (not isinstance(self.drafter_threads, int)
                                                 or self.drafter_threads < 1):
            raise RapidspecError(f"drafter_threads must be an integer >= 1, got {self.drafter_threads!r}")
        if self.schedule not in SCHEDULES:
            raise RapidspecError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.prepare not in PREPARES:
            raise RapidspecError(f"prepare must be one of {', '.join(PREPARES)}, got {self.prepare!r}")
        if not isinstance(self.recent_messages, int) or self.recent_messages < 0:
            raise RapidspecError(f"recent_messages must be an integer >= 0, got {self.recent_messages!r}")

    @classmethod
    def from_json(cls, text: str | None) -> ProposerOptions:
        """The options of a JSON object (module docstring); a :class:`RapidspecError` naming what is wrong."""
        if not text or not text.strip():
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise RapidspecError(f"{ENV_VARIABLE} is not JSON: {err}") from None
        if not isinstance(raw, dict):
            raise RapidspecError(f"{ENV_VARIABLE} must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise RapidspecError(f"{ENV_VARIABLE}: unknown option {unknown[0]!r}; known: {', '.join(sorted(known))}")
        retrieval = raw.pop("retrieval", None) or {}
        if not isinstance(retrieval, dict):
            raise RapidspecError(f"{ENV_VARIABLE}: retrieval must be an object of retrieval options")
        retrieval_fields = {f.name for f in fields(RetrievalConfig)}
        unknown = sorted(set(retrieval) - retrieval_fields)
        if unknown:
            raise RapidspecError(f"{ENV_VARIABLE}: unknown retrieval option {unknown[0]!r}; known: "
                                 f"{', '.join(sorted(retrieval_fields))}")
        return cls(**raw, retrieval=RetrievalConfig(**retrieval))

    @classmethod
    def from_env(cls) -> ProposerOptions:
        return cls.from_json(os.environ.get(ENV_VARIABLE))
