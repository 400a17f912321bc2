"""The one step that decides what a request leaves to the engine: the eta default and the gamma schedule.

A :class:`~rapidspec.config.DecodeConfig` may leave ``eta`` unset (rapid then
uses the default of the drafter's relation to the target,
:mod:`rapidspec.drafting.eta_default`) and ``gamma_schedule="auto"`` (the
cost schedule). Everything that runs or reports a generation asks this step:
the decode loop (and so every output's stats), the server's ``/health``,
bench rows and eval records, through :meth:`rapidspec.Rapid.resolve`, or
:func:`resolve` with the relation where no engine is at hand (the driver of
a Ray eval).
"""

from __future__ import annotations

from rapidspec.config import MODE_TABLE, DecodeConfig
from rapidspec.drafting.eta_default import DEFAULT_ETA, EtaWarnings, Relation, default_reason

#: The schedule ``gamma_schedule="auto"`` stands for.
AUTO_GAMMA_SCHEDULE = "cost"


def resolve(config: DecodeConfig, relation: Relation,
            warnings: EtaWarnings | None = None) -> tuple[DecodeConfig, str | None]:
    """(``config`` with a concrete eta and gamma schedule, where its eta came from).

    The source is ``given``, the default's reason (``default for self-speculation``...) or None outside
    ``rapid`` (eta 0). ``warnings`` hears of a given eta above the default of a smaller drafter.
    """
    if config.gamma_schedule == "auto":
        config = config.with_(gamma_schedule=AUTO_GAMMA_SCHEDULE)
    if not MODE_TABLE[config.mode].eta:
        return config, None
    if config.eta is None:
        return config.with_(eta=DEFAULT_ETA[relation]), default_reason(relation)
    if warnings is not None:
        warnings.check(relation, float(config.eta))
    return config, "given"
