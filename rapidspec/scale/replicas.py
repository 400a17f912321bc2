"""``rapidspec serve --replicas N``: N copies of the OpenAI app behind one endpoint, on Ray Serve.

Each replica is a Ray Serve deployment replica that loads the models once and
serves :func:`~rapidspec.server.app.create_app` as its FastAPI ingress (so
every route, limit and error is the single server's). Ray Serve's proxy
listens on ``--host``/``--port`` and picks the replica with our request router
(:mod:`rapidspec.scale.router`): requests carrying the same ``x-session-id``
header (a conversation id) go to the same replica, whose prefix cache holds
the conversation, and wait for it while its line is short; requests without
it get one in the proxy from their ``prompt_cache_key``, ``user`` or leading
messages (:mod:`rapidspec.scale.affinity`). Serve restarts a replica that
dies. ``/health`` and ``/metrics`` cover every replica
(:mod:`rapidspec.scale.fleet`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from rapidspec.errors import RapidspecError
from rapidspec.scale import SESSION_HEADER
from rapidspec.scale.connect import connect_ray
from rapidspec.scale.proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from rapidspec.scale.fleet import FLEET_ACTOR, FLEET_NAMESPACE, FleetBoard, FleetReporter

logger = logging.getLogger(__name__)

APP_NAME = "rapidspec"
ROUTER = "rapidspec.scale.router.AffinityRouter"
#: Ray Serve's own session router (no waiting: it falls back when the replica is busy); for comparisons.
CONSISTENT_HASH_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
DEFAULT_REPLICA_RESOURCES = {"num_cpus": 1}
#: Seconds between Serve's health checks of a replica (Serve's default: 10): a replica that died is replaced
#: that much sooner; a check is one call its event loop answers between two steps.
HEALTH_CHECK_EVERY_S = 2.0


class RapidspecReplica:
    """One replica: the engine of ``spec`` (an EngineSpec) behind the app of ``config`` (a ServerConfig)."""

    def __init__(self, spec, config) -> None:
        from ray import serve

        from rapidspec.engine import Rapid
        from rapidspec.runtime.threads import helper_thread

        helper_thread()  # the worker's engine thread computes (rapidspec.runtime.threads)
        self.engine = Rapid(spec)
        self.config = config
        self.replica = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self):
        import ray

        from rapidspec.server.app import create_app

        reporter = FleetReporter(ray.get_actor(FLEET_ACTOR, namespace=FLEET_NAMESPACE), self.replica)
        app = create_app(self.engine, self.config, fleet=reporter)
        app.state.server.warm_up_retrieval()
        reporter.start(app.state.health, app.state.metrics.render)
        return app


def deploy(spec, config, replicas: int, resources: dict | None = None,
           host: str = "127.0.0.1", port: int = 8000, router: str = ROUTER, router_options: dict | None = None):
    """Start Serve on ``host:port`` and deploy ``replicas`` replicas (Ray must be initialized).

    ``router``: the request router's import path; ours takes ``router_options`` (``max_line``, default
    :func:`~rapidspec.scale.router.default_max_line` of ``config``; ``max_wait_s``).
    Returns the handle of the replicas' :class:`FleetBoard` once they run: keep it while they serve
    (the board is gone with its last handle).
    """
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    if replicas < 1:
        raise RapidspecError(f"--replicas must be >= 1, got {replicas}")
    resources = dict(DEFAULT_REPLICA_RESOURCES if resources is None else resources)
    options = dict(router_options or {})
    if router == ROUTER:
        from rapidspec.scale.router import default_max_line

        options.setdefault("max_line", default_max_line(config.max_num_seqs, config.max_queue))
    board = ray.remote(num_cpus=0)(FleetBoard).options(name=FLEET_ACTOR, namespace=FLEET_NAMESPACE,
                                                       get_if_exists=True).remote()
    serve.start(http_options={"host": host, "port": port})
    deployment = serve.deployment(
        serve.ingress()(RapidspecReplica), name=APP_NAME, num_replicas=replicas, ray_actor_options=resources,
        # the app keeps its own queue (429 beyond it); /health and /metrics need room too
        max_ongoing_requests=config.max_num_seqs + config.max_queue + 8,
        health_check_period_s=HEALTH_CHECK_EVERY_S,
        request_router_config=RequestRouterConfig(request_router_class=router, request_router_kwargs=options),
    )
    try:
        serve.run(deployment.bind(spec, config), name=APP_NAME, route_prefix="/", blocking=False)
    except (ValueError, TypeError) as err:
        raise RapidspecError(f"cannot deploy the replicas: {err}") from None
    return board


def serve_replicas(spec, config, replicas: int, address: str | None,
                   resources: dict | None, host: str, port: int) -> int:
    """``rapidspec serve --replicas N``: deploy the engines of ``spec`` (an EngineSpec), then serve until SIGTERM or Ctrl-C."""
    if port == 0:
        raise RapidspecError("--replicas needs a --port (Ray Serve's proxy does not pick a free one)")
    if address is None:  # the local instance's proxy answers its own errors with OpenAI's body
        os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    ray = connect_ray(address, "--replicas")
    from ray import serve
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        board = deploy(spec, config, replicas, resources, host, port)  # noqa: F841  (held while serving)
        logger.info("serving %d replica(s) on http://%s:%d (a conversation stays on one replica: by its %s "
                    "header, else its prompt_cache_key, user or leading messages)", replicas, host, port, SESSION_HEADER)
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        serve.shutdown()
        ray.shutdown()
    return 0
