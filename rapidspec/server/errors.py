"""Every error as OpenAI's body ``{"error": {"message", "type", "param", "code"}}``, counted in the metrics.

A user mistake (:class:`~rapidspec.errors.RapidspecError`, an invalid body) is
a 400 naming the field (404 for an unknown model), a full queue a 429, a bug a
500 whose body has no traceback.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rapidspec.errors import RapidspecError
from rapidspec.server.responses import error_body, error_response
from rapidspec.server.worker import QueueFull

logger = logging.getLogger(__name__)


def failure(err: Exception, metrics) -> tuple[int, dict]:
    """The status and OpenAI error body of a failed generation, counted in ``metrics``."""
    if isinstance(err, RapidspecError):
        metrics.failed("bad_request")
        status = 404 if err.code == "model_not_found" else 400  # OpenAI's status for an unknown model
        return status, error_body(str(err), "invalid_request_error", err.param, err.code)
    metrics.failed("internal_error")
    return 500, error_body("internal server error (see the server's log)", "internal_error", None, "internal_error")


def add_error_handlers(app: FastAPI, metrics) -> None:
    """Map every exception a route can raise onto OpenAI's error body."""

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        raised = (first.get("ctx") or {}).get("error")
        if isinstance(raised, RapidspecError):  # a body's own check (text that is not UTF-8, ...)
            status, body = failure(raised, metrics)
            return JSONResponse(body, status_code=status)
        metrics.failed("bad_request")
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
        if first.get("type") == "json_invalid":  # its location is a character offset, not a field
            message, where = "the request body is not valid JSON", None
        elif not where:
            message = "the request body must be a JSON object (Content-Type: application/json)"
        else:
            message = f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}"
        return error_response(400, message, "invalid_request_error", where, first.get("type"))

    @app.exception_handler(RapidspecError)
    async def user_mistake(request: Request, err: RapidspecError) -> JSONResponse:
        status, body = failure(err, metrics)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, err: QueueFull) -> JSONResponse:
        metrics.failed("queue_full")
        return error_response(429, f"the server is busy: {err}; retry later", "rate_limit_error", None, "queue_full")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code != 400:  # an unknown route or method: no request was made of the model
            return error_response(err.status_code, str(err.detail), "invalid_request_error", None, None)
        metrics.failed("bad_request")  # FastAPI's own 400: a body it could not decode (bytes that are not UTF-8)
        message = ("the request body is not valid JSON in UTF-8" if err.detail == "There was an error parsing the body"
                   else str(err.detail))
        return error_response(400, message, "invalid_request_error", None, "json_invalid")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        logger.error("request failed: %r", err)
        status, body = failure(err, metrics)
        return JSONResponse(body, status_code=status)
