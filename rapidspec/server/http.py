"""How the app meets the network: uvicorn, with the limits a server on an open port needs.

uvicorn's defaults leave a half-sent request open for ever and (with
httptools) buffer headers without bound. :func:`uvicorn_config` runs uvicorn
with h11 and these limits:

* a request's head (request line and headers) must be complete within
  ``read_timeout_s`` of the connection opening, or of the previous response
  on a kept-alive connection, else the connection is closed
  (:class:`TimedH11Protocol`); a body that stops arriving for
  ``read_timeout_s`` gets a 408 (:class:`~rapidspec.server.limits.RequestGuard`);
* a head larger than :data:`MAX_HEAD_BYTES` is a 400 (h11's incomplete-event limit);
* an idle kept-alive connection is closed after :data:`KEEP_ALIVE_S`;
* beyond :data:`MAX_CONNECTIONS` open connections, a new request gets 503.

What it cannot do (TLS, per-client rate limits, slow readers of a response)
belongs to a proxy in front (docs/serving.md, "Limits").

SIGTERM (or Ctrl-C) drains before uvicorn stops (:class:`DrainingServer`):
the server keeps listening, the requests it has taken (queued, running or
still sending) finish, and new generation requests get a 503 (code
``shutting_down``, a ``Retry-After`` header, ``Connection: close``) while
``/health`` answers 503 with status ``draining`` (:class:`DrainGate`); when
none is left, or after the drain's time limit (``--shutdown-timeout``; each
request is bounded by ``--request-time-limit`` too), uvicorn shuts down as
usual. A second signal shuts down at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

#: Seconds a client may take to send a request's head, or between two pieces of its body.
READ_TIMEOUT_S = 30.0
#: The largest request head (request line and headers) read.
MAX_HEAD_BYTES = 64 * 1024
#: Seconds an idle kept-alive connection stays open.
KEEP_ALIVE_S = 5
#: Open connections (and requests in flight) beyond which a new request gets 503.
MAX_CONNECTIONS = 1024
#: Seconds a client refused during a drain is told to wait before it tries again (another server, or this one
#: restarted, answers then).
RETRY_AFTER_S = 5
#: The routes a draining server refuses (the others, e.g. /metrics and /tokenize, answer to the end).
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
#: The answer to a generation request during a drain (503), in OpenAI's error body.
REFUSED = {"error": {"message": "the server is shutting down and takes no new requests; retry in a moment (another "
                                "server, or this one restarted)",
                     "type": "server_error", "param": None, "code": "shutting_down"}}


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head does not arrive in ``read_timeout_s``."""

    read_timeout_s = READ_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()  # the next request on this connection gets as long

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.read_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # no complete head yet
            self.transport.close()


def uvicorn_config(app, host: str, port: int, *, read_timeout_s: float = READ_TIMEOUT_S, **options) -> uvicorn.Config:
    """uvicorn's settings for ``app`` with the limits above (``options``: more uvicorn settings)."""
    protocol = TimedH11Protocol
    if read_timeout_s != TimedH11Protocol.read_timeout_s:
        protocol = type("TimedH11Protocol", (TimedH11Protocol,), {"read_timeout_s": read_timeout_s})
    return uvicorn.Config(app, host=host, port=port, http=protocol, h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                          timeout_keep_alive=KEEP_ALIVE_S, limit_concurrency=MAX_CONNECTIONS, **options)


class Drain:
    """A server's drain: whether it has begun (on SIGTERM), and the generation requests still being answered."""

    def __init__(self) -> None:
        self.started_at: float | None = None
        self.in_flight = 0

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def start(self) -> None:
        if self.started_at is None:
            self.started_at = time.monotonic()


class DrainGate:
    """Pure ASGI middleware: counts the generation requests in flight; while draining, refuses new ones (503).

    ``health()``: the ``/health`` body, answered with 503 while draining; ``refused(reason)`` counts a refusal.
    """

    def __init__(self, app, *, drain: Drain, health: Callable[[], dict], refused: Callable[[str], None]) -> None:
        self.app, self.drain, self.health, self.refused = app, drain, health, refused

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "").rstrip("/") if scope["type"] == "http" else ""
        if path in GENERATION_PATHS and scope["method"] == "POST":
            if self.drain.draining:
                self.refused("shutting_down")
                await _send_json(send, 503, REFUSED, [(b"retry-after", str(RETRY_AFTER_S).encode()),
                                                      (b"connection", b"close")])
                return
            self.drain.in_flight += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.drain.in_flight -= 1
            return
        if path == "/health" and self.drain.draining:
            await _send_json(send, 503, self.health(), body=scope["method"] != "HEAD")
            return
        await self.app(scope, receive, send)


async def _send_json(send, status: int, payload: dict, headers: list | None = None, body: bool = True) -> None:
    content = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": content if body else b""})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM or Ctrl-C (module docstring) for up to ``timeout_s``."""

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float) -> None:
        super().__init__(config)
        self.drain, self.timeout_s = drain, timeout_s

    def handle_exit(self, sig, frame) -> None:
        first = not self.drain.draining and not self.should_exit
        super().handle_exit(sig, frame)  # uvicorn notes the signal (raised again once it has shut down)
        if first:
            self.should_exit = False  # not yet: the drain ends it (on_tick)
            self.drain.start()
            logger.info("draining: new requests get 503; waiting up to %g s for %d running", self.timeout_s,
                        self.drain.in_flight)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if not self.drain.draining:
            return False
        left = self.timeout_s - (time.monotonic() - self.drain.started_at)
        if self.drain.in_flight and left > 0:
            return False
        if self.drain.in_flight:
            logger.warning("drained for %g s: cancelling the %d request(s) still running", self.timeout_s,
                           self.drain.in_flight)
        # uvicorn's own graceful shutdown gets what is left of the time (at least a second for the last bytes)
        self.config.timeout_graceful_shutdown = max(1.0, left)
        return True
