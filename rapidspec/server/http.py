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
"""

from __future__ import annotations

import asyncio

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

#: Seconds a client may take to send a request's head, or between two pieces of its body.
READ_TIMEOUT_S = 30.0
#: The largest request head (request line and headers) read.
MAX_HEAD_BYTES = 64 * 1024
#: Seconds an idle kept-alive connection stays open.
KEEP_ALIVE_S = 5
#: Open connections (and requests in flight) beyond which a new request gets 503.
MAX_CONNECTIONS = 1024


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
