"""Log-probabilities of answer tokens (OpenAI's ``logprobs``), as pure functions over tensors.

Each answer token is reported under the distribution it follows: the
target's p, or p^ (paper Eq. 6) when eta > 0, whether the token was a draft
the target accepted, the recovered token at a rejection or the bonus token
(speculative sampling makes every emitted token follow that distribution,
:mod:`rapidspec.verification.sampling`). When sampling, p and p^ are taken after top-k /
top-p at the temperature, as tokens are drawn; when greedy, at temperature 1
without filters, the distribution whose argmax picked the token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rapidspec.verification.sampling import SamplingParams, augmented_rows

#: The log-probability reported for an impossible token (as vLLM does).
FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    """One answer token's log-probability and the most likely tokens at its position (most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def output_logprobs(target_logits: torch.Tensor, draft_rows: torch.Tensor | None, params: SamplingParams) -> torch.Tensor:
    """log p (eta = 0) or log p^ per position: [n, V] -> [n, V] (:func:`rapidspec.verification.sampling.augmented_rows`).

    ``draft_rows`` ([r, V], r <= n) are the drafter's rows as
    :func:`rapidspec.verification.sampling.verify` takes them (raw logits when greedy, q
    when sampling); positions past r, or all when None, use p.
    """
    return augmented_rows(target_logits, draft_rows, params).log_softmax(-1)


def token_logprobs(logprob_rows: torch.Tensor, token_ids: list[int], top: int) -> tuple[TokenLogprob, ...]:
    """Row i's log-probability of ``token_ids[i]`` and its ``top`` most likely tokens ([n, V] rows, n >= len(ids))."""
    rows = logprob_rows[: len(token_ids)].float().cpu()  # [m, V]
    rows = rows.clamp_min(FLOOR)  # a token outside top-k / top-p has log-probability -inf, which JSON cannot hold
    chosen = rows[torch.arange(len(token_ids)), torch.tensor(token_ids, dtype=torch.long)].tolist()  # [m]
    if top > 0:
        values, indices = rows.topk(min(top, rows.shape[-1]), dim=-1)  # [m, top]
        tops = [tuple((i, v) for i, v in zip(ids, vals) if v > FLOOR)
                for ids, vals in zip(indices.tolist(), values.tolist())]
    else:
        tops = [()] * len(token_ids)
    return tuple(TokenLogprob(token, value, tuple(best)) for token, value, best in zip(token_ids, chosen, tops))


def round_logprobs(target_logits, draft_rows, bonus_row, token_ids: list[int], params: SamplingParams, top: int,
                   vocab: int) -> tuple[TokenLogprob, ...]:
    """The log-probabilities of one round's emitted tokens, each with its ``top`` most likely alternatives.

    ``target_logits`` [k + 1, V] and ``draft_rows`` [r, V] as verified; ``bonus_row`` [V] (or None) is
    the drafter's row at position k + 1 when verification asked for it.
    """
    rows = draft_rows
    if rows is not None and bonus_row is not None and rows.shape[0] == target_logits.shape[0] - 1:
        rows = torch.cat([rows, bonus_row[None, :vocab].to(rows.dtype)])  # [k + 1, V]
    return token_logprobs(output_logprobs(target_logits[: len(token_ids)], rows, params), token_ids, top)
