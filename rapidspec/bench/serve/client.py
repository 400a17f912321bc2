"""HTTP conversations of ``rapidspec bench serve`` with a server: one timed chat request, and the probes.

:func:`send_request` posts one body to ``/v1/chat/completions`` and times the
answer (streamed or not) into a :class:`~rapidspec.bench.serve.stats.RequestResult`;
it never raises for anything the server or the network does. The probes read
``/health``, ``/v1/models`` and the counters of ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx

from rapidspec.errors import RapidspecError
from rapidspec.bench.serve.stats import RequestResult
from rapidspec.scale import SESSION_HEADER  # what `rapidspec serve --replicas` keeps on one replica

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
PROBE_TIMEOUT_S = 10.0

#: Counters of ``rapidspec serve``'s /metrics read before and after the load (summed over labels).
COUNTERS = {
    "generation_tokens": "rapidspec:generation_tokens_total",
    "prefix_cache_hit_requests": "rapidspec:prefix_cache_hit_requests_total",
    "prefix_cache_hit_tokens": "rapidspec:prefix_cache_hits_total",
    "prefix_cache_query_tokens": "rapidspec:prefix_cache_queries_total",
    "draft_tokens": "rapidspec:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "rapidspec:spec_decode_num_accepted_tokens_total",
    "lookup_draft_tokens": "rapidspec:lookup_num_draft_tokens_total",
    "lookup_accepted_tokens": "rapidspec:lookup_num_accepted_tokens_total",
}


async def send_request(client: httpx.AsyncClient, index: int, body: dict, session: str | None = None) -> RequestResult:
    """Send ``body`` (in ``session``, when given) and time its answer; the outcome says what happened
    (see :mod:`.serve_stats`)."""
    result = RequestResult(index, session=session)
    sent = time.perf_counter()
    headers = {SESSION_HEADER: session} if session else None
    try:
        async with client.stream("POST", CHAT_PATH, json=body, headers=headers) as response:
            result.status = response.status_code
            if response.status_code != 200:
                _refused(result, response.status_code, await response.aread())
            elif body.get("stream"):
                await _read_stream(result, response, sent)
            else:
                _read_whole(result, json.loads(await response.aread()))
                result.latency = time.perf_counter() - sent
    except (httpx.HTTPError, OSError) as err:
        result.outcome, result.lost, result.detail = "error", True, f"{type(err).__name__}: {err}"
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        result.outcome, result.lost, result.detail = "error", True, f"unreadable answer: {err!r}"
    return result


def _refused(result: RequestResult, status: int, content: bytes) -> None:
    try:
        message = json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = content[:200].decode("utf-8", "replace")
    result.detail = f"HTTP {status}: {message}"
    result.outcome = "rejected" if status == 429 else "error"
    result.lost = status >= 500


def _use_metrics(result: RequestResult, metrics: object) -> None:
    """vLLM's per-request ``metrics.speculative_decoding``, from any server that sends it."""
    found = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if isinstance(found, dict):
        result.speculative = found


def _use_usage(result: RequestResult, usage: dict | None) -> None:
    if usage:
        result.output_tokens = usage.get("completion_tokens")
        result.prompt_tokens = usage.get("prompt_tokens")
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def _read_whole(result: RequestResult, data: dict) -> None:
    if "error" in data:
        result.outcome, result.detail = "error", f"error in the answer: {data['error']}"
        return
    finished = data["choices"][0].get("finish_reason")
    _use_usage(result, data.get("usage"))
    _use_metrics(result, data.get("metrics"))
    result.outcome = "completed" if finished else "error"
    result.lost = not finished
    result.detail = None if finished else "an answer without a finish reason"


async def _read_stream(result: RequestResult, response: httpx.Response, sent: float) -> None:
    finished = done = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.outcome, result.detail = "error", f"error event in the stream: {chunk['error']}"
            return
        for choice in chunk.get("choices") or ():
            if (choice.get("delta") or {}).get("content"):
                now = time.perf_counter() - sent
                result.chunk_times.append(now)
                result.ttft = now if result.ttft is None else result.ttft
            finished = finished or bool(choice.get("finish_reason"))
        _use_usage(result, chunk.get("usage"))
        _use_metrics(result, chunk.get("metrics"))
    result.latency = time.perf_counter() - sent
    if finished:
        result.outcome = "completed"
    else:
        result.outcome, result.lost = "error", True
        result.detail = "the stream ended without a finish reason" + ("" if done else " (no [DONE])")


# ------------------------------------------------------------------ probes
async def check_server(client: httpx.AsyncClient) -> dict | None:
    """Fail with one line when the server cannot be reached or refuses the API key; its /health (None if it has none)."""
    try:
        health = await client.get("/health", timeout=PROBE_TIMEOUT_S)
        models = await client.get("/v1/models", timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError as err:
        raise RapidspecError(f"cannot reach the server at {client.base_url}: {type(err).__name__}: {err}") from None
    if models.status_code == 401:
        raise RapidspecError(f"the server at {client.base_url} needs an API key (401): pass --api-key "
                             "or set RAPIDSPEC_API_KEY")
    if health.status_code == 200:
        try:
            return health.json()
        except ValueError:
            pass
    return None


async def read_counters(client: httpx.AsyncClient, counters: dict[str, str] | None = None) -> dict[str, float] | None:
    """``counters`` (key -> metric name; default :data:`COUNTERS`) of ``/metrics``, each summed over its labels
    (None when the server has no readable /metrics)."""
    counters = COUNTERS if counters is None else counters
    try:
        response = await client.get("/metrics", timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError as err:
        logger.warning("could not read /metrics: %s", err)
        return None
    if response.status_code != 200:  # 404/501: a server without /metrics (llama-server by default)
        log = logger.info if response.status_code in (404, 501) else logger.warning
        log("/metrics answered %s: no server counters", response.status_code)
        return None
    names = {name: key for key, name in counters.items()}
    values = dict.fromkeys(counters, 0.0)
    for line in response.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                values[names[name]] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return values


async def settled_health(client: httpx.AsyncClient, timeout: float, every: float = 0.25) -> dict | None:
    """``/health`` once nothing runs or waits, or the last one seen after ``timeout`` s (None: no /health)."""
    deadline = time.monotonic() + timeout
    health = None
    while True:
        try:
            response = await client.get("/health", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as err:
            logger.warning("could not read /health after the load: %s", err)
            return health
        try:
            health = response.json() if response.status_code == 200 else None
        except ValueError:  # a /health without a body (vLLM's): nothing to wait for
            return None
        if not isinstance(health, dict) or "running" not in health:
            return health
        if (not health.get("running") and not health.get("waiting")) or time.monotonic() >= deadline:
            return health
        await asyncio.sleep(every)
