"""The one table of modes: what the target reads, who drafts from what, whether eta may be > 0.

Every other part of rapidspec (config validation, prompts, conversations,
the engine, benchmarks) asks this table instead of keeping a set of its own
::

    mode      target reads   drafter reads  drafter kind  eta > 0
    lc        full           -              -             no
    rag       retrieved      -              -             no
    sd        full           full           model         no
    ragsd     full           retrieved      model         no
    rapid     full           retrieved      model         yes
    magicdec  full           streaming      model         no
    lookup    full           retrieved      lookup        no

``model`` drafts with a language model (the target's weights or another
model, on torch or llama.cpp); ``lookup`` copies the continuation of the
latest earlier match of the last n tokens (prompt lookup, :mod:`.lookup`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Reads = Literal["full", "retrieved", "streaming"]


@dataclass(frozen=True)
class ModeSpec:
    target_reads: Literal["full", "retrieved"]
    drafter_reads: Reads | None = None
    drafter_kind: Literal["model", "lookup"] | None = None
    eta: bool = False  # whether eta > 0 is allowed

    @property
    def uses_retrieval(self) -> bool:
        return "retrieved" in (self.target_reads, self.drafter_reads)


MODE_TABLE: dict[str, ModeSpec] = {
    "lc": ModeSpec("full"),
    "rag": ModeSpec("retrieved"),
    "sd": ModeSpec("full", "full", "model"),
    "ragsd": ModeSpec("full", "retrieved", "model"),
    "rapid": ModeSpec("full", "retrieved", "model", eta=True),
    "magicdec": ModeSpec("full", "streaming", "model"),
    "lookup": ModeSpec("full", "retrieved", "lookup"),
}
MODES: tuple[str, ...] = tuple(MODE_TABLE)

# Views of the table, for membership tests.
TARGET_READS_RETRIEVED = frozenset(m for m, s in MODE_TABLE.items() if s.target_reads == "retrieved")
USES_DRAFTER = frozenset(m for m, s in MODE_TABLE.items() if s.drafter_kind is not None)
USES_RETRIEVAL = frozenset(m for m, s in MODE_TABLE.items() if s.uses_retrieval)
