"""The run matrix of ``rapidspec eval`` and ``rapidspec bench``: each mode once, or once per sweep value.

A :class:`Variant` is one run per input: a mode, its decode settings and its
sweep point (a column of ``bench``, a record key of ``eval``).
:func:`run_matrix` builds them; a sweep (``--sweep eta=0,2,5``) multiplies
only the modes that use the knob:

| knob | modes it applies to |
|---|---|
| ``eta``, ``draft_gate`` | ``rapid`` |
| ``gamma``, ``draft_confidence`` | the drafting modes (sd, ragsd, rapid, magicdec, lookup) |
| ``budget_tokens`` | the retrieving modes (rag, ragsd, rapid, lookup) |
| ``streaming_tokens`` | ``magicdec`` |

so ``--modes lc,rag,rapid --sweep eta=0,2,5`` runs lc and rag once and rapid
three times per item, and every record says which sweep point it belongs to.
``bench`` sweeps ``lc`` and ``rapid`` only, and adds its peers (run outside the
engine, no :class:`DecodeConfig`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rapidspec.config import USES_DRAFTER, USES_RETRIEVAL, DecodeConfig
from rapidspec.errors import RapidspecError

#: Knobs ``eval --sweep`` takes (name -> value type).
EVAL_SWEEP_PARAMS = {"eta": float, "gamma": int, "draft_confidence": float, "draft_gate": float, "budget_tokens": int,
                     "streaming_tokens": int}
#: The modes each knob applies to.
SWEEP_APPLIES_TO = {
    "eta": frozenset({"rapid"}),
    "draft_gate": frozenset({"rapid"}),
    "gamma": frozenset(USES_DRAFTER),
    "draft_confidence": frozenset(USES_DRAFTER),
    "budget_tokens": frozenset(USES_RETRIEVAL),
    "streaming_tokens": frozenset({"magicdec"}),
}


@dataclass(frozen=True)
class Sweep:
    """``--sweep eta=0,1,2``: run ``rapid`` once per value of ``param``."""

    param: str
    values: tuple[float | int, ...]


@dataclass(frozen=True)
class Variant:
    """One run per input, in ``bench`` (a column) and ``eval`` (a record key): a mode, its decode settings, its sweep point.

    ``config`` is None for the peers run outside the engine (hf-assisted,
    llama.cpp); ``sweep`` names the sweep point in eval records
    (``"eta=5"``); ``budget_tokens`` is the retrieval budget the point uses
    (None: the run's own).
    """

    label: str
    mode: str
    config: DecodeConfig | None = None
    sweep_value: float | int | None = None
    sweep: str | None = None
    budget_tokens: int | None = None

    @property
    def eta(self) -> float:
        """The eta the run uses (0 outside rapid), as recorded in keys."""
        return self.config.eta_value if self.config is not None else 0.0

    @property
    def gamma(self) -> int | None:
        """The gamma the run drafts with, None for modes that do not draft."""
        return self.config.gamma if self.config is not None and self.mode in USES_DRAFTER else None


def parse_modes(text: str | Sequence[str], allowed: Sequence[str], lc_first: bool = True) -> tuple[str, ...]:
    """``"lc,sd,rapid"`` -> ("lc", "sd", "rapid"), repeats dropped, each in ``allowed``.

    ``lc_first`` puts ``lc`` first, adding it when missing (``bench``: speedups
    need it); ``eval`` keeps the order given.
    """
    names = [m.strip() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    if not names:
        raise RapidspecError("no modes given")
    for name in names:
        if name not in allowed:
            raise RapidspecError(f"unknown mode {name!r}; choose from {', '.join(allowed)}")
    ordered = list(dict.fromkeys(names))
    if lc_first:
        ordered = ["lc"] + [m for m in ordered if m != "lc"]
    return tuple(ordered)


def parse_sweep(text: str, params: dict[str, type] = EVAL_SWEEP_PARAMS) -> Sweep:
    """``"eta=0,1,2"`` -> Sweep("eta", (0.0, 1.0, 2.0)) for a name of ``params`` (name -> value type);
    integer values (``gamma``, token counts) are >= 1."""
    name, sep, values = text.partition("=")
    name = name.strip()
    if not sep or name not in params:
        raise RapidspecError(f"sweep must look like NAME=v1,v2,... with NAME one of {', '.join(params)}; got {text!r}")
    kind = params[name]
    try:
        parsed = tuple(kind(v) for v in values.split(",") if v.strip())
    except ValueError:
        raise RapidspecError(f"sweep values of {name} must be {kind.__name__}s, got {values!r}") from None
    if not parsed:
        raise RapidspecError(f"sweep {name} has no values")
    if name == "eta" and any(not math.isfinite(v) or v < 0 for v in parsed):
        raise RapidspecError(f"eta values must be finite and >= 0, got {values!r}")
    if name == "draft_gate" and any(not 0 <= v <= 1 for v in parsed):
        raise RapidspecError(f"draft_gate values must be in [0, 1], got {values!r}")
    if name == "draft_confidence" and any(not 0 <= v < 1 for v in parsed):
        raise RapidspecError(f"draft_confidence values must be in [0, 1), got {values!r}")
    if kind is int and any(v < 1 for v in parsed):
        raise RapidspecError(f"{name} values must be >= 1, got {values!r}")
    return Sweep(name, parsed)


def parse_eval_sweep(text: str) -> Sweep:
    """``"budget_tokens=256,512"`` -> a :class:`Sweep` over one of :data:`EVAL_SWEEP_PARAMS`."""
    return parse_sweep(text, EVAL_SWEEP_PARAMS)


def run_matrix(modes: Sequence[str], base: DecodeConfig, sweep: Sweep | None = None,
               peer_modes: Sequence[str] = ()) -> list[Variant]:
    """The runs of one input, mode by mode (each mode's sweep points together), from the run's ``base`` settings.

    ``base.eta`` applies to ``rapid`` only; the other modes run with eta = 0. ``peer_modes`` run
    outside the engine (a :class:`Variant` without a config).
    """
    out = []
    for mode in modes:
        if mode in peer_modes:
            out.append(Variant(mode, mode))
            continue
        config = base.with_mode(mode)
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
