"""OpenAI-format bodies: completions, stream chunks, usage and errors.

Every response and the last stream chunk carry the generation's statistics
in one extra field, ``rapidspec``: mode, timings, acceptance, mean accepted
length, prefill reuse, retrieved chunks with their spans and, for
conversations, the retrieved turns. With tools, calls in the answer come back
as OpenAI ``tool_calls`` (finish reason ``tool_calls``; streamed as one delta
per call after the content, :mod:`rapidspec.grammar.tools`). Log-probabilities take OpenAI's two
shapes: chat (``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``)
and text completions (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``).
"""

from __future__ import annotations

import codecs
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi.responses import JSONResponse, StreamingResponse

from rapidspec.grammar.tools import ToolTextFilter, parse_tool_calls
from rapidspec.outputs import GenerationOutput, token_kinds

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "time": "length"}


class Reply:
    """The shape of one request's answer: chat (``chat.completion``) or text (``text_completion``)."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False, pieces=None,
                 tools: list[str] | None = None, trace: bool = False) -> None:
        """``include_usage``: every stream chunk has ``usage`` (null until the last); ``pieces``
        (a :class:`~rapidspec.server.tokens.TokenPieces`) when log-probabilities or the trace were asked for;
        ``tools``: the names of the functions the answer may call; ``trace``: each stream chunk tells how its
        tokens came (:meth:`trace_of`)."""
        self.chat = chat
        self.trace = trace
        self._rounds = 0
        self._tool_names = tools
        self._tool_text = ToolTextFilter() if tools else None
        self.model = model
        self.include_usage = include_usage
        self.pieces = pieces
        self._offset = 0  # characters of text before the next token (text completions' text_offset)
        self._characters = codecs.getincrementaldecoder("utf-8")("replace")  # a split character counts once whole
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _body(self, object_name: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _calls(self, output: GenerationOutput) -> tuple[str | None, list[dict]]:
        """The answer's content and tool calls (none unless the request has tools)."""
        if self._tool_text is None:
            return output.text, []
        return parse_tool_calls(output.text, self._tool_names)

    def _finish_reason(self, output: GenerationOutput, calls: list) -> str:
        """``tool_calls`` when the answer ended with calls; ``length`` when it was cut (its whole calls kept)."""
        reason = FINISH_REASONS[output.stats.stop_reason]
        return "tool_calls" if calls and reason == "stop" else reason

    def content_of(self, text: str) -> str:
        """The part of a streamed piece of answer that is content (a tool call's text is held back)."""
        return text if self._tool_text is None else self._tool_text.feed(text)

    def complete(self, output: GenerationOutput) -> dict:
        content, calls = self._calls(output)
        finish_reason = self._finish_reason(output, calls)
        logprobs = self.logprobs(output.logprobs or ())
        if self.chat:
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choice = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": output.text, "finish_reason": finish_reason, "logprobs": logprobs}
        return self._body("chat.completion" if self.chat else "text_completion", [choice],
                          usage=usage(output), metrics=metrics(output), rapidspec=statistics(output))

    def chunk(self, text: str | None = None, role: bool = False, finish_reason: str | None = None,
              logprobs=(), tool_calls: list | None = None, **extra) -> dict:
        if self.include_usage:
            extra = {"usage": None, **extra}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            if tool_calls:
                delta = {"tool_calls": tool_calls}
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": self.logprobs(logprobs)}
            return self._body("chat.completion.chunk", [choice], **extra)
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": self.logprobs(logprobs)}
        return self._body("text_completion", [choice], **extra)

    def trace_of(self, chunk) -> dict:
        """The ``rapidspec`` extension of a stream chunk asked for with ``trace``: the round that emitted its tokens
        (number, drafts, accepted, drafting and verifying milliseconds) and each token's text and kind
        (:func:`rapidspec.outputs.token_kinds`)."""
        self._rounds += 1
        record = chunk.round
        tokens = [{"text": text, "kind": kind}
                  for text, kind in zip(self.pieces.texts(chunk.token_ids), token_kinds(chunk))]
        round_ = {"index": self._rounds, "drafted": 0, "accepted": 0, "draft_ms": 0.0, "verify_ms": 0.0}
        if record is not None:
            round_.update(drafted=record.drafted, accepted=record.accepted,
                          draft_ms=round(record.draft_seconds * 1e3, 3), verify_ms=round(record.verify_seconds * 1e3, 3))
        return {"round": round_, "tokens": tokens}

    def last_chunks(self, output: GenerationOutput) -> list[dict]:
        """Held-back content or the tool calls, the chunk with the finish reason and statistics, then the usage
        chunk if asked for."""
        _, calls = self._calls(output)  # the content was streamed already (or is held, below)
        chunks = []
        held = "" if self._tool_text is None else self._tool_text.flush()
        if held and not calls:
            chunks.append(self.chunk(text=held))
        chunks += [self.chunk(tool_calls=[{"index": i, **call}]) for i, call in enumerate(calls)]
        chunks.append(self.chunk(finish_reason=self._finish_reason(output, calls), metrics=metrics(output),
                                 rapidspec=statistics(output)))
        if self.include_usage:
            chunks.append(self._body(chunks[-1]["object"], [], usage=usage(output), metrics=metrics(output)))
        return chunks

    def logprobs(self, entries) -> dict | None:
        """OpenAI's ``logprobs`` of these tokens (TokenLogprob), or None when they were not asked for."""
        if self.pieces is None or not entries:
            return None
        ids = [e.token_id for e in entries]
        texts = self.pieces.texts(ids)
        tops = [self.pieces.texts([t for t, _ in e.top]) for e in entries]
        if self.chat:
            top_bytes = [self.pieces.bytes_of([t for t, _ in e.top]) for e in entries]
            return {"content": [
                {"token": text, "logprob": e.logprob, "bytes": list(raw),
                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for t, b, (_, v) in zip(top, braw, e.top)]}
                for text, raw, e, top, braw in zip(texts, self.pieces.bytes_of(ids), entries, tops, top_bytes)]}
        offsets = []
        for raw in self.pieces.bytes_of(ids):
            offsets.append(self._offset)
            self._offset += len(self._characters.decode(raw))
        return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t: v for t, (_, v) in zip(top, e.top)} for e, top in zip(entries, tops)],
                "text_offset": offsets}


def usage(output: GenerationOutput) -> dict:
    prompt, completion = output.stats.prompt_tokens_target, output.stats.new_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.stats.target_prefill_reused_tokens}}


def metrics(output: GenerationOutput) -> dict:
    """vLLM's per-request ``metrics`` object: the speculative decoding counts (:meth:`GenerationStats.speculative_decoding`)."""
    return {"speculative_decoding": output.stats.speculative_decoding()}


def statistics(output: GenerationOutput) -> dict:
    out = output.to_dict()
    del out["text"]
    return out


class PrefillProgress:
    """A stream's comment lines while the target reads the prompt: ``: prefill 4096/32150 tokens, 180 tokens/s,
    156 s left`` (the rate from the second line on). Server-sent-event comments: OpenAI's clients skip them."""

    def __init__(self) -> None:
        self._first: tuple[float, int] | None = None  # (time, tokens held) at the first line

    def comment(self, done: int, total: int) -> str:
        now, line = time.perf_counter(), f": prefill {done}/{total} tokens"
        if self._first is None:
            self._first = (now, done)
        elif now > self._first[0] and done > self._first[1]:
            rate = (done - self._first[1]) / (now - self._first[0])
            line += f", {rate:.0f} tokens/s, {(total - done) / rate:.0f} s left"
        return line + "\n\n"


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


class EventStream(StreamingResponse):
    """Server-sent ``events`` whose end is always handled: ``unsent()`` runs when the client left before the
    first event was asked for, so the events' generator never ran and its own ``finally`` (cancel the job,
    count the request) could not. A generator that did run is closed when the response ends, at once, not
    whenever it is collected."""

    def __init__(self, events: AsyncIterator[str], unsent: Callable[[], None]) -> None:
        self._events, self._unsent, self._began = events, unsent, False
        super().__init__(self._tracked(), media_type="text/event-stream")

    async def _tracked(self) -> AsyncIterator[str]:
        self._began = True
        try:
            async for event in self._events:
                yield event
        finally:
            await self._events.aclose()

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            if not self._began:
                self._unsent()
