"""``/health``, ``/metrics``, ``/v1/models`` and ``/version``; with replicas, health and metrics cover them all."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from rapidspec import __version__
from rapidspec.server.fleet import fleet_health, merged_metrics
from rapidspec.server.openapi import METRICS, PLAIN
from rapidspec.server.state import ServerState, server_state

router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"], responses=PLAIN)  # load balancers probe with HEAD
async def health(state: ServerState = Depends(server_state)):
    if state.fleet is None:
        return state.local_health()
    body = fleet_health(await state.fleet.reports())
    return body if body["replicas"] else JSONResponse(body, status_code=503)  # none has reported yet


@router.get("/metrics", responses=METRICS)
async def prometheus(state: ServerState = Depends(server_state)) -> Response:
    text = state.metrics.render() if state.fleet is None else merged_metrics(await state.fleet.reports())
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models", responses=PLAIN)
async def models(state: ServerState = Depends(server_state)) -> dict:
    return {"object": "list", "data": [{"id": state.config.model_name, "object": "model", "created": state.started,
                                        "owned_by": "rapidspec", "max_model_len": state.window}]}


@router.get("/version", responses=PLAIN)
async def version() -> dict:
    return {"version": __version__}
