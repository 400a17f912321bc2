"""What ``rapidspec eval`` runs per item: each mode once, or once per sweep value where the swept knob applies.

A sweep (``--sweep eta=0,2,5``) multiplies only the modes that use the knob:

| knob | modes it applies to |
|---|---|
| ``eta``, ``draft_gate`` | ``rapid`` |
| ``gamma``, ``draft_confidence`` | the drafting modes (sd, ragsd, rapid, magicdec, lookup) |
| ``budget_tokens`` | the retrieving modes (rag, ragsd, rapid, lookup) |
| ``streaming_tokens`` | ``magicdec`` |

so ``--modes lc,rag,rapid --sweep eta=0,2,5`` runs lc and rag once and rapid
three times per item, and every record says which sweep point it belongs to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rapidspec.config import DEFAULT_RAPID_ETA
from rapidspec.drafting import USES_DRAFTER, USES_RETRIEVAL
from rapidspec.evaluation.bench_inputs import SWEEP_PARAMS, Sweep, parse_sweep

#: Knobs ``eval --sweep`` takes (name -> value type).
EVAL_SWEEP_PARAMS = {**SWEEP_PARAMS, "draft_gate": float, "budget_tokens": int, "streaming_tokens": int}
#: The modes each knob applies to.
SWEEP_APPLIES_TO = {
    "eta": frozenset({"rapid"}),
    "draft_gate": frozenset({"rapid"}),
    "gamma": frozenset(USES_DRAFTER),
    "draft_confidence": frozenset(USES_DRAFTER),
    "budget_tokens": frozenset(USES_RETRIEVAL),
    "streaming_tokens": frozenset({"magicdec"}),
}


def parse_eval_sweep(text: str) -> Sweep:
    """``"budget_tokens=256,512"`` -> a :class:`Sweep` over one of :data:`EVAL_SWEEP_PARAMS`."""
    return parse_sweep(text, EVAL_SWEEP_PARAMS)


@dataclass(frozen=True)
class EvalVariant:
    """One run per item: a mode with its effective eta and gamma, and a sweep point (or none)."""

    mode: str
    eta: float  # effective: 0 outside rapid
    gamma: int | None  # None for modes that do not draft
    sweep: str | None = None  # "eta=5", "budget_tokens=512", ... or None
    decode_options: dict = field(default_factory=dict)  # DecodeConfig fields this point changes
    budget_tokens: int | None = None  # the retrieval budget this point uses (None: the run's own)


def mode_eta_gamma(mode: str, eta: float | None, gamma: int) -> tuple[float, int | None]:
    """The (eta, gamma) a mode actually runs with, as recorded in keys."""
    effective_eta = (DEFAULT_RAPID_ETA if eta is None else float(eta)) if mode == "rapid" else 0.0
    return effective_eta, (gamma if mode in USES_DRAFTER else None)


def eval_variants(modes: Sequence[str], eta: float | None, gamma: int, sweep: Sweep | None = None) -> list[EvalVariant]:
    """The runs of one item, mode by mode (each mode's sweep points together)."""
    out = []
    for mode in modes:
        base_eta, base_gamma = mode_eta_gamma(mode, eta, gamma)
        if sweep is None or mode not in SWEEP_APPLIES_TO[sweep.param]:
            out.append(EvalVariant(mode, base_eta, base_gamma))
            continue
        for value in sweep.values:
            label = f"{sweep.param}={value:g}"
            if sweep.param == "eta":
                out.append(EvalVariant(mode, float(value), base_gamma, label))
            elif sweep.param == "gamma":
                out.append(EvalVariant(mode, base_eta, int(value), label))
            elif sweep.param == "budget_tokens":
                out.append(EvalVariant(mode, base_eta, base_gamma, label, budget_tokens=int(value)))
            else:
                out.append(EvalVariant(mode, base_eta, base_gamma, label, {sweep.param: value}))
    return out
