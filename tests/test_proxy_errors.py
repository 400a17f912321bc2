"""The middleware Ray Serve's proxy runs for `serve --replicas`: its own plain 5xx get OpenAI's error body."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from rapidspec.scale.proxy_errors import OpenAIErrorBodies, proxy_middlewares


def _app():
    routes = [
        Route("/dead", lambda request: PlainTextResponse("Internal Server Error", status_code=500)),
        Route("/gone", lambda request: PlainTextResponse("Service Unavailable", status_code=503)),
        Route("/ours", lambda request: JSONResponse({"error": {"code": "internal_error"}}, status_code=500)),
        Route("/fine", lambda request: PlainTextResponse("ok")),
    ]

    async def silent(scope, receive, send):  # the proxy when a replica died: it returns without answering
        if scope["path"] == "/silent":
            return
        await app(scope, receive, send)

    app = Starlette(routes=routes)
    return OpenAIErrorBodies(silent)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_plain_5xx_become_openai_bodies_and_the_rest_pass(anyio_backend):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://proxy") as client:
        dead, gone, silent = await client.get("/dead"), await client.get("/gone"), await client.get("/silent")
        assert (dead.status_code, gone.status_code, silent.status_code) == (500, 503, 500)
        for response, detail in ((dead, "Internal Server Error"), (gone, "Service Unavailable"), (silent, "")):
            error = response.json()["error"]
            assert error["code"] == "replica_unavailable" and error["type"] == "server_error" and detail in error["message"]
            assert set(error) == {"message", "type", "param", "code"}
        assert (await client.get("/ours")).json() == {"error": {"code": "internal_error"}}  # the app's own: untouched
        fine = await client.get("/fine")
        assert fine.status_code == 200 and fine.text == "ok"
    assert [m.cls.__name__ for m in proxy_middlewares()] == ["OpenAIErrorBodies", "SessionAffinity"]
