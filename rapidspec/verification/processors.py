"""One generation's logits processors, applied in one place and in one order to the target's and the drafter's rows.

A processor follows :class:`LogitsProcessor`: a grammar's state (:class:`rapidspec.grammar.GrammarState`: what
it forbids at -inf) and the penalties (:class:`rapidspec.verification.penalties.Penalties`) do. The drafter
processes each row it drafts from (``row_after``), the target the rows it verifies (``rows``) along the same
path, so both see the same distribution change; ``commit`` tells each one of the tokens a round emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch


class LogitsProcessor(Protocol):
    def rows(self, logits: torch.Tensor, drafts: Sequence[int]) -> torch.Tensor:
        """[k + 1, V] -> [k + 1, V]: row i follows the committed answer then ``drafts[:i]``."""
        ...

    def row_after(self, logits: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        """[V] -> [V]: the row after the committed answer then ``path``."""
        ...

    def commit(self, emitted: Sequence[int]) -> None:
        """The round emitted ``emitted`` after the committed answer."""
        ...


@dataclass(frozen=True)
class LogitsProcessors:
    """The grammar's state (None: unconstrained) then the penalties (None: none asked for), as one list."""

    grammar: object | None = None
    penalties: object | None = None

    @cached_property
    def processors(self) -> tuple[LogitsProcessor, ...]:
        """The ones present, in order (made once: every drafted token and every verification asks)."""
        return tuple(p for p in (self.grammar, self.penalties) if p is not None)

    def rows(self, logits: torch.Tensor, drafts: Sequence[int]) -> torch.Tensor:
        for processor in self.processors:
            logits = processor.rows(logits, drafts)
        return logits

    def row_after(self, logits: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        for processor in self.processors:
            logits = processor.row_after(logits, path)
        return logits

    def allowed_prefix(self, drafts: Sequence[int]) -> int:
        """How many leading ``drafts`` the grammar allows (drafts made without the rows: lookup's)."""
        return len(drafts) if self.grammar is None else self.grammar.allowed_prefix(drafts)

    def commit(self, emitted: Sequence[int]) -> bool:
        """Tell every processor; True when the answer now completes its grammar."""
        for processor in self.processors:
            processor.commit(emitted)
        return self.grammar is not None and self.grammar.finished


NO_PROCESSORS = LogitsProcessors()
