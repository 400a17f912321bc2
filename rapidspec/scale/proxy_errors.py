"""OpenAI's error body on the errors Ray Serve's proxy writes itself (``serve --replicas``).

When a replica dies with requests in flight, or none is available, the
proxy answers those requests itself: a plain-text 5xx, or no answer at all
(uvicorn then writes a plain 500). This ASGI middleware, run in the proxy,
gives such an answer the body every other error of the server has,
``{"error": {"message", "type", "param", "code"}}``: a 5xx that is not JSON
keeps its status, no answer becomes a 500.
Ray loads it from ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` =
:data:`PROXY_CALLBACK` (set in the environment Ray starts from:
``rapidspec serve --replicas`` does so for the local instance it starts).
A stream cut after its first chunk has sent its status already; the client
sees the stream end without ``[DONE]``.
"""

from __future__ import annotations

import json

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "rapidspec.scale.proxy_errors:proxy_middlewares"


def proxy_middlewares() -> list:
    """What Ray Serve's proxy calls at start: the middlewares to wrap its app in (error bodies outermost, then
    the session key of requests without one, :mod:`rapidspec.scale.affinity`)."""
    from starlette.middleware import Middleware

    from rapidspec.scale.affinity import SessionAffinity

    return [Middleware(OpenAIErrorBodies), Middleware(SessionAffinity)]


class OpenAIErrorBodies:
    """Pure ASGI middleware: a non-JSON 5xx becomes OpenAI's error body (JSON answers pass untouched)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: dict = {}  # status and body of a plain 5xx being rewritten
        started = False

        async def rewrite(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                content_type = dict(message.get("headers") or []).get(b"content-type", b"")
                if message["status"] >= 500 and not content_type.startswith(b"application/json"):
                    held.update(status=message["status"], text=b"")
                    return
            elif message["type"] == "http.response.body" and held:
                held["text"] += message.get("body", b"")
                if message.get("more_body"):
                    return
                await _send_error(send, held["status"], held["text"].decode("utf-8", "replace").strip())
                return
            await send(message)

        await self.app(scope, receive, rewrite)
        if not started:  # the proxy gave up on the request without answering it
            await _send_error(send, 500, "")


async def _send_error(send, status: int, detail: str) -> None:
    from rapidspec.server.responses import error_body

    message = "the replica serving this request failed or none was available; retry"
    body = json.dumps(error_body(f"{message} ({detail})" if detail else message, "server_error", None,
                                 "replica_unavailable")).encode("utf-8")
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
