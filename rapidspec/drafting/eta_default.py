"""The default eta, decided by how the drafter relates to the target.

RAPID's shift toward the drafter (eta) helps when the drafter reading the
retrieved text knows better than the target reading everything, and hurts
when a weaker model hands over its own answer. So the default depends on the
drafter (docs/quality.md, "The defaults and their evidence"):

    relation   drafter                                     default eta
    self       the target's own weights (or a low-bit copy)  DEFAULT_ETA["self"]
    larger     another model at least 90% of the target's size  DEFAULT_ETA["larger"]
    smaller    another model below that                     DEFAULT_ETA["smaller"]

A given eta is always used as given (:func:`rapidspec.engine.resolve` applies the default); with a smaller drafter an eta above its
default is warned about once per value.
"""

from __future__ import annotations

import logging
from typing import Literal

logger = logging.getLogger(__name__)

Relation = Literal["self", "larger", "smaller"]
#: Chosen by the decision rule in docs/quality.md ("The defaults and their evidence"): self-speculation on all
#: 239 L-Eval multiple-choice questions (eta = 1 +0.038 over lc, eta = 2 +0.050, paired intervals above 0) and
#: on multi-value needles at 8K, where eta = 2 lost to lc (-0.325, interval below 0) and eta = 1 did not, so
#: eta = 1; a 0.5B drafter for the 1.5B on all 112 QuALITY questions (eta = 1 lost nothing and scored
#: highest; eta = 2 carries the needle risk of an incomplete view); upward speculation, the 1.5B drafting for
#: the 0.5B on those 112 questions (eta = 10 scored highest, +0.214 over lc, paired interval above 0).
DEFAULT_ETA: dict[str, float] = {"self": 1.0, "larger": 10.0, "smaller": 1.0}
#: A drafter with fewer parameters than this share of the target's counts as smaller.
SMALLER_BELOW = 0.9


def relation(target_parameters: int, drafter_parameters: int | None) -> Relation:
    """``self`` when there is no other drafter (None), else ``larger`` or ``smaller`` by parameter count."""
    if drafter_parameters is None:
        return "self"
    return "smaller" if drafter_parameters < SMALLER_BELOW * target_parameters else "larger"


def default_reason(kind: Relation) -> str:
    """Why the default is what it is, for outputs: ``default for self-speculation``."""
    return {"self": "default for self-speculation", "larger": "default for a drafter at least as large as the target",
            "smaller": "default for a drafter smaller than the target"}[kind]


def parameter_count(model) -> int:
    """Weights of a model: a GGUF file's tensor elements (a name or a model read from one), else torch's tensors."""
    from rapidspec.models.backend import gguf_file

    path = gguf_file(model)
    if path is not None:
        from gguf import GGUFReader

        return int(sum(int(tensor.n_elements) for tensor in GGUFReader(str(path)).tensors))
    module = model.model
    return int(sum(t.numel() for t in (*module.parameters(), *module.buffers()) if t.dim() >= 2))


def drafter_relation(target, drafter) -> Relation:
    """How ``drafter`` (None, a loaded model or a model name) relates to ``target`` (a loaded model)."""
    name = drafter if isinstance(drafter, str) or drafter is None else getattr(drafter, "name", None)
    if drafter is None or drafter is target or name in ("self", getattr(target, "name", None)):
        return "self"
    return relation(parameter_count(target), parameter_count(drafter))


class EtaWarnings:
    """Warns once per eta value that is above the default of a smaller drafter."""

    def __init__(self) -> None:
        self._warned: set[float] = set()

    def check(self, kind: Relation, eta: float) -> None:
        if kind == "smaller" and eta > DEFAULT_ETA["smaller"] and eta not in self._warned:
            self._warned.add(eta)
            logger.warning("eta=%g with a drafter smaller than the target: above %g, rapid's answers followed the "
                           "weaker drafter in our studies (docs/quality.md)", eta, DEFAULT_ETA["smaller"])
