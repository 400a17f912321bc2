"""OpenAI-compatible HTTP server over one :class:`rapidspec.Rapid` engine (``rapidspec serve``).

:func:`create_app` builds the FastAPI app; :mod:`.schemas` maps request
fields onto the configs, :mod:`.worker` is the bounded FIFO queue in front
of the engine, :mod:`.metrics` the Prometheus metrics, :mod:`.responses` the
OpenAI bodies. Needs the ``serve`` extra (FastAPI, uvicorn, prometheus_client).
"""

from rapidspec.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
