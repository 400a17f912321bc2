"""Request bodies of the OpenAI-compatible routes, and their mapping onto the configs.

Standard OpenAI fields keep their names (``max_tokens``, ``stop``, ``seed``,
``temperature``, ``top_p``, ``n``, ``stream``, ``stream_options``); RAPID's
options are extra top-level fields with the CLI's names (``mode``, ``eta``,
``gamma``, ``draft_confidence``, ``top_k``, ``ignore_eos``, ``retrieval``,
``budget_tokens``, ...), which the ``openai`` client sends with
``extra_body``. A field left out or sent as ``null`` takes the server's default (the options
``rapidspec serve`` was started with). Unknown fields are refused, so a
misspelt option never goes unnoticed; a few OpenAI fields that change nothing
here (``user``, ``metadata``, ``store``...) are accepted and ignored.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rapidspec.config import DecodeConfig
from rapidspec.errors import RapidspecError
from rapidspec.retrieval import METHODS, RetrievalConfig

_DECODE_FIELDS = {f.name for f in fields(DecodeConfig)}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # accepted, no effect here
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    frequency_penalty: float | None = Field(default=None, ge=0, le=0)
    presence_penalty: float | None = Field(default=None, ge=0, le=0)
    logprobs: Literal[False] | None = None
    # RAPID (DecodeConfig)
    mode: Literal["lc", "rag", "sd", "ragsd", "rapid", "magicdec", "lookup"] | None = None
    eta: float | None = Field(default=None, ge=0)
    gamma: int | None = Field(default=None, ge=1)
    gamma_schedule: Literal["constant", "heuristic", "cost"] | None = None
    max_gamma: int | None = Field(default=None, ge=1)
    draft_confidence: float | None = Field(default=None, ge=0, lt=1)
    top_k: int | None = Field(default=None, ge=0)
    draft_gate: float | None = Field(default=None, ge=0, le=1)
    residual: Literal["exact", "paper"] | None = None
    ignore_eos: bool | None = None
    truncate: Literal["middle", "error"] | None = None
    sink_tokens: int | None = Field(default=None, ge=0)
    streaming_tokens: int | None = Field(default=None, ge=1)
    drafter_backend: Literal["auto", "torch", "llama.cpp"] | None = None
    # where the drafter's context comes from (RetrievalConfig and the conversation)
    documents: list[str | dict[str, Any]] | None = None
    query: str | None = None
    recent_messages: int | None = Field(default=None, ge=0)
    retrieval: Literal[METHODS] | None = None  # type: ignore[valid-type]
    budget_tokens: int | None = Field(default=None, ge=1)
    chunk_tokens: int | None = Field(default=None, ge=1)

    def decode_config(self, base: DecodeConfig) -> DecodeConfig:
        """``base`` with the fields this request sets (RapidspecError when they do not combine)."""
        if self.n not in (None, 1):
            raise RapidspecError("only n = 1 is supported", param="n")
        # null means "the default", as OpenAI clients send it
        changes = {name: getattr(self, name) for name in self.model_fields_set & _DECODE_FIELDS
                   if getattr(self, name) is not None}
        max_tokens = self.max_completion_tokens or self.max_tokens
        if max_tokens is not None:
            changes["max_new_tokens"] = max_tokens
        if self.stop is not None:
            changes["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if "mode" in changes and changes["mode"] != "rapid" and "eta" not in changes:
            changes["eta"] = None  # the server's default eta belongs to rapid
        try:
            return base.with_(**changes)
        except RapidspecError as err:
            field = str(err).split(" ")[0]
            raise RapidspecError(str(err), param=field if field in changes else None) from None

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


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]

    def prompt_text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise RapidspecError("only one prompt per request is supported", param="prompt")
            return self.prompt[0]
        return self.prompt
