"""The server's front door, before any route runs: the API key and the body size.

A pure ASGI middleware (it never buffers a response, so streaming is
untouched). With an API key, every path but ``/health`` and the page (``/``, its static files) needs
``Authorization: Bearer KEY`` (401 otherwise; CORS preflights pass, the CORS
middleware outside this one answers them). A request body is read up to
``max_request_bytes`` and refused with 413 beyond it, whether or not the
client sent a Content-Length, then handed to the app whole; a body that stops
arriving for ``read_timeout_s`` gets 408 and the connection is closed. The
refusals use OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable

#: Paths open without the API key: health probes and the page's static files (the page asks for the key).
OPEN_PATHS = frozenset({"/health", "/", "/static/index.html", "/static/app.js", "/static/style.css"})


class RequestGuard:
    def __init__(self, app, *, api_key: str | None, max_request_bytes: int, read_timeout_s: float,
                 refused: Callable[[str], None]) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self.read_timeout_s = read_timeout_s
        self.refused = refused  # called with the reason ("unauthorized", "too_large", "timeout")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(key.strip(), self.api_key):
                self.refused("unauthorized")
                await _refuse(send, 401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'",
                              "invalid_api_key", [(b"www-authenticate", b"Bearer")])
                return
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            await self._too_large(send)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = bytearray()
            while True:
                try:
                    message = await asyncio.wait_for(receive(), self.read_timeout_s)
                except asyncio.TimeoutError:
                    self.refused("timeout")
                    await _refuse(send, 408, f"the request body stopped arriving for {self.read_timeout_s:g} s",
                                  "request_timeout", [(b"connection", b"close")])
                    return
                if message["type"] != "http.request":  # the client left while sending
                    return
                body += message.get("body", b"")
                if len(body) > self.max_request_bytes:
                    await self._too_large(send)
                    return
                if not message.get("more_body", False):
                    break
            receive = _replay(bytes(body), receive)
        await self.app(scope, receive, send)

    async def _too_large(self, send) -> None:
        self.refused("too_large")
        await _refuse(send, 413, f"the request body is larger than the server's limit of {self.max_request_bytes} "
                                 "bytes (rapidspec serve --max-request-bytes)", "request_too_large")


def _replay(body: bytes, receive):
    """A ``receive`` that gives the app the whole body once, then the client's own messages (disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refuse(send, status: int, message: str, code: str, headers: list | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body.encode()})
