"""The load generator of ``rapidspec bench serve``: chat requests at a given rate and concurrency.

:func:`run_benchmark` checks the server (one line when it cannot be reached
or wants an API key), sends one untimed test request (so a request the server
refuses fails the run at once, as ``vllm bench serve`` does), reads the
counters of ``/metrics``, then sends ``num_prompts`` requests: their arrival
times follow a Poisson process of ``request_rate`` per second (exponential
gaps drawn from ``random.Random(seed)``; ``inf``: all at once), and at most
``max_concurrency`` are in flight at once. Everything is bounded by
``timeout_s``; a request without an answer by then is lost. Afterwards it
waits (at most :data:`SETTLE_TIMEOUT_S`) for ``/health`` to show nothing
running or waiting, reads ``/metrics`` again and returns the summary of
:func:`rapidspec.bench.serve.stats.summarize` with the server's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from rapidspec.errors import RapidspecError
from rapidspec.bench.serve.client import check_server, read_counters, send_request, settled_health
from rapidspec.bench.serve.dataset import BenchRequest
from rapidspec.bench.serve.stats import RequestResult, summarize

SETTLE_TIMEOUT_S = 60.0
#: Seconds to wait before reading the counters of a server whose /health shows no queue (vLLM counts a step's
#: tokens just after it sends them).
COUNT_DELAY_S = 1.0
#: Body fields the options set; ``extra_body`` may not replace them.
RESERVED_FIELDS = frozenset({"messages", "documents", "max_tokens", "max_completion_tokens", "stream", "stream_options"})


def normalize_base_url(url: str) -> str:
    """``http(s)://host[:port][/prefix]`` without a trailing ``/`` or ``/v1`` (RapidspecError otherwise)."""
    hint = "--base-url must be an http(s) URL such as http://127.0.0.1:8000"
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as err:
        raise RapidspecError(f"{hint}, got {url!r} ({err})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host or parsed.query or parsed.fragment:
        raise RapidspecError(f"{hint}, got {url!r}")
    text = str(parsed).rstrip("/")
    return text[:-3] if text.endswith("/v1") else text


@dataclass(frozen=True)
class LoadConfig:
    """What to send where; validated on construction (RapidspecError names the option)."""

    base_url: str
    num_prompts: int = 32
    max_concurrency: int | None = None
    request_rate: float = math.inf
    seed: int = 0
    max_tokens: int | tuple[int, ...] = 32  # several: request i asks for max_tokens[i % len] (mixed answer lengths)
    stream: bool = True
    ignore_eos: bool = False
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    extra_body: dict = field(default_factory=dict, hash=False)
    timeout_s: float = 900.0
    test_request: bool = True
    sessions: bool = False  # request i carries x-session-id conversation-(i mod dataset size)
    inline_documents: bool = False  # documents placed in the messages (a peer server), not sent as `documents`

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_url", normalize_base_url(self.base_url))
        if self.num_prompts < 1:
            raise RapidspecError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise RapidspecError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_rate > 0:  # also refuses nan
            raise RapidspecError(f"--request-rate must be > 0 (inf: all at once), got {self.request_rate}")
        if not self.answer_lengths or any(not isinstance(n, int) or n < 1 for n in self.answer_lengths):
            raise RapidspecError(f"--max-tokens must be one or more integers >= 1, got {self.max_tokens}")
        if not 0 < self.timeout_s < math.inf:
            raise RapidspecError(f"--timeout must be a positive number of seconds, got {self.timeout_s}")
        if not isinstance(self.extra_body, dict):
            raise RapidspecError("--extra-body must be a JSON object")
        if reserved := sorted(RESERVED_FIELDS & set(self.extra_body)):
            raise RapidspecError(f"--extra-body may not set {', '.join(reserved)}: the options of bench serve do")

    @property
    def answer_lengths(self) -> tuple[int, ...]:
        """The ``max_tokens`` the requests take in turn."""
        return self.max_tokens if isinstance(self.max_tokens, tuple) else (self.max_tokens,)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, request: BenchRequest, index: int = 0) -> dict:
        """The ``/v1/chat/completions`` body of ``request``, the ``index``-th of the load."""
        lengths = self.answer_lengths
        messages = request.inlined_messages() if self.inline_documents else list(request.messages)
        body: dict = {"messages": messages, "max_tokens": lengths[index % len(lengths)], "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if request.documents and not self.inline_documents:
            body["documents"] = list(request.documents)
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.model:
            body["model"] = self.model
        return body | self.extra_body

    def describe(self) -> dict:
        """The settings for the report (no API key; an infinite rate as ``"inf"``, as vLLM writes it)."""
        return {"base_url": self.base_url, "num_prompts": self.num_prompts, "max_concurrency": self.max_concurrency,
                "request_rate": "inf" if math.isinf(self.request_rate) else self.request_rate, "seed": self.seed,
                "max_tokens": list(self.max_tokens) if isinstance(self.max_tokens, tuple) else self.max_tokens,
                "stream": self.stream, "ignore_eos": self.ignore_eos,
                "model": self.model, "extra_body": self.extra_body, "sessions": self.sessions,
                "inline_documents": self.inline_documents}


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is due: 0, then exponential gaps of mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    times, now = [], 0.0
    for index in range(count):
        if index:
            now += rng.expovariate(rate)
        times.append(now)
    return times


async def run_load(client: httpx.AsyncClient, config: LoadConfig, requests: Sequence[BenchRequest],
                   on_done: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """Send the load; every request's result (in order) and the seconds from the first arrival to the last answer."""
    if not requests:
        raise RapidspecError("the dataset has no requests")
    due = arrival_times(config.num_prompts, config.request_rate, config.seed)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else contextlib.nullcontext()
    start = time.perf_counter()

    async def one(index: int) -> RequestResult:
        await asyncio.sleep(max(0.0, start + due[index] - time.perf_counter()))
        async with limit:
            session = f"conversation-{index % len(requests)}" if config.sessions else None
            result = await send_request(client, index, config.body(requests[index % len(requests)], index), session)
        if on_done is not None:
            on_done(result)
        return result

    tasks = [asyncio.create_task(one(i)) for i in range(config.num_prompts)]
    _, pending = await asyncio.wait(tasks, timeout=config.timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    duration = time.perf_counter() - start
    results = []
    for index, task in enumerate(tasks):
        if task in pending:
            results.append(RequestResult(index, lost=True, detail=f"no answer within --timeout {config.timeout_s:g} s"))
        else:
            results.append(task.result())  # a bug in send_request is raised here
    return results, duration


def counter_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """How much each /metrics counter grew during the load, with the acceptance and prefix-cache hit rates."""
    if before is None or after is None:
        return None
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    drafted, accepted, drafts = (delta.get(k) for k in ("draft_tokens", "accepted_tokens", "drafts"))
    delta["acceptance_rate"] = accepted / drafted if drafted and accepted is not None else None
    if "drafts" in delta:  # vLLM's counters: a round's accepted tokens + the one the target adds
        delta["mean_acceptance_length"] = 1 + accepted / drafts if drafts and accepted is not None else None
    queried = delta.get("prefix_cache_query_tokens")
    delta["prefix_cache_hit_rate"] = delta.get("prefix_cache_hit_tokens", 0.0) / queried if queried else None
    return delta


async def _benchmark(config: LoadConfig, requests: Sequence[BenchRequest], on_done, counters) -> dict:
    connections = config.max_concurrency or config.num_prompts
    async with httpx.AsyncClient(
        base_url=config.base_url, headers=config.headers, timeout=httpx.Timeout(config.timeout_s),
        limits=httpx.Limits(max_connections=connections + 2, max_keepalive_connections=connections + 2),
    ) as client:
        await check_server(client)
        if config.test_request:
            try:
                test = await asyncio.wait_for(send_request(client, -1, config.body(requests[0])), config.timeout_s)
            except asyncio.TimeoutError:
                raise RapidspecError(f"the test request got no answer within --timeout {config.timeout_s:g} s") from None
            if test.outcome != "completed":
                raise RapidspecError(f"the test request failed, nothing was measured: {test.detail}")
        before = await read_counters(client, counters)
        results, duration = await run_load(client, config, requests, on_done)
        health = await settled_health(client, SETTLE_TIMEOUT_S)
        if isinstance(health, dict) and "replicas" in health:  # replicas report once a second (rapidspec.scale.fleet)
            await asyncio.sleep(2.0)
        elif not isinstance(health, dict) or "running" not in health:  # no queue to watch (vLLM): let it count
            await asyncio.sleep(COUNT_DELAY_S)
        after = await read_counters(client, counters)
    return summarize(results, duration) | {"server_metrics": counter_deltas(before, after), "health_after": health}


def run_benchmark(config: LoadConfig, requests: Sequence[BenchRequest],
                  on_done: Callable[[RequestResult], None] | None = None,
                  counters: dict[str, str] | None = None) -> dict:
    """Run the load against ``config.base_url``; the summary (vLLM's key names) with the growth of the server's
    ``counters`` (key -> /metrics name; default: rapidspec serve's, :data:`~.client.COUNTERS`)."""
    return config.describe() | asyncio.run(_benchmark(config, requests, on_done, counters))
