"""OpenAI-format bodies: completions, stream chunks, usage and errors.

Every response and the last stream chunk carry the generation's statistics
 in one extra field, ``rapidspec``: mode, timings,
acceptance, mean accepted length, prefill reuse, retrieved chunks with their
spans and, for conversations, the retrieved turns.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi.responses import JSONResponse

from rapidspec.outputs import GenerationOutput

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


class Reply:
    """The shape of one request's answer: chat (``chat.completion``) or text (``text_completion``)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _body(self, object_name: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def complete(self, output: GenerationOutput) -> dict:
        finish_reason = FINISH_REASONS[output.stats.stop_reason]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": output.text},
                      "finish_reason": finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": output.text, "finish_reason": finish_reason, "logprobs": None}
        return self._body("chat.completion" if self.chat else "text_completion", [choice],
                          usage=usage(output), rapidspec=statistics(output))

    def chunk(self, text: str | None = None, role: bool = False, finish_reason: str | None = None, **extra) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return self._body("chat.completion.chunk", [choice], **extra)
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        return self._body("text_completion", [choice], **extra)

    def last_chunks(self, output: GenerationOutput, include_usage: bool) -> list[dict]:
        """The chunk with the finish reason and statistics, then the usage chunk if asked for."""
        chunks = [self.chunk(finish_reason=FINISH_REASONS[output.stats.stop_reason], rapidspec=statistics(output))]
        if include_usage:
            chunks.append(self._body(chunks[0]["object"], [], usage=usage(output)))
        return chunks


def usage(output: GenerationOutput) -> dict:
    prompt, completion = output.stats.prompt_tokens_target, output.stats.new_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.stats.target_prefill_reused_tokens}}


def statistics(output: GenerationOutput) -> dict:
    out = output.to_dict()
    del out["text"]
    return out


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)
