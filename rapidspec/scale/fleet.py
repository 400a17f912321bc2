"""The board the replicas of ``rapidspec serve --replicas N`` report to, for ``/health`` and ``/metrics``.

A Ray Serve proxy sends each request to one replica, so a replica's own
counters cover only its requests. Every replica reports its health and its
Prometheus text once a second to one named actor, :class:`FleetBoard`; any
replica answering ``/health`` or ``/metrics`` reads the board and answers for
all of them (each series gains a ``replica`` label; a replica that has not
reported for :data:`STALE_AFTER_S` seconds, e.g. one that died, is left out).
The proxy's request router (:mod:`.router`) counts on the board the requests
it sent away from their home replica; the board hands those counters on with
the replicas' reports, as an entry without health (:data:`ROUTER`). The app
merges the reports with :mod:`rapidspec.server.fleet`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

FLEET_ACTOR = "rapidspec-fleet"
FLEET_NAMESPACE = "rapidspec"
REPORT_EVERY_S = 1.0
STALE_AFTER_S = 5.0
#: The key of the proxy router's counters among the reports (its health is empty: it is not a replica).
ROUTER = "proxy-router"


class FleetBoard:
    """A Ray actor: the latest report of each replica (its health and its metrics text)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter

        self._reports: dict[str, tuple[float, dict, bytes]] = {}
        self._router = CollectorRegistry()
        self._overflow = Counter("rapidspec:affinity_overflow",
                                 "Requests sent away from the replica holding their session (rapidspec.scale.router), "
                                 "by reason: line (its line was at the bound), wait (it did not take them in time).",
                                 labelnames=["reason"], registry=self._router)
        for reason in ("line", "wait"):
            self._overflow.labels(reason)

    def report(self, replica: str, health: dict, metrics: bytes) -> None:
        self._reports[replica] = (time.monotonic(), health, metrics)

    def count_overflow(self, reason: str) -> None:
        """The proxy's router sent a request away from its home replica (``reason``: line or wait)."""
        self._overflow.labels(reason).inc()

    def reports(self) -> dict[str, tuple[dict, bytes]]:
        """Each replica's latest (health, metrics text), and the router's counters as ``ROUTER: ({}, text)``."""
        from prometheus_client import generate_latest

        now = time.monotonic()
        self._reports = {k: v for k, v in self._reports.items() if now - v[0] <= STALE_AFTER_S}
        fresh = {replica: (health, metrics) for replica, (_, health, metrics) in sorted(self._reports.items())}
        return fresh | {ROUTER: ({}, generate_latest(self._router))}


class FleetReporter:
    """In a replica: reports to the board every second and reads every replica's reports back."""

    def __init__(self, board, replica: str) -> None:
        self.board, self.replica = board, replica
        self._stop = threading.Event()

    def start(self, health: Callable[[], dict], metrics: Callable[[], bytes]) -> None:
        def run() -> None:
            while not self._stop.is_set():
                try:
                    self.board.report.remote(self.replica, health(), metrics())
                except Exception as err:  # the board is gone (the deployment is shutting down)
                    logger.debug("fleet report failed: %r", err)
                self._stop.wait(REPORT_EVERY_S)

        threading.Thread(target=run, name="rapidspec-fleet-report", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    async def reports(self) -> dict[str, tuple[dict, bytes]]:
        return await self.board.reports.remote()
