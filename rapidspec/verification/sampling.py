"""The math of one verification step, as pure tensor functions.

No model, no cache, no state. For one step with vocabulary V and temperature T > 0::

    z  = target logits; z / T then filtered by top-k / top-p (the temperature
         first, as transformers and OpenAI apply them), written z / T below
    p  = softmax(z / T)                        target_probs
    q  = softmax(z_d / T)                      draft_probs (same filters)
    g  = (q - p) where q >= alpha * max(q), else 0        the draft gate
    p^ = softmax(z / T + eta * g)              augmented_probs (paper Eq. 6)

A drafted token x ~ q is accepted with probability min(1, p^(x) / q(x)). At the
first rejection the replacement token is drawn from a residual:

* ``"exact"``: norm(max(0, p^ - q)); every emitted token then follows p^
  exactly (p when eta = 0).
* ``"paper"``: norm(max(0, p - p^, p - q)), Eq. 10 of the paper; it follows
  neither p nor p^ in general (the paper's Eq. 10; see ``output_distribution_paper``).

Greedy (T = 0): drafts are argmax q; the target's choice is argmax(z + eta * g)
with p and q taken at temperature 1; the longest matching prefix is kept.

Shapes: ``[k, V]`` is k positions of one sequence (batch size 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Residual = Literal["exact", "paper"]


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask logits outside the top-k / top-p nucleus with -inf.

    ``logits``: [k, V], already divided by the temperature (the nucleus
    depends on it). ``top_k = 0`` and ``top_p = 1`` disable the filters.
    The nucleus keeps the smallest set of most likely tokens whose probability
    reaches ``top_p`` (always at least one token).
    """
    assert logits.dim() == 2, "logits must be [k, V]"
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [k, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [k, V]
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [k, V]
        # Drop a token when the mass *before* it already reaches top_p.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p  # [k, V]
        drop_sorted[:, 0] = False  # the most likely token stays, however small top_p (1e-300 is 0 in float32)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def draft_gate(target_probs: torch.Tensor, draft_probs: torch.Tensor, alpha: float) -> torch.Tensor:
    """The shift g = (q - p) on tokens where q >= alpha * max(q), 0 elsewhere.

    ``target_probs``, ``draft_probs``: [k, V]. Returns [k, V]. ``alpha = 0``
    applies the shift to every token.
    """
    gate = draft_probs >= alpha * draft_probs.amax(dim=-1, keepdim=True)  # [k, V]
    return torch.where(gate, draft_probs - target_probs, torch.zeros_like(draft_probs))


def augmented_logits(
    scaled_target_logits: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    eta: float,
    alpha: float,
) -> torch.Tensor:
    """z / T + eta * g, the logits of the retrieval-augmented target p^ (Eq. 6).

    ``scaled_target_logits`` is z / T ([k, V]); -inf entries (filtered tokens)
    stay -inf. With ``eta = 0`` this returns ``scaled_target_logits``.
    """
    if eta == 0.0:
        return scaled_target_logits
    return scaled_target_logits + eta * draft_gate(target_probs, draft_probs, alpha)


def accepted_prefix_length(accept: torch.Tensor) -> int:
    """Number of leading True values of a [k] boolean tensor.

    Example: ``[True, True, False, True] -> 2``; ``[] -> 0``.
    """
    if accept.numel() == 0:
        return 0
    return int(accept.to(torch.int64).cumprod(dim=0).sum().item())


def acceptance_mask(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    augmented_probs: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """Accept drafted token i iff u_i <= p^_i(x_i) / q_i(x_i).

    ``draft_tokens``: [k] int; ``draft_probs``, ``augmented_probs``: [k, V]
    (only the first k rows are read); ``uniforms``: [k] in [0, 1). Returns [k] bool.
    """
    k = draft_tokens.shape[0]
    index = draft_tokens.view(k, 1)
    drafted_q = draft_probs[:k].gather(-1, index).squeeze(-1)  # [k]
    drafted_p_hat = augmented_probs[:k].gather(-1, index).squeeze(-1)  # [k]
    # u <= p^/q  <=>  u * q <= p^ (q > 0 because x was drawn from q).
    return uniforms * drafted_q <= drafted_p_hat


def _normalize_or(mass: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """mass / sum(mass) per row; rows whose mass is (numerically) zero get ``fallback``."""
    total = mass.sum(dim=-1, keepdim=True)  # [k, 1]
    return torch.where(total > 1e-12, mass / total.clamp_min(1e-30), fallback)


def residual_probs(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    augmented_probs: torch.Tensor,
    residual: Residual = "exact",
) -> torch.Tensor:
    """The distribution to resample from after a rejection ([k, V] -> [k, V]).

    ``exact``: norm(max(0, p^ - q)). ``paper``: norm(max(0, p - p^, p - q)).
    A rejection has positive probability only when the residual mass is
    positive; rows where it vanishes fall back to p^ (exact) or p (paper).
    """
    if residual == "exact":
        return _normalize_or((augmented_probs - draft_probs).clamp_min(0.0), augmented_probs)
    if residual == "paper":
        mass = torch.maximum(target_probs - augmented_probs, target_probs - draft_probs).clamp_min(0.0)
        return _normalize_or(mass, target_probs)
    raise ValueError(f"unknown residual {residual!r}")


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` ([k, V] -> [k])."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def top_probability(logits: torch.Tensor) -> float:
    """The largest probability of softmax(logits) ([V] -> scalar): exp(max z - logsumexp z)."""
    logits = logits.float()
    return float(torch.exp(logits.max() - torch.logsumexp(logits, dim=-1)))


def greedy_accepted_length(draft_tokens: torch.Tensor, target_choices: torch.Tensor) -> int:
    """Longest prefix where the drafted token equals the target's choice.

    ``draft_tokens``: [k]; ``target_choices``: [k + 1] (the last one is the
    bonus choice and is never compared).
    Example: drafts [5, 7, 9], choices [5, 7, 2, 4] -> 2 (emit 5, 7, then 2).
    """
    k = draft_tokens.shape[0]
    return accepted_prefix_length(draft_tokens == target_choices[:k])


def greedy_target_choices(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor | None,
    eta: float,
    alpha: float,
) -> torch.Tensor:
    """argmax(z + eta * g) per row, with p and q at temperature 1 ([k, V] -> [k]).

    ``draft_logits`` ([rows, V], rows <= k) may cover only the first rows
    (e.g. no drafter distribution after an EOS draft); the other rows, and all
    rows when ``eta = 0`` or ``draft_logits`` is None, take argmax z.
    """
    choices = target_logits.argmax(dim=-1)  # [k]
    if eta == 0.0 or draft_logits is None:
        return choices
    rows = draft_logits.shape[0]
    target_probs = target_logits[:rows].float().softmax(dim=-1)  # [rows, V]
    draft_probs = draft_logits.float().softmax(dim=-1)  # [rows, V]
    shifted = augmented_logits(target_logits[:rows].float(), target_probs, draft_probs, eta, alpha)
    choices[:rows] = shifted.argmax(dim=-1)
    return choices


def output_distribution_paper(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, augmented_probs: torch.Tensor
) -> torch.Tensor:
    """Closed form of the per-position output of the ``paper`` residual.

    P(x) = m(x) + (1 - beta) * r(x),  m = min(q, p^), beta = sum m,
    r = norm(max(0, p - p^, p - q)). Used by tests and analysis.
    """
    m = torch.minimum(draft_probs, augmented_probs)  # [k, V]
    beta = m.sum(dim=-1, keepdim=True)  # [k, 1]
    return m + (1.0 - beta) * residual_probs(target_probs, draft_probs, augmented_probs, "paper")


@dataclass(frozen=True)
class SamplingParams:
    """How one verification turns logits into tokens: the knobs of section 1 (see the module docstring).

    ``eta``: the shift toward the drafter (0 = plain speculative decoding);
    ``alpha``: the draft gate; ``temperature`` (0 = greedy), ``top_k``,
    ``top_p``: the filters, applied after the temperature; ``residual``:
    what a rejection resamples from.
    """

    eta: float = 0.0
    alpha: float = 0.1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    residual: Residual = "exact"

    @classmethod
    def of(cls, config) -> "SamplingParams":
        """The knobs of a :class:`~rapidspec.config.DecodeConfig` (its effective eta)."""
        return cls(config.eta_value, config.draft_gate, config.temperature, config.top_k, config.top_p,
                   config.residual)


def augmented_rows(target_logits: torch.Tensor, draft_rows: torch.Tensor | None, params: SamplingParams) -> torch.Tensor:
    """The logits of the distribution each position's token follows: p^ where a drafter row exists, else p.

    ``target_logits``: [n, V]; ``draft_rows``: [r, V] (r <= n) as :func:`verify`
    takes them (raw drafter logits when greedy, q when sampling) or None.
    Greedy: z + eta * g with p and q at temperature 1; sampling: the filtered
    z / T + eta * g. Returns [n, V]. The one place p^ is formed for
    log-probabilities and the bonus token.
    """
    if params.temperature == 0.0:
        scaled = target_logits.float()  # [n, V]
        draft_probs = None if draft_rows is None else draft_rows.float().softmax(-1)  # [r, V]
    else:
        scaled = filter_logits(target_logits.float() / params.temperature, params.top_k, params.top_p)  # [n, V]
        draft_probs = None if draft_rows is None else draft_rows.float()  # [r, V]
    if params.eta == 0.0 or draft_probs is None or draft_probs.shape[0] == 0:
        return scaled
    rows = min(draft_probs.shape[0], scaled.shape[0])
    out = scaled.clone()
    out[:rows] = augmented_logits(scaled[:rows], scaled[:rows].softmax(-1), draft_probs[:rows], params.eta, params.alpha)
    return out


@dataclass(frozen=True)
class Verdict:
    """What verification decided: ``accepted`` leading drafts are kept, then ``next_token`` is emitted.

    ``next_token`` is the *recovered* token when ``accepted < k`` and the
    *bonus* token when ``accepted == k``. It is None when every draft was
    accepted with eta > 0: p^ at position k + 1 needs the drafter's row there,
    so the caller asks the drafter for it and calls :func:`bonus_token`.
    """

    accepted: int
    next_token: int | None


def verify(
    target_logits: torch.Tensor,
    drafts: list[int],
    draft_rows: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Verify k drafted tokens against the target's logits: the step 4 of every round.

    ``target_logits``: [k + 1, V], row i predicts the token after draft i
    (row 0: after the committed tokens). ``drafts``: the k drafted tokens
    (k = 0 is a plain decoding step). ``draft_rows``: [r, V] on the same
    device, the drafter's rows at the drafted positions: when sampling, q
    (the filtered drafter logits at the temperature, normalised; r = k); when
    greedy, the raw drafter logits, needed only when eta > 0 (r <= k; rows
    past r take the plain target choice), else None.

    Definitions (the engine emits ``drafts[:accepted] + [next_token]``):

    * **accepted**: the longest prefix of drafts the target keeps. Greedy:
      draft i equals argmax(z_i + eta * g_i) (p, q at temperature 1).
      Sampling: draft i is kept with probability min(1, p^_i(x_i) / q_i(x_i)).
    * **recovered** token (accepted < k): greedy, the target's choice at the
      first mismatch; sampling, a draw from the residual
      (:func:`residual_probs`) at the first rejection.
    * **bonus** token (accepted = k): the target's choice (greedy) or a draw
      from p at position k + 1 when eta = 0; with eta > 0 it needs the
      drafter's row there, so ``next_token`` is None and :func:`bonus_token`
      decides it.

    With eta = 0 every emitted token follows p (greedy: equals plain decoding).
    Example (greedy, eta = 0): drafts [5, 7, 9], argmax rows [5, 7, 2, 4] ->
    accepted 2, recovered token 2.
    """
    assert target_logits.dim() == 2 and target_logits.shape[0] == len(drafts) + 1, "target_logits must be [k+1, V]"
    k = len(drafts)
    device = target_logits.device
    draft_tensor = torch.tensor(drafts, dtype=torch.long, device=device)  # [k]
    if params.temperature == 0.0:
        choices = greedy_target_choices(target_logits, draft_rows, params.eta, params.alpha)  # [k+1]
        accepted = greedy_accepted_length(draft_tensor, choices)
        if accepted == k and params.eta > 0:
            return Verdict(accepted, None)
        return Verdict(accepted, int(choices[accepted]))

    scaled = filter_logits(target_logits / params.temperature, params.top_k, params.top_p)  # [k+1, V] temperature first
    target_probs = scaled.softmax(-1)  # [k+1, V]
    augmented_probs = target_probs.clone()  # [k+1, V]
    if params.eta > 0 and draft_rows is not None and k > 0:
        augmented_probs[:k] = augmented_logits(scaled[:k], target_probs[:k], draft_rows, params.eta, params.alpha).softmax(-1)
    if k > 0:
        uniforms = torch.rand(k, generator=generator, device=device)  # [k]
        accepted = accepted_prefix_length(acceptance_mask(draft_tensor, draft_rows, augmented_probs, uniforms))
    else:
        accepted = 0
    at = slice(accepted, accepted + 1)
    if accepted < k:
        recovery = residual_probs(target_probs[at], draft_rows[at], augmented_probs[at], params.residual)  # [1, V]
        return Verdict(accepted, int(sample(recovery, generator)[0]))
    if params.eta > 0:
        return Verdict(accepted, None)
    return Verdict(accepted, int(sample(augmented_probs[at], generator)[0]))


def bonus_token(target_logits: torch.Tensor, position: int, row: torch.Tensor | None, params: SamplingParams,
                generator: torch.Generator | None = None) -> int:
    """The bonus token at ``position`` (= k, every draft accepted) from p^ with the drafter's ``row`` there.

    ``target_logits``: [k + 1, V]; ``row``: [V] of the kind :func:`verify`
    takes, or None (no drafter row: after a stopping draft), which leaves p.
    Greedy: argmax(z + eta * g); sampling: a draw from p^.
    """
    at = target_logits[position : position + 1]  # [1, V]
    logits = augmented_rows(at, None if row is None else row[None], params)  # [1, V]
    if params.temperature == 0.0:
        return int(logits.argmax(-1)[0])
    return int(sample(logits.softmax(-1), generator)[0])
