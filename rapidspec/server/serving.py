"""Serving one generation request: prepare it, queue it on the worker, then answer it whole or as server-sent events.

A request takes its place in the :class:`~rapidspec.server.worker.Worker`'s
line first (429 when it is full), then is prepared on the server's preparing
threads, never on the engine's: its texts are sized up (with the chat
template's tokens and the query, :mod:`rapidspec.server.tokens`), retrieval
runs and the prompts are built, so a request that cannot fit is a 400 before
it queues and an expensive one (a first-seen long document) does not hold
the requests beside it. The time this takes counts against the request's
time limit. Then the job runs on the engine. A client that goes away is noticed
within ``disconnect_poll_seconds``, streaming or not: a waiting request leaves
the queue, a running one stops after the current round or between two prefill
chunks. The engine's one decode loop does the work (:meth:`rapidspec.Rapid.decode`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rapidspec.errors import RapidspecError
from rapidspec.grammar.tools import with_tool_grammar
from rapidspec.prompting.conversation import parse_documents, parse_messages
from rapidspec.runtime.errors import PrefillStopped
from rapidspec.server.errors import failure
from rapidspec.server.pieces import PrefillPieces
from rapidspec.server.responses import FINISH_REASONS, EventStream, PrefillProgress, Reply, error_response, sse
from rapidspec.server.schemas import GenerationRequest
from rapidspec.server.state import ServerState
from rapidspec.server.worker import Job

logger = logging.getLogger(__name__)


class _Cancelled(Exception):
    """The client went away."""


#: A request whose texts hold at least this many characters (about 16K tokens) is prepared at a lower priority.
BACKGROUND_PREPARE_CHARACTERS = 64 * 1024


class GenerationServing:
    """Answers ``/v1/chat/completions`` and ``/v1/completions`` over one :class:`ServerState`."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def generate(self, body: GenerationRequest, request: Request, messages, chat: bool):
        state, config = self.state, self.state.config
        arrived = time.perf_counter()
        state.check_model(body.model)
        if body.unknown_fields:
            logger.warning("ignored request fields no schema defines: %s", body.unknown_fields_note())
        tools = body.tool_choice_of()
        decode = with_tool_grammar(body.decode_config(config.decode), tools, state.engine.tokenizer)
        retrieval = body.retrieval_config(config.retrieval or state.engine.retriever.config)
        messages = parse_messages(messages)
        documents = parse_documents(body.documents)
        recent = config.recent_messages if body.recent_messages is None else body.recent_messages
        if await request.is_disconnected():  # gone before admission: nothing is sized, built or queued
            state.metrics.failed("cancelled")
            return Response(status_code=204)

        def prepare():  # off the event loop and off the engine thread
            state.tokens.check_fits(messages, documents, decode.truncate, state.window, body.query)
            if decode.grammar is not None:  # the first grammar's tokenizer view (up to a second), not in a batch
                state.engine.grammar_tokens.prepare()
            return state.engine.chat_prompts(messages, decode, documents=documents, query=body.query,
                                             recent_messages=recent, raw=not chat,
                                             retriever=state.retriever_for(retrieval), tools=tools)

        characters = sum(map(len, documents)) + sum(len(m.content) for m in messages) + len(body.query or "")
        large = characters >= BACKGROUND_PREPARE_CHARACTERS  # its retrieval may embed for seconds
        job = state.worker.admit()  # 429 when the line is full; preparing requests count
        try:
            prompts = await self._prepare(job, request, prepare, state.background_preparer if large else state.preparer)
        except _Cancelled:
            state.metrics.failed("cancelled")
            return Response(status_code=204)
        except BaseException:
            job.cancel()
            raise
        decode = self._time_left(job, decode, time.perf_counter() - arrived)

        def work(emit, cancelled):  # a generator: the worker runs it a step at a time
            emit("ready", None)
            yield
            pieces = PrefillPieces(config.shared_prefill_tokens, state.worker.crowded)  # a prefill in short steps
            stream = state.engine.decode(prompts, decode, should_stop=cancelled.is_set, yield_prefill_chunks=True,
                                         prefill_chunk_limit=pieces)
            try:
                for chunk in stream:  # one prefill chunk or one round per step
                    if cancelled.is_set():
                        return
                    if chunk.text or chunk.token_ids or chunk.output is not None or chunk.prefill is not None:
                        emit("chunk", chunk)
                    yield
            except PrefillStopped:  # cancelled between two prefill chunks
                return
            finally:
                stream.close()

        state.worker.run(job, work, tokens=len(prompts.target_ids) + decode.max_new_tokens)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        trace = bool(body.trace and body.stream)
        reply = Reply(chat, config.model_name, include_usage,
                      state.pieces if decode.logprobs is not None or trace else None,
                      tools=tools.names if tools is not None and tools.calls_expected else None, trace=trace)
        try:
            kind, payload = await self._next_event(job, request)  # "ready" once the job has a slot
        except _Cancelled:
            state.metrics.failed("cancelled")
            return Response(status_code=204)
        if kind == "error":
            raise payload
        if kind == "end":
            return self._shutting_down()
        if body.stream:
            return EventStream(self._stream_events(job, request, reply, arrived), lambda: self._left(job))
        return await self._complete(job, request, reply, arrived)

    async def _prepare(self, job: Job, request: Request, prepare, pool):
        """``prepare()`` (size check, retrieval, prompts) on ``pool``'s threads; _Cancelled when the client left."""
        future = asyncio.get_running_loop().run_in_executor(pool, prepare)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # an abandoned one's error is not logged
        while True:
            done, _ = await asyncio.wait({future}, timeout=self.state.config.disconnect_poll_seconds)
            if done:
                return future.result()
            if await request.is_disconnected():
                job.cancel()
                raise _Cancelled()

    @staticmethod
    def _time_left(job: Job, decode, spent: float):
        """``decode`` with the request's time limit less the seconds its preparation took."""
        if decode.time_limit_s is None:
            return decode
        left = decode.time_limit_s - spent
        if left <= 0:
            job.cancel()
            raise RapidspecError(f"preparing the prompts (size check, retrieval) took {spent:.1f} s, more than the "
                                 f"server's time limit of {decode.time_limit_s:g} s per request",
                                 code="time_limit_exceeded")
        return decode.with_(time_limit_s=left)

    async def _complete(self, job: Job, request: Request, reply: Reply, arrived: float):
        output = None
        try:
            first = True
            while (event := await self._next_event(job, request))[0] == "chunk":
                if first and (event[1].text or event[1].token_ids):
                    self._observe_first_token(arrived)
                    first = False
                output = event[1].output or output
        except _Cancelled:
            self.state.metrics.failed("cancelled")
            return Response(status_code=204)
        if event[0] == "error":
            raise event[1]
        if output is None:
            return self._shutting_down()
        self._record_finish(job, output, arrived)
        # built and rendered off the event loop (thousands of log-probabilities), as plain json.dumps
        return await asyncio.to_thread(lambda: JSONResponse(reply.complete(output)))

    def _left(self, job: Job) -> None:
        """The client left before its stream sent anything: stop the job and count the request."""
        job.cancel()
        self.state.metrics.failed("cancelled")

    def _shutting_down(self) -> JSONResponse:
        self.state.metrics.failed("cancelled")
        return error_response(503, "the server is shutting down", "server_error", None, "shutting_down")

    async def _stream_events(self, job: Job, request: Request, reply: Reply, arrived: float):
        first, finished, failed = True, False, False
        progress = PrefillProgress()
        try:
            yield sse(reply.chunk(role=True) if reply.chat else reply.chunk(text=""))
            while True:
                kind, payload = await self._next_event(job, request)
                if kind == "error":
                    failed = True
                    yield sse(failure(payload, self.state.metrics)[1])
                    break
                if kind != "chunk":
                    break
                if payload.prefill is not None:  # a comment line: clients skip it, a person watching reads it
                    yield progress.comment(*payload.prefill)
                    continue
                if first and (payload.text or payload.token_ids):
                    self._observe_first_token(arrived)
                    first = False
                text = reply.content_of(payload.text)  # a tool call's text is not content
                traced = reply.trace and bool(payload.token_ids)
                if text or (payload.logprobs and reply.pieces) or traced:
                    extra = {"rapidspec": reply.trace_of(payload)} if traced else {}
                    yield sse(reply.chunk(text=text, logprobs=payload.logprobs, **extra))
                if payload.output is not None:
                    self._record_finish(job, payload.output, arrived)
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
                    self.state.metrics.failed("cancelled")

    async def _next_event(self, job: Job, request: Request) -> tuple[str, object]:
        """The job's next event; raises _Cancelled (and cancels the job) when the client has gone.

        The client is asked at least every ``disconnect_poll_seconds``, also while events keep coming.
        """
        poll = self.state.config.disconnect_poll_seconds
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), poll)
            except asyncio.TimeoutError:
                event = None
            now = time.monotonic()
            if event is None or now - job.checked >= poll:
                job.checked = now
                if await request.is_disconnected():
                    job.cancel()
                    raise _Cancelled()
            if event is not None:
                return event

    def _observe_first_token(self, arrived: float) -> None:
        self.state.metrics.time_to_first_token.labels(self.state.config.model_name).observe(time.perf_counter() - arrived)

    def _record_finish(self, job: Job, output, arrived: float) -> None:
        metrics, name = self.state.metrics, self.state.config.model_name
        metrics.e2e_latency.labels(name).observe(time.perf_counter() - arrived)
        if job.started is not None:
            metrics.queue_time.labels(name).observe(job.started - job.submitted)
        metrics.finished(output.stats, FINISH_REASONS[output.stats.stop_reason])
