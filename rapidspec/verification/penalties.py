"""Frequency, presence and repetition penalties along a drafted path, as pure tensor functions and one state.

The penalties change the logits z of a position before anything else (the
temperature, the filters and eta's shift come after, as transformers' logits
processors and vLLM's sampler order them)::

    z'[v] = z[v] - frequency * c[v] - presence * 1[c[v] > 0]           OpenAI's two, c = count in the answer
    z'[v] = z'[v] / r if z'[v] > 0 else z'[v] * r   for v in s          repetition (transformers, vLLM), s = seen

with ``c`` the counts of each token among the answer tokens before the
position and ``s`` the tokens of the target's prompt and of the answer before
it. A round's rows follow its drafted path: row i of a verification counts the
committed answer and the drafts x_1..x_{i-1}, the drafter's row after i drafts
counts the same, so the target's rows and the drafter's are penalised alike (as
a grammar masks them) and at eta = 0 every token follows the penalised target.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def penalise(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, frequency: float, presence: float,
             repetition: float) -> torch.Tensor:
    """The penalised logits ([n, V]) of ``logits`` ([n, V]), row by row.

    ``counts``: [n, V], each token's count among the answer tokens before the row's position; ``seen``: [n, V]
    bool, whether the token is in the prompt or among those answer tokens. -inf (masked) stays -inf.
    """
    out = logits
    if frequency != 0.0 or presence != 0.0:
        out = out - frequency * counts.to(out.dtype) - presence * (counts > 0).to(out.dtype)
    if repetition != 1.0:
        out = torch.where(seen, torch.where(out > 0, out / repetition, out * repetition), out)
    return out


def path_counts(counts: torch.Tensor, path: Sequence[int], rows: int) -> torch.Tensor:
    """[rows, V]: row i is ``counts`` ([V]) plus one for each of ``path[:i]`` (the drafts before position i)."""
    out = counts.expand(rows, -1).clone()  # [rows, V]
    for i, token in enumerate(path[: rows - 1]):
        out[i + 1 :, token] += 1
    return out


class Penalties:
    """The penalties of one generation: the answer's counts and the seen tokens, updated as tokens commit.

    ``prompt_ids``: the target's prompt (the repetition penalty's ``seen`` starts with it); ``width``: the
    widest logit row it penalises (rows narrower than it read its first columns).
    """

    def __init__(self, prompt_ids: Sequence[int], width: int, frequency: float, presence: float, repetition: float,
                 device: torch.device) -> None:
        self.frequency, self.presence, self.repetition = frequency, presence, repetition
        self.counts = torch.zeros(width, dtype=torch.int32, device=device)  # [V]
        self.seen = torch.zeros(width, dtype=torch.bool, device=device)  # [V]
        prompt = [t for t in prompt_ids if 0 <= t < width]
        if prompt:
            self.seen[torch.tensor(prompt, device=device)] = True

    @classmethod
    def of(cls, config, prompt_ids: Sequence[int], width: int, device: torch.device) -> "Penalties | None":
        """The penalties a :class:`~rapidspec.config.DecodeConfig` asks for, or None when all are off."""
        if config.frequency_penalty == 0.0 and config.presence_penalty == 0.0 and config.repetition_penalty == 1.0:
            return None
        return cls(prompt_ids, width, config.frequency_penalty, config.presence_penalty, config.repetition_penalty,
                   device)

    def rows(self, logits: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        """Penalise ``logits`` ([n, V]) whose row i follows the committed answer and ``path[:i]``."""
        n, width = logits.shape
        counts = path_counts(self.counts[:width].to(logits.device), path, n)  # [n, V]
        seen = self.seen[:width].to(logits.device).expand(n, -1) | (counts > 0)  # [n, V]
        return penalise(logits, counts, seen, self.frequency, self.presence, self.repetition)

    def row_after(self, logits: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        """Penalise one row ([V]) at the position after the committed answer and all of ``path``."""
        width = logits.shape[-1]
        counts = self.counts[:width].to(logits.device).clone()  # [V]
        for token in path:
            counts[token] += 1
        seen = self.seen[:width].to(logits.device) | (counts > 0)  # [V]
        return penalise(logits[None], counts[None], seen[None], self.frequency, self.presence, self.repetition)[0]

    def commit(self, emitted: Sequence[int]) -> None:
        """The round's emitted tokens join the answer."""
        for token in emitted:
            if 0 <= token < self.counts.shape[0]:
                self.counts[token] += 1
                self.seen[token] = True
