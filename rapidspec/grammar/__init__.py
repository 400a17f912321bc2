"""Structured output: grammars (JSON schemas, Lark, regex) that constrain drafts and verification alike.

:mod:`.spec` describes what an answer must match (:class:`Grammar`, from
OpenAI's ``response_format`` or a Pydantic model); :mod:`.matcher` follows one
generation through it with llguidance and masks the logits; :mod:`.tools`
turns OpenAI ``tools`` into the model's chat template, a grammar and parsed
``tool_calls``.
"""

import importlib

_EXPORTS = {
    "Grammar": "rapidspec.grammar.spec",
    "GrammarState": "rapidspec.grammar.matcher",
    "GrammarTokens": "rapidspec.grammar.matcher",
    "apply_mask": "rapidspec.grammar.matcher",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):  # the matcher (torch, llguidance) loads on first use of its names
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rapidspec.grammar' has no attribute {name!r}")
