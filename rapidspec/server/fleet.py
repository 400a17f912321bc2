"""One ``/health`` body and one Prometheus text for several replicas, from their reports.

A replica of ``rapidspec serve --replicas N`` answers ``/health`` and
``/metrics`` for all of them: :class:`rapidspec.scale.fleet.FleetReporter`
hands the app every replica's latest (health, metrics text); these functions
merge them (each series gains a ``replica`` label). An entry with an empty
health is not a replica but counters of the fleet itself (those of the
proxy's request router, :mod:`rapidspec.scale.router`): its series keep their
labels and it is not listed in ``/health``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


def fleet_health(reports: dict[str, tuple[dict, bytes]]) -> dict:
    """One ``/health`` body for all replicas: their running and waiting requests summed, and each one's own."""
    replicas = [{"replica": replica, **health} for replica, (health, _) in reports.items() if health]
    return {"status": "ok" if replicas else "starting", "replicas": replicas,
            "running": sum(h.get("running", 0) for h in replicas), "waiting": sum(h.get("waiting", 0) for h in replicas)}


def merged_metrics(reports: dict[str, tuple[dict, bytes]]) -> bytes:
    """The replicas' Prometheus texts as one, each sample labelled with its ``replica`` (the fleet's own, unlabelled)."""
    families: dict[str, Metric] = {}
    for replica, (health, text) in reports.items():
        for family in text_string_to_metric_families(text.decode("utf-8")):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                labels = {**sample.labels, "replica": replica} if health else sample.labels
                merged.add_sample(sample.name, labels, sample.value, sample.timestamp)
    registry = CollectorRegistry()
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)
