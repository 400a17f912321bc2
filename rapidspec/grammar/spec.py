"""What an answer must match: a JSON schema, any JSON object, a Lark grammar or a regular expression.

:class:`Grammar` is the frozen, hashable description a
:class:`~rapidspec.config.DecodeConfig` carries (its ``grammar`` field); it
is compiled by llguidance (a maintained grammar engine, Microsoft's Rust
library behind Guidance) and validated on construction, so a bad schema is a
one-line :class:`RapidspecError` (a 400 from the server) before anything runs.

Ways to make one::

    Grammar.of({"type": "json_object"})                                  # OpenAI's response_format
    Grammar.of({"type": "json_schema", "json_schema": {"name": "x", "schema": {...}, "strict": True}})
    Grammar.of(MyPydanticModel)                                          # its JSON schema
    Grammar.json_schema({"type": "object", "properties": {...}})         # a bare JSON schema
    Grammar.lark('start: "yes" | "no"'), Grammar.regex(r"\\d{4}-\\d{2}")

JSON is written compactly, as OpenAI's models write it: ``{"a": 1, "b": [2, 3]}``
(``", "`` and ``": "``, no other whitespace), so a small model cannot pad an
answer with endless blank lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from rapidspec.errors import RapidspecError

GrammarKind = Literal["json_object", "json_schema", "lark", "regex"]
#: How llguidance writes JSON here (see the module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: Largest grammar text accepted (a schema of a few thousand properties fits).
MAX_GRAMMAR_CHARS = 1 << 20


@dataclass(frozen=True)
class Grammar:
    """A constraint on the answer: ``kind`` and its ``source`` (the JSON text of a schema, Lark or regex text).

    ``name``: the schema's name (OpenAI's ``json_schema.name``), for messages.
    ``llguidance`` holds the compiled grammar text (derived, not compared).
    """

    kind: GrammarKind
    source: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("json_object", "json_schema", "lark", "regex"):
            raise RapidspecError(f"unknown grammar kind {self.kind!r}")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise RapidspecError(f"the {self.kind} is longer than {MAX_GRAMMAR_CHARS} characters")
        object.__setattr__(self, "_compiled", _compile(self.kind, self.source))

    @property
    def llguidance(self) -> str:
        """The grammar as llguidance takes it (checked when this object was made)."""
        return self._compiled  # type: ignore[attr-defined]

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_object", "json_schema")

    @property
    def schema(self) -> dict | None:
        """The JSON schema (``{"type": "object"}`` for ``json_object``), None for Lark and regex."""
        if self.kind == "json_object":
            return {"type": "object"}
        return json.loads(self.source) if self.kind == "json_schema" else None

    # ------------------------------------------------------------ makers
    @classmethod
    def json_schema(cls, schema: dict | str, name: str = "") -> "Grammar":
        """An answer that is JSON valid under ``schema`` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise RapidspecError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise RapidspecError(f"a JSON schema is a JSON object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False), str(name))

    @classmethod
    def json_object(cls) -> "Grammar":
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        """An answer in the language of a Lark grammar (llguidance's dialect; ``start`` is the top rule)."""
        return cls("lark", str(text))

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        """An answer matching a regular expression (whole answer)."""
        return cls("regex", str(pattern))

    @classmethod
    def of(cls, value: Any) -> "Grammar | None":
        """A Grammar from OpenAI's ``response_format``, a Pydantic model class, or a Grammar; None for plain text."""
        if value is None or isinstance(value, Grammar):
            return value
        if isinstance(value, type) and hasattr(value, "model_json_schema"):
            return cls.json_schema(value.model_json_schema(), value.__name__)
        if not isinstance(value, dict):
            raise RapidspecError("response_format must be an object such as {\"type\": \"json_object\"}, "
                                 f"got {type(value).__name__}", param="response_format")
        kind = value.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise RapidspecError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                     "{...}}}", param="response_format.json_schema")
            try:
                return cls.json_schema(spec.get("schema", {}), spec.get("name", ""))
            except RapidspecError as err:
                raise RapidspecError(str(err), param="response_format.json_schema.schema") from None
        raise RapidspecError(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                             param="response_format.type")


def _compile(kind: str, source: str) -> str:
    """llguidance's grammar text for a kind and source; RapidspecError when llguidance rejects it."""
    from llguidance import LLMatcher

    try:
        if kind == "json_object":
            text = LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        elif kind == "json_schema":
            text = LLMatcher.grammar_from_json_schema(source, overrides=JSON_OPTIONS)
        elif kind == "lark":
            text = LLMatcher.grammar_from_lark(source)
        else:
            text = LLMatcher.grammar_from_regex(source)
    except ValueError as exc:
        raise RapidspecError(f"invalid {kind.replace('_', ' ')}: {exc}", code="invalid_grammar") from None
    error, messages = LLMatcher.validate_grammar_with_warnings(text)
    if error:
        raise RapidspecError(f"invalid {kind.replace('_', ' ')}: {messages[0]}", code="invalid_grammar")
    return text
