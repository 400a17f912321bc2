"""What the OpenAPI document (``/openapi.json``) says each route answers: its content types and every error status.

Every error is OpenAI's body (:class:`ErrorBody`). Any route may meet the
server's limits (401 without a valid API key, 408 for a body that stopped
arriving, 413 beyond ``max_request_bytes``, 503 when connections are full or
the server drains, 500 for a bug); routes that read a ``model`` answer 404 for
another model; generations answer 429 when the line is full. Clients and
schema-driven tools (schemathesis in the tests) read these.
"""

from __future__ import annotations

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


_WHY = {
    400: "an invalid request (error.param names the field)", 401: "no valid API key",
    404: "another model, or no such route", 408: "the request body stopped arriving",
    413: "the request body is larger than the server's limit", 429: "the server's line is full: retry later",
    500: "a fault of the server (no traceback in the body)", 503: "the server is full of connections or shutting down",
}
_ANY_ROUTE = (401, 408, 413, 500, 503)


def answers(*statuses: int, content: tuple[str, ...] = ()) -> dict:
    """FastAPI's ``responses=`` for a route: the server's limits, ``statuses`` and the 200's ``content`` types."""
    out: dict = {status: {"model": ErrorBody, "description": _WHY[status]}
                 for status in sorted({400, *_ANY_ROUTE, *statuses})}
    if content:
        out[200] = {"content": {media: {} for media in content}, "description": "the answer"}
    return out


GENERATION = answers(404, 429, content=("application/json", "text/event-stream"))
TOKENS = answers(404)
PLAIN = answers()
METRICS = answers(content=("text/plain",))
