"""OpenAI tool calls through the model's own chat template (the ``<tool_call>`` format of Qwen2.5 and Hermes).

A request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` become a
:class:`ToolChoice`. The tools go into the prompt through the model's chat
template (``apply_chat_template(..., tools=...)``), which tells the model to
answer with::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``auto`` lets the model choose between text and calls; ``required`` and a
named function constrain the answer with a grammar (:meth:`ToolChoice.grammar`):
one call (or several, with ``parallel_tool_calls``) whose arguments follow the
function's JSON schema, drafts included. :func:`parse_tool_calls` turns the
answer into OpenAI ``tool_calls``; :class:`ToolTextFilter` keeps a streamed
answer's call text out of its ``content``. A template without tools, or with
tools in another format, is refused (:func:`check_template`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from rapidspec.errors import RapidspecError
from rapidspec.grammar.spec import JSON_OPTIONS, Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")  # a Markdown code fence around a bare call
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True)
class ToolChoice:
    """The request's functions (JSON text of OpenAI's ``tools``), ``choice`` and ``parallel`` calls.

    ``choice``: ``auto``, ``none``, ``required`` or a function's name.
    """

    tools_json: str
    choice: str = "auto"
    parallel: bool = True

    @property
    def tools(self) -> list[dict]:
        return json.loads(self.tools_json)

    @property
    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]

    @property
    def calls_expected(self) -> bool:
        """Whether the answer may hold calls (everything but ``none``)."""
        return self.choice != "none"

    @classmethod
    def of(cls, tools, tool_choice=None, parallel_tool_calls=None) -> "ToolChoice | None":
        """Validated from OpenAI's fields (RapidspecError naming the field); None when no tools are given."""
        if tools is None:
            if tool_choice not in (None, "none", "auto"):
                raise RapidspecError("tool_choice needs tools", param="tool_choice")
            return None
        if not isinstance(tools, list) or not tools:
            raise RapidspecError("tools must be a non-empty list", param="tools")
        names = []
        for index, tool in enumerate(tools):
            where = f"tools[{index}]"
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
                raise RapidspecError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", param=where)
            function = tool["function"]
            name = function.get("name")
            if not isinstance(name, str) or not _NAME.match(name):
                raise RapidspecError(f"{where}.function.name must be 1-64 letters, digits, _ or -", param=f"{where}.function.name")
            if name in names:
                raise RapidspecError(f"{where}: two tools are named {name!r}", param=f"{where}.function.name")
            parameters = function.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(parameters, dict):
                raise RapidspecError(f"{where}.function.parameters must be a JSON schema object",
                                     param=f"{where}.function.parameters")
            try:
                Grammar.json_schema(parameters)
            except RapidspecError as err:
                raise RapidspecError(f"{where}.function.parameters: {err}", param=f"{where}.function.parameters") from None
            names.append(name)
        choice = _choice(tool_choice, names)
        parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
        return cls(json.dumps(tools, ensure_ascii=False), choice, parallel)

    def grammar(self, tokenizer) -> Grammar | None:
        """The grammar of a ``required`` or named choice's answer: calls only, arguments by their schemas.

        ``tokenizer``: where ``<tool_call>`` is one token of its own (Qwen2.5), the grammar names that token.
        """
        if self.choice in ("auto", "none"):
            return None
        functions = [tool["function"] for tool in self.tools if self.choice in ("required", tool["function"]["name"])]
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                   "arguments": f.get("parameters", {"type": "object"})},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
        body = {"anyOf": calls} if len(calls) > 1 else calls[0]
        body["x-guidance"] = JSON_OPTIONS
        repeat = ' ("\\n" call)*' if self.parallel and self.choice == "required" else ""
        lark = (f"start: call{repeat}\n"
                f"call: {_marker(tokenizer, OPEN)} \"\\n\" body \"\\n\" {_marker(tokenizer, CLOSE)}\n"
                f"body: %json {json.dumps(body)}\n")
        return Grammar.lark(lark)


def _marker(tokenizer, text: str) -> str:
    """``text`` in Lark: its token (``<[id]>``) when the tokenizer has it as an added token of its own (Qwen2.5's
    ``<tool_call>``; llguidance matches added tokens only by id), else the literal text."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return f"<[{added[text]}]>" if text in added else json.dumps(text)


def _choice(tool_choice, names: list[str]) -> str:
    if tool_choice is None:
        return "auto"
    if tool_choice in ("auto", "none", "required"):
        return tool_choice
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if name in names:
            return name
        raise RapidspecError(f"tool_choice names function {name!r}, which is not among the tools", param="tool_choice")
    raise RapidspecError("tool_choice must be auto, none, required or {\"type\": \"function\", \"function\": "
                         "{\"name\": ...}}", param="tool_choice")


def check_template(tokenizer) -> None:
    """RapidspecError (a 400) unless the model's chat template lays out tools in the ``<tool_call>`` format."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str) or "tools" not in template:
        raise RapidspecError("this model's chat template has no tools, so it cannot call functions: serve a model "
                             "whose template has them (Qwen2.5, e.g. builtin:qwen2.5-coder-0.5b)", param="tools")
    if OPEN not in template:
        raise RapidspecError(f"this model's chat template calls tools in a format other than {OPEN} JSON {CLOSE}, "
                             "which rapidspec does not read", param="tools")


def template_tokenizer(tokenizer, tools: ToolChoice | None):
    """``tokenizer``, or its chat template with ``tools`` laid out when the answer may call them (checked)."""
    if tools is None or not tools.calls_expected:
        return tokenizer
    check_template(tokenizer)
    return TemplateWithTools(tokenizer, tools.tools)


def with_tool_grammar(config, tools: ToolChoice | None, tokenizer):
    """``config`` (a DecodeConfig) constrained to tool calls when ``tools`` requires them (``required`` or a
    named function); RapidspecError when its ``grammar`` (``response_format``) constrains it already."""
    grammar = None if tools is None else tools.grammar(tokenizer)
    if grammar is None:
        return config
    if config.grammar is not None:
        raise RapidspecError(f"tool_choice {tools.choice!r} constrains the answer to tool calls: it cannot be "
                             "combined with response_format", param="tool_choice")
    return config.with_(grammar=grammar)


class TemplateWithTools:
    """A tokenizer whose chat template also lays out ``tools`` (everything else is the tokenizer's own)."""

    def __init__(self, tokenizer, tools: list[dict]) -> None:
        self._tokenizer, self._tools = tokenizer, tools

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, messages, **kwargs):
        return self._tokenizer.apply_chat_template(messages, tools=self._tools, **kwargs)


def parse_tool_calls(text: str, names: list[str] | None = None) -> tuple[str | None, list[dict]]:
    """The answer's content before its first call (None when empty) and its calls as OpenAI ``tool_calls``.

    Calls are ``<tool_call>`` blocks; with ``names`` (the request's functions), an answer that is nothing but
    one call's JSON (small models drop the tags) is a call too. A block that is not JSON with a ``name`` and
    object ``arguments`` stays text (an answer cut by ``max_tokens`` mid-call is text, as the model wrote it).
    """
    calls, first = [], None
    for match in _CALL.finditer(text):
        call = _call_of(match.group(1))
        if call is not None:
            first = match.start() if first is None else first
            calls.append(call)
    if not calls and names:
        bare = _call_of(_FENCE.sub("", text.strip()))
        if bare is not None and bare["function"]["name"] in names:
            return None, [bare]
    if not calls:
        return text, []
    content = text[:first].strip()
    return content or None, calls


def _call_of(text: str) -> dict | None:
    """An OpenAI tool call from ``{"name": ..., "arguments": {...}}`` text, None when it is not one."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _object_or_none(arguments)
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _object_or_none(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class ToolTextFilter:
    """Streams an answer's text until a tool call starts; holds back what may be the start of ``<tool_call>``, and
    a whole answer that opens like a bare call (``{`` or a code fence), until the end tells which it was."""

    def __init__(self) -> None:
        self._held = ""
        self._started = False  # some content was streamed: the answer is not a bare call
        self.calling = False

    def feed(self, text: str) -> str:
        """The part of ``text`` that is surely content (nothing once a call has started)."""
        if self.calling:
            return ""
        text = self._held + text
        at = text.find(OPEN)
        if at >= 0:
            self.calling, self._held = True, ""
            return text[:at].rstrip()
        opening = text.lstrip()
        if not self._started and (not opening or opening[0] in "{`"):
            self._held = text  # maybe a bare call: wait for the end
            return ""
        keep = next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-n:])), 0)
        self._held = text[len(text) - keep :]
        self._started = self._started or keep < len(text)
        return text[: len(text) - keep]

    def flush(self) -> str:
        """What was held back, once the answer has ended without a call."""
        held, self._held = ("" if self.calling else self._held), ""
        return held
