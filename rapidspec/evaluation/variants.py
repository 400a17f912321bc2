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

from rapidspec.config import DecodeConfig
from rapidspec.drafting import MODE_TABLE, USES_DRAFTER, USES_RETRIEVAL
from rapidspec.evaluation.bench_inputs import SWEEP_PARAMS, Sweep, Variant, parse_sweep

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


def eval_variants(modes: Sequence[str], base: DecodeConfig, sweep: Sweep | None = None) -> list[Variant]:
    """The runs of one item, mode by mode (each mode's sweep points together), from the run's ``base`` settings.

    ``base.eta`` applies to ``rapid`` only; the other modes run with eta = 0.
    """
    out = []
    for mode in modes:
        config = base.with_(mode=mode, eta=base.eta if MODE_TABLE[mode].eta else None)
        if sweep is None or mode not in SWEEP_APPLIES_TO[sweep.param]:
            out.append(Variant(mode, mode, config))
            continue
        for value in sweep.values:
            label = f"{sweep.param}={value:g}"
            if sweep.param == "budget_tokens":
                point = Variant(f"{mode} {label}", mode, config, value, label, budget_tokens=int(value))
            elif sweep.param == "gamma":
                point = Variant(f"{mode} {label}", mode, config.with_(gamma=int(value), max_gamma=max(config.max_gamma, int(value))),
                                value, label)
            else:
                point = Variant(f"{mode} {label}", mode, config.with_(**{sweep.param: value}), value, label)
            out.append(point)
    return out
