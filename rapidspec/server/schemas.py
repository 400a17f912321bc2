"""Request bodies of the OpenAI-compatible routes, and their mapping onto the configs.

Standard OpenAI fields keep their names (``max_tokens``, ``stop``, ``seed``,
``temperature``, ``top_p``, ``n``, ``stream``, ``stream_options``); RAPID's
options are extra top-level fields with the CLI's names (``mode``, ``eta``,
``gamma``, ``draft_confidence``, ``top_k``, ``ignore_eos``, ``retrieval``,
``budget_tokens``, ...), which the ``openai`` client sends with
``extra_body``. A field left out or sent as ``null`` takes the server's default (the options
``rapidspec serve`` was started with). ``response_format`` (``json_object``,
``json_schema``) becomes the config's grammar; chat's ``tools``,
``tool_choice`` and ``parallel_tool_calls`` a
:class:`~rapidspec.grammar.tools.ToolChoice`. OpenAI fields rapidspec does not
implement (:data:`UNSUPPORTED`: ``functions``, ``n > 1``...) are refused with a 400
naming the field; fields nobody defines are ignored with a warning in the
server's log (as vLLM does), so vendor extras do not break clients.
"""

from __future__ import annotations

import json
from dataclasses import fields, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rapidspec.config import (DRAFTER_BACKENDS, DRAFTER_STARTS, GAMMA_SCHEDULES, MAX_ETA, MAX_TEMPERATURE, MODES, RESIDUALS,
                              TRUNCATIONS, DecodeConfig)
from rapidspec.errors import RapidspecError
from rapidspec.grammar import Grammar
from rapidspec.grammar.tools import ToolChoice
from rapidspec.retrieval import METHODS, RetrievalConfig

# What a request may set directly (the server's own limits, max_model_len and time_limit_s, are not among them).
_DECODE_FIELDS = {f.name for f in fields(DecodeConfig)} - {"max_model_len", "time_limit_s", "logprobs"}

#: OpenAI fields rapidspec does not implement, and when a value asks for them (a 400 naming the field).
UNSUPPORTED = {
    "functions": lambda v: v is not None, "function_call": lambda v: v not in (None, "none"),
    "logit_bias": lambda v: bool(v),
    "n": lambda v: v not in (None, 1), "best_of": lambda v: v not in (None, 1), "echo": lambda v: bool(v),
    "suffix": lambda v: bool(v), "audio": lambda v: v is not None,
    "modalities": lambda v: v not in (None, ["text"]), "prediction": lambda v: v is not None,
}
#: Unknown field names the server's log line shows (each cut to ``_NAME_CHARS``, escaped).
_LOGGED_NAMES, _NAME_CHARS = 8, 40


def invalid_text_path(data: Any) -> str | None:
    """The path (``messages[0].content``) of the first string or key in ``data`` that is not valid UTF-8.

    JSON may spell lone surrogates (``"\\ud800"``, or the raw bytes ED A0 80, which Python's decoder
    accepts); no tokenizer can encode them. A valid body costs one C-speed ``json.dumps``; the walk that
    names the path (without recursion: bodies may nest deeply) runs only when that finds something.
    """
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return None
    except (UnicodeEncodeError, TypeError, ValueError, RecursionError):
        pass  # a lone surrogate somewhere, or a body json cannot write back: walk it
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _utf8(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not _utf8(key):
                    return path or "body"
                stack.append((where, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return None


def _utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class RequestBody(BaseModel):
    """Every route's body: text that is not valid UTF-8 is a 400 naming its field, before anything reads it."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        path = invalid_text_path(data)
        if path is not None:
            raise RapidspecError(f"{path[:200]}: the text is not valid UTF-8 (it holds a lone surrogate)",
                                 param=path[:200], code="invalid_text")
        return data

    @property
    def unknown_fields(self) -> list[str]:
        """Fields no schema defines (ignored; the server logs them)."""
        return sorted(self.model_extra or {})

    def unknown_fields_note(self) -> str:
        """The unknown fields for one log line: bounded, each name escaped (no newline can forge a record)."""
        names = self.unknown_fields
        shown = ", ".join(ascii(name[:_NAME_CHARS]) for name in names[:_LOGGED_NAMES])
        return f"{len(names)} ({shown}{', ...' if len(names) > _LOGGED_NAMES else ''})"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None


class GenerationRequest(RequestBody):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1)
    best_of: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # accepted, no effect here
    user: str | None = None
    prompt_cache_key: str | None = None  # with user, what keeps a conversation on one replica (scale.affinity)
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    response_format: dict[str, Any] | None = None
    # OpenAI fields refused when used (UNSUPPORTED)
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    # RAPID (DecodeConfig)
    mode: Literal[MODES] | None = None  # type: ignore[valid-type]
    eta: float | None = Field(default=None, ge=0, le=MAX_ETA)
    gamma: int | None = Field(default=None, ge=1)
    gamma_schedule: Literal[GAMMA_SCHEDULES] | None = None  # type: ignore[valid-type]
    max_gamma: int | None = Field(default=None, ge=1)
    drafter_start: Literal[DRAFTER_STARTS] | None = None  # type: ignore[valid-type]
    draft_confidence: float | None = Field(default=None, ge=0, lt=1)
    top_k: int | None = Field(default=None, ge=0)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)  # OpenAI's, along drafted paths too
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)  # vLLM's and transformers'
    draft_gate: float | None = Field(default=None, ge=0, le=1)
    residual: Literal[RESIDUALS] | None = None  # type: ignore[valid-type]
    ignore_eos: bool | None = None
    truncate: Literal[TRUNCATIONS] | None = None  # type: ignore[valid-type]
    sink_tokens: int | None = Field(default=None, ge=0)
    streaming_tokens: int | None = Field(default=None, ge=1)
    drafter_backend: Literal[DRAFTER_BACKENDS] | None = None  # type: ignore[valid-type]
    # where the drafter's context comes from (RetrievalConfig and the conversation)
    documents: list[str | dict[str, Any]] | None = None
    query: str | None = None
    recent_messages: int | None = Field(default=None, ge=0)
    retrieval: Literal[METHODS] | None = None  # type: ignore[valid-type]
    budget_tokens: int | None = Field(default=None, ge=1)
    chunk_tokens: int | None = Field(default=None, ge=1)
    # streaming only: each chunk's "rapidspec" field tells how its tokens came (Reply.trace_of)
    trace: bool | None = None

    def logprobs_count(self) -> int | None:
        """DecodeConfig.logprobs: None = off, else how many most likely tokens to report per position."""
        return None

    def decode_config(self, base: DecodeConfig) -> DecodeConfig:
        """``base`` with the fields this request sets (RapidspecError when they do not combine)."""
        for name, used in UNSUPPORTED.items():
            if used(getattr(self, name, None)):
                raise RapidspecError(f"{name} is not supported by rapidspec (it generates plain text, one choice "
                                     "per request)", param=name, code="unsupported_field")
        if self.stream_options is not None and not self.stream:
            raise RapidspecError("stream_options is only allowed when stream is true", param="stream_options")
        # null means "the default", as OpenAI clients send it; unknown fields (max_new_tokens...) change nothing
        declared = self.model_fields_set & _DECODE_FIELDS & set(type(self).model_fields)
        changes = {name: getattr(self, name) for name in declared if getattr(self, name) is not None}
        max_tokens = self.max_completion_tokens or self.max_tokens
        if max_tokens is not None:
            changes["max_new_tokens"] = max_tokens
        if self.stop is not None:
            changes["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if "mode" in changes and changes["mode"] != "rapid" and "eta" not in changes:
            changes["eta"] = None  # the server's default eta belongs to rapid
        changes["logprobs"] = self.logprobs_count()
        if self.response_format is not None:
            changes["grammar"] = Grammar.of(self.response_format)  # a 400 naming response_format when it is bad
        try:
            return base.with_(**changes)
        except RapidspecError as err:
            field = str(err).split(" ")[0]
            max_tokens_field = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
            param = max_tokens_field if field == "max_new_tokens" else field if field in changes else None
            raise RapidspecError(str(err), param=param) from None

    def retrieval_config(self, base: RetrievalConfig) -> RetrievalConfig:
        changes = {"method": self.retrieval, "budget_tokens": self.budget_tokens, "chunk_tokens": self.chunk_tokens}
        changes = {k: v for k, v in changes.items() if v is not None}
        if not changes:
            return base
        try:
            return replace(base, **changes)
        except RapidspecError as err:
            raise RapidspecError(str(err), param=next(iter(changes))) from None


class ChatCompletionRequest(GenerationRequest):
    messages: list[Any]
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def tool_choice_of(self) -> ToolChoice | None:
        """The request's tools (None without), validated (a 400 naming the field)."""
        return ToolChoice.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RapidspecError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None
    suffix: str | None = None

    def tool_choice_of(self) -> None:
        """Text completions have no tools (OpenAI's neither): sending them is a 400."""
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if (self.model_extra or {}).get(name) is not None:
                raise RapidspecError(f"{name} belongs to /v1/chat/completions", param=name, code="unsupported_field")
        return None

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise RapidspecError("only one prompt per request is supported", param="prompt")
            return self.prompt[0]
        return self.prompt


class TokenizeRequest(RequestBody):
    """``POST /tokenize`` (vLLM's shape): a prompt, or messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False

    def model_post_init(self, context: Any) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RapidspecError("send either prompt or messages", param="prompt")


class DetokenizeRequest(RequestBody):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)
