"""Structured output: grammars (JSON schemas, Lark, regex) that constrain drafts and verification alike.

:mod:`.spec` describes what an answer must match (:class:`Grammar`, from
OpenAI's ``response_format`` or a Pydantic model); :mod:`.matcher` follows one
generation through it with llguidance and masks the logits; :mod:`.tools`
turns OpenAI ``tools`` into the model's chat template, a grammar and parsed
``tool_calls``.
"""

from rapidspec.grammar.matcher import GrammarState, GrammarTokens, apply_mask
from rapidspec.grammar.spec import Grammar

__all__ = ["Grammar", "GrammarState", "GrammarTokens", "apply_mask"]
