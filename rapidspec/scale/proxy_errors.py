"""OpenAI's error body on the errors Ray Serve's proxy writes itself (``serve --replicas``).

When a replica dies with requests in flight, or none is available, the
proxy answers those requests itself: a plain-text 5xx, or no answer at all
(uvicorn then writes a plain 500). This ASGI middleware, run in the proxy,
gives such an answer the body every other error of the server has,
``{"error": {"message", "type", "param", "code"}}``: a 5xx that is not JSON
keeps its status, no answer becomes a 500.
A stream cut after its first chunk has sent its status (200) already: the
proxy stops without ending the response (within about 0.1 s of the replica's
death), and the client would see the connection drop mid-body. Such a stream
(``text/event-stream``) is ended here as the single server ends a stream that
fails: an event ``data: {"error": {...}}`` in OpenAI's body (code
``replica_unavailable``), then ``data: [DONE]``.
Ray loads it from ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` =
:data:`PROXY_CALLBACK` (set in the environment Ray starts from:
``rapidspec serve --replicas`` does so for the local instance it starts).
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
    """Pure ASGI middleware: a non-JSON 5xx becomes OpenAI's error body, a cut stream ends with an error event."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: dict = {}  # status and body of a plain 5xx being rewritten
        response = {"started": False, "stream": False, "ended": False}

        async def rewrite(message) -> None:
            if message["type"] == "http.response.start":
                response["started"] = True
                content_type = dict(message.get("headers") or []).get(b"content-type", b"")
                response["stream"] = content_type.startswith(b"text/event-stream")
                if message["status"] >= 500 and not content_type.startswith(b"application/json"):
                    held.update(status=message["status"], text=b"")
                    return
            elif message["type"] == "http.response.body":
                response["ended"] = not message.get("more_body", False)
                if held:
                    held["text"] += message.get("body", b"")
                    if not response["ended"]:
                        return
                    await _send_error(send, held["status"], held["text"].decode("utf-8", "replace").strip())
                    return
            await send(message)

        try:
            await self.app(scope, receive, rewrite)
        except Exception:
            if not (response["stream"] and not response["ended"]):
                raise
        if not response["started"]:  # the proxy gave up on the request without answering it
            await _send_error(send, 500, "")
        elif response["stream"] and not response["ended"]:  # the replica died mid-stream
            await _end_stream(send)


def _error(message: str) -> bytes:
    """OpenAI's error body (as :func:`rapidspec.server.responses.error_body` builds it; not imported here: the
    server package loads torch, which would hold the proxy's event loop for seconds)."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_unavailable"}}
    return json.dumps(body).encode("utf-8")


async def _end_stream(send) -> None:
    """An error event and ``[DONE]`` end a stream the proxy left open."""
    error = _error("the replica serving this stream failed mid-answer; retry (the answer so far is incomplete)")
    await send({"type": "http.response.body", "body": b"data: " + error + b"\n\ndata: [DONE]\n\n", "more_body": False})


async def _send_error(send, status: int, detail: str) -> None:
    message = "the replica serving this request failed or none was available; retry"
    body = _error(f"{message} ({detail})" if detail else message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
