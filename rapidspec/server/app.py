"""The FastAPI application: OpenAI routes over one engine, no decoding logic of its own.

Each generation request is checked (400 on a user mistake), queued on the
:class:`~rapidspec.server.worker.Worker` (429 when the queue is full), and
answered once the engine has built its prompts (so a prompt that does not fit
the window is a 400 even when streaming). Before a request queues, its texts
are sized up off the engine thread (:mod:`rapidspec.server.tokens`), so one
that cannot fit is refused without holding the engine. A client that goes
away is noticed within ``disconnect_poll_seconds``, streaming or not: a
waiting request leaves the queue, a running one stops after the current round
or between two prefill chunks. Limits (API key, body size, window, time per
request, CORS) are :class:`ServerConfig` fields. Errors always use OpenAI's
body ``{"error": {"message", "type", "param", "code"}}``; a bug is a 500 whose
body has no traceback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rapidspec import __version__
from rapidspec.config import MAX_TOKENS, DecodeConfig
from rapidspec.conversation import DEFAULT_RECENT_MESSAGES, parse_documents, parse_messages
from rapidspec.drafting.eta_default import resolve_eta
from rapidspec.errors import RapidspecError
from rapidspec.retrieval import RetrievalConfig, Retriever
from rapidspec.runtime.errors import PrefillStopped
from rapidspec.server.fleet import fleet_health, merged_metrics
from rapidspec.server.capacity import concurrent_sequences, free_memory_bytes, kv_bytes_per_token
from rapidspec.server.limits import RequestGuard
from rapidspec.server.metrics import ServerMetrics
from rapidspec.server.responses import FINISH_REASONS, Reply, error_body, error_response, sse
from rapidspec.server.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, GenerationRequest,
                                      TokenizeRequest)
from rapidspec.server.tokens import ServerTokens
from rapidspec.server.worker import Job, QueueFull, Worker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """Server settings; ``decode`` and ``retrieval`` (None: the engine's) are the defaults of every request.

    ``decode.max_model_len`` and ``decode.time_limit_s`` are the window and the
    seconds each request may use (requests cannot change them; the time is
    wall-clock, so the requests running alongside count). ``max_num_seqs``:
    requests the engine advances in turn, a round each (fewer when their
    windows do not fit the free memory, :mod:`rapidspec.server.capacity`);
    ``max_queue``: requests that may wait beyond those. ``api_key``:
    None = open; ``max_request_bytes``: larger bodies get 413;
    ``max_document_tokens``: what a request's texts may hold when it asks for
    truncation (None = 4 windows); ``allowed_origins``: CORS (empty = off,
    ``("*",)`` = any).
    """

    model_name: str
    decode: DecodeConfig = field(default_factory=lambda: DecodeConfig(truncate="error", time_limit_s=600.0))
    retrieval: RetrievalConfig | None = None
    recent_messages: int = DEFAULT_RECENT_MESSAGES
    max_queue: int = 16
    max_num_seqs: int = 4
    disconnect_poll_seconds: float = 0.5
    api_key: str | None = None
    max_request_bytes: int = 16 * 1024 * 1024
    max_document_tokens: int | None = None
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.model_name:
            raise RapidspecError("the served model name is empty")
        if self.max_queue < 0:
            raise RapidspecError(f"max_queue must be >= 0, got {self.max_queue}")
        if not 1 <= self.max_num_seqs <= 256:
            raise RapidspecError(f"max_num_seqs must be in [1, 256], got {self.max_num_seqs}")
        if self.recent_messages < 0:
            raise RapidspecError(f"recent_messages must be >= 0, got {self.recent_messages}")
        if self.api_key is not None and not self.api_key.strip():
            raise RapidspecError("the API key is empty")
        if not 1024 <= self.max_request_bytes <= 1 << 31:
            raise RapidspecError(f"max_request_bytes must be in [1024, 2**31], got {self.max_request_bytes}")
        if self.max_document_tokens is not None and not 1 <= self.max_document_tokens <= MAX_TOKENS:
            raise RapidspecError(f"max_document_tokens must be in [1, {MAX_TOKENS}], got {self.max_document_tokens}")
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))


class _Cancelled(Exception):
    """The client went away."""


def create_app(engine, config: ServerConfig, fleet=None) -> FastAPI:
    """The app serving ``engine`` (a :class:`rapidspec.Rapid`); see docs/serving.md.

    ``fleet``: a :class:`~rapidspec.server.fleet.FleetReporter` when the app is one replica of several
    (``/health`` and ``/metrics`` then answer for all of them).
    """
    window = config.decode.max_model_len or engine.target.max_context
    if window > engine.target.max_context:
        raise RapidspecError(f"max_model_len={window} exceeds the model's {engine.target.max_context}-token window")
    slots = concurrent_sequences(config.max_num_seqs, window, kv_bytes_per_token(engine.target),
                                 free_memory_bytes(engine.target.device), engine.prefix_cache.max_bytes)
    worker = Worker(config.max_queue, slots)
    metrics = ServerMetrics(config.model_name, waiting=lambda: worker.waiting, running=lambda: worker.running)
    retrievers: OrderedDict[RetrievalConfig, Retriever] = OrderedDict()  # used on the worker thread only
    tokens = ServerTokens(engine.tokenizer, config.max_document_tokens or 4 * window)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if fleet is not None:
            fleet.stop()  # a replica shutting down stops reporting (the board drops it after STALE_AFTER_S)
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="rapidspec", version=__version__, lifespan=lifespan)
    app.state.engine, app.state.worker, app.state.metrics = engine, worker, metrics
    app.add_middleware(RequestGuard, api_key=config.api_key, max_request_bytes=config.max_request_bytes,
                       refused=metrics.failed)
    if config.allowed_origins:  # outside the guard: CORS preflights need no key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])

    def retriever_for(wanted: RetrievalConfig) -> Retriever:
        if wanted == engine.retriever.config:
            return engine.retriever
        if wanted not in retrievers:
            retrievers[wanted] = Retriever(wanted, tokenizer=engine.tokenizer, embedder=engine.retriever.loaded_embedder)
            while len(retrievers) > 4:
                retrievers.popitem(last=False)
        retrievers.move_to_end(wanted)
        return retrievers[wanted]

    # ---------------------------------------------------------------- errors
    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        metrics.failed("bad_request")
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
        if first.get("type") == "json_invalid":  # its location is a character offset, not a field
            message, where = "the request body is not valid JSON", None
        elif not where:
            message = "the request body must be a JSON object (Content-Type: application/json)"
        else:
            message = f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}"
        return error_response(400, message, "invalid_request_error", where, first.get("type"))

    def failure(err: Exception) -> tuple[int, dict]:
        """The status and OpenAI error body of a failed generation, counted in the metrics."""
        if isinstance(err, RapidspecError):
            metrics.failed("bad_request")
            status = 404 if err.code == "model_not_found" else 400  # OpenAI's status for an unknown model
            return status, error_body(str(err), "invalid_request_error", err.param, err.code)
        metrics.failed("internal_error")
        return 500, error_body("internal server error (see the server's log)", "internal_error", None, "internal_error")

    @app.exception_handler(RapidspecError)
    async def user_mistake(request: Request, err: RapidspecError) -> JSONResponse:
        status, body = failure(err)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, err: QueueFull) -> JSONResponse:
        metrics.failed("queue_full")
        return error_response(429, f"the server is busy: {err}; retry later", "rate_limit_error", None, "queue_full")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail), "invalid_request_error", None, None)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        logger.error("request failed: %r", err)
        status, body = failure(err)
        return JSONResponse(body, status_code=status)

    # ---------------------------------------------------------------- routes
    default_eta, eta_reason = resolve_eta(config.decode.with_(mode="rapid"), engine.drafter_relation)

    def local_health() -> dict:
        return {"status": "ok", "model": config.model_name, "pid": os.getpid(), "running": worker.running,
                "rapid_eta": {"default": default_eta.eta, "reason": "given by --eta" if eta_reason == "given" else eta_reason,
                              "drafter": engine.drafter_label, "drafter_relation": engine.drafter_relation},
                "waiting": worker.waiting, "max_num_seqs": worker.max_num_seqs,
                "max_queue": config.max_queue, "prefix_cache": {"entries": len(engine.prefix_cache),
                                                                 "bytes": engine.prefix_cache.bytes_used,
                                                                 "max_bytes": engine.prefix_cache.max_bytes}}

    app.state.health = local_health

    @app.get("/health")
    async def health():
        if fleet is None:
            return local_health()
        body = fleet_health(await fleet.reports())
        return body if body["replicas"] else JSONResponse(body, status_code=503)  # none has reported yet

    @app.get("/metrics")
    async def prometheus() -> Response:
        text = metrics.render() if fleet is None else merged_metrics(await fleet.reports())
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": started,
                                            "owned_by": "rapidspec", "max_model_len": window}]}

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        messages = None if body.messages is None else parse_messages(body.messages)
        ids = await asyncio.to_thread(tokens.tokenize, body.prompt, messages, body.add_special_tokens)
        out = {"count": len(ids), "max_model_len": window, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = await asyncio.to_thread(tokens.token_texts, ids)
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        return {"prompt": await asyncio.to_thread(tokens.detokenize, body.tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await generate(body, request, body.messages, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await generate(body, request, [{"role": "user", "content": body.prompt_text()}], chat=False)

    # ------------------------------------------------------------ generation
    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise RapidspecError(f"the model {name!r} is not served here; this server serves "
                                 f"{config.model_name!r}", param="model", code="model_not_found")

    async def generate(body: GenerationRequest, request: Request, messages, chat: bool):
        arrived = time.perf_counter()
        check_model(body.model)
        if body.unknown_fields:
            logger.warning("ignored request fields no schema defines: %s", ", ".join(body.unknown_fields))
        decode = body.decode_config(config.decode)
        retrieval = body.retrieval_config(config.retrieval or engine.retriever.config)
        messages = parse_messages(messages)
        documents = parse_documents(body.documents)
        recent = config.recent_messages if body.recent_messages is None else body.recent_messages
        await asyncio.to_thread(tokens.check_fits, messages, documents, decode.truncate, window)

        def work(emit, cancelled):  # a generator: the worker runs it a step at a time
            prompts = engine.chat_prompts(messages, decode, documents=documents, query=body.query,
                                          recent_messages=recent, raw=not chat, retriever=retriever_for(retrieval))
            if cancelled.is_set():
                return
            emit("ready", None)
            yield
            stream = engine.decode(prompts, decode, should_stop=cancelled.is_set, yield_prefill_chunks=True)
            try:
                for chunk in stream:  # one prefill chunk or one round per step
                    if cancelled.is_set():
                        return
                    if chunk.text or chunk.token_ids or chunk.output is not None:
                        emit("chunk", chunk)
                    yield
            except PrefillStopped:  # cancelled between two prefill chunks
                return
            finally:
                stream.close()

        job = worker.submit(work)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        reply = Reply(chat, config.model_name, include_usage, tokens.token_texts if decode.logprobs is not None else None)
        try:
            kind, payload = await next_event(job, request)  # "ready" once the prompts are built
        except _Cancelled:
            metrics.failed("cancelled")
            return Response(status_code=204)
        if kind == "error":
            raise payload
        if kind == "end":
            return shutting_down()
        if body.stream:
            return StreamingResponse(stream_events(job, request, reply, arrived), media_type="text/event-stream")
        output = None
        try:
            while (event := await next_event(job, request))[0] == "chunk":
                if output is None:
                    observe_first_token(arrived)
                output = event[1].output or output
        except _Cancelled:
            metrics.failed("cancelled")
            return Response(status_code=204)
        if event[0] == "error":
            raise event[1]
        if output is None:
            return shutting_down()
        record_finish(job, output, arrived)
        return reply.complete(output)

    def shutting_down() -> JSONResponse:
        metrics.failed("cancelled")
        return error_response(503, "the server is shutting down", "server_error", None, "shutting_down")

    async def stream_events(job: Job, request: Request, reply: Reply, arrived: float):
        first, finished, failed = True, False, False
        try:
            yield sse(reply.chunk(role=True) if reply.chat else reply.chunk(text=""))
            while True:
                kind, payload = await next_event(job, request)
                if kind == "error":
                    failed = True
                    yield sse(failure(payload)[1])
                    break
                if kind != "chunk":
                    break
                if first and (payload.text or payload.token_ids):
                    observe_first_token(arrived)
                    first = False
                if payload.text or (payload.logprobs and reply.token_texts):
                    yield sse(reply.chunk(text=payload.text, logprobs=payload.logprobs))
                if payload.output is not None:
                    record_finish(job, payload.output, arrived)
                    finished = True
                    for last in reply.last_chunks(payload.output):
                        yield sse(last)
            yield sse("[DONE]")
        except _Cancelled:
            pass
        finally:
            if not finished:
                job.cancel()  # the client went away: stop after the current round
                if not failed:
                    metrics.failed("cancelled")

    async def next_event(job: Job, request: Request) -> tuple[str, object]:
        """The job's next event; raises _Cancelled (and cancels the job) when the client has gone.

        The client is asked at least every ``disconnect_poll_seconds``, also while events keep coming.
        """
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), config.disconnect_poll_seconds)
            except asyncio.TimeoutError:
                event = None
            now = time.monotonic()
            if event is None or now - job.checked >= config.disconnect_poll_seconds:
                job.checked = now
                if await request.is_disconnected():
                    job.cancel()
                    raise _Cancelled()
            if event is not None:
                return event

    def observe_first_token(arrived: float) -> None:
        metrics.time_to_first_token.labels(config.model_name).observe(time.perf_counter() - arrived)

    def record_finish(job: Job, output, arrived: float) -> None:
        now = time.perf_counter()
        metrics.e2e_latency.labels(config.model_name).observe(now - arrived)
        if job.started is not None:
            metrics.queue_time.labels(config.model_name).observe(job.started - job.submitted)
        metrics.finished(output.stats, FINISH_REASONS[output.stats.stop_reason])

    return app
