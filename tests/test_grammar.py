"""Structured output: grammars from OpenAI's shapes, the per-generation state, and every mode under a grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from pydantic import BaseModel

from rapidspec import DecodeConfig
from rapidspec.errors import RapidspecError
from rapidspec.grammar import Grammar, GrammarTokens
from tests.test_engine import DOCUMENT, QUESTION, engine

SCHEMA = {
    "type": "object",
    "properties": {"tag": {"enum": ["alpha", "beta"]}, "ok": {"type": "boolean"},
                   "note": {"type": "string", "maxLength": 6}},
    "required": ["tag", "ok", "note"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}


class Person(BaseModel):
    name: str
    age: int


def test_grammars_from_openai_shapes_and_pydantic():
    assert Grammar.of(None) is None and Grammar.of({"type": "text"}) is None
    assert Grammar.of({"type": "json_object"}).kind == "json_object"
    record = Grammar.of(RESPONSE_FORMAT)
    assert record.kind == "json_schema" and record.name == "record" and record.schema == SCHEMA
    person = Grammar.of(Person)
    assert person.name == "Person" and list(person.schema["properties"]) == ["name", "age"]  # order kept
    assert DecodeConfig(grammar=RESPONSE_FORMAT).grammar == record  # the config takes the dict too
    assert hash(DecodeConfig(grammar=record)) == hash(DecodeConfig(grammar=RESPONSE_FORMAT))


@pytest.mark.parametrize("value, words", [
    ({"type": "xml"}, "json_schema"),
    ({"type": "json_schema"}, "json_schema needs"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "invalid json schema"),
    ("json", "must be an object"),
])
def test_bad_response_formats_are_one_line_errors(value, words):
    with pytest.raises(RapidspecError, match=words) as caught:
        Grammar.of(value)
    assert caught.value.param and caught.value.param.startswith("response_format")


def test_bad_lark_and_regex_are_one_line_errors():
    with pytest.raises(RapidspecError, match="invalid lark"):
        Grammar.lark("start: (")
    with pytest.raises(RapidspecError, match="invalid regex"):
        Grammar.regex("[a-")


@pytest.fixture(scope="module")
def grammar_tokens(byte_tokenizer):
    return GrammarTokens(byte_tokenizer, len(byte_tokenizer), frozenset({byte_tokenizer.eos_token_id}))


def test_masks_follow_paths_and_rejected_drafts_leave_no_trace(grammar_tokens, byte_tokenizer):
    state = grammar_tokens.start(Grammar.json_schema(SCHEMA))
    allowed = state.mask_after([]).nonzero().flatten().tolist()
    assert byte_tokenizer.convert_ids_to_tokens(allowed) == ["{"]
    good = byte_tokenizer.encode('{"tag": "beta"')
    assert state.allowed_prefix(good) == len(good)
    assert state.allowed_prefix(byte_tokenizer.encode('{"tog"')) == 3  # '{"t' is allowed, 'o' is not
    fresh = grammar_tokens.start(Grammar.json_schema(SCHEMA))
    state.commit(good[:2])  # drafts explored past it were rolled back
    fresh.commit(good[:2])
    assert torch.equal(state.mask_after([]), fresh.mask_after([]))
    masks = state.masks(good[2:5])  # rows 0..k as the target's
    assert masks.shape == (4, len(byte_tokenizer)) and all(masks[i, t] for i, t in enumerate(good[2:5]))


def test_a_grammar_is_compiled_once_and_each_answer_starts_from_its_own_copy(byte_tokenizer, monkeypatch):
    from rapidspec.grammar import matcher as module

    monkeypatch.setattr(module, "KEPT_GRAMMARS", 2)
    tokens = GrammarTokens(byte_tokenizer, len(byte_tokenizer), frozenset({byte_tokenizer.eos_token_id}))
    first = tokens.start(Grammar.json_schema(SCHEMA))
    first.commit(byte_tokenizer.encode('{"tag": "alpha", "ok": true, "note": "x"}'))
    second = tokens.start(Grammar.json_schema(SCHEMA))  # the one compiled for the first, copied
    assert first.finished and not second.finished
    assert byte_tokenizer.convert_ids_to_tokens(second.mask_after([]).nonzero().flatten().tolist()) == ["{"]
    assert first.matcher is not second.matcher and len(tokens._compiled) == 1
    for pattern in ("a+", "b+", "c+"):
        tokens.start(Grammar.regex(pattern))
    assert list(tokens._compiled) == [Grammar.regex("b+").llguidance, Grammar.regex("c+").llguidance]  # the last 2


def test_a_complete_answer_finishes_the_grammar(grammar_tokens, byte_tokenizer):
    state = grammar_tokens.start(Grammar.json_schema(SCHEMA))
    state.commit(byte_tokenizer.encode('{"tag": "alpha", "ok": true, "note": "x"}'))
    assert state.finished
    assert state.mask_after([]).nonzero().flatten().tolist() == [byte_tokenizer.eos_token_id]


def test_ignore_eos_keeps_the_end_of_answer_for_where_the_grammar_must_end(grammar_tokens, byte_tokenizer):
    eos = byte_tokenizer.eos_token_id
    for eos_only_at_end, may_end in [(False, True), (True, False)]:
        state = grammar_tokens.start(Grammar.regex("ab?"), eos_only_at_end=eos_only_at_end)
        state.commit(byte_tokenizer.encode("a"))  # complete, and "b" may follow
        assert bool(state.mask_after([])[eos]) == may_end
        state.commit(byte_tokenizer.encode("b"))  # nothing may follow: the end of answer is the one token left
        assert state.finished and state.mask_after([]).nonzero().flatten().tolist() == [eos]


@pytest.fixture(scope="module")
def lc_record(tiny_model):
    return engine(tiny_model).generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=100, grammar=RESPONSE_FORMAT)


def test_lc_under_a_grammar_answers_valid_json(lc_record):
    jsonschema.validate(json.loads(lc_record.text), SCHEMA)
    assert lc_record.stats.stop_reason == "stop"  # ended by the grammar, not the length


@pytest.mark.parametrize("mode", ["sd", "ragsd", "rapid", "magicdec", "lookup", "rag"])
@pytest.mark.parametrize("drafter_kind", ["self", "random"])
def test_greedy_eta_zero_under_a_grammar_equals_lc_under_it(tiny_model, other_tiny_model, lc_record, mode,
                                                           drafter_kind):
    """Every mode keeps the grammar; eta = 0 greedy equals lc under the same grammar token for token (float32).

    (rag reads other text, so only its validity is checked.)"""
    drafter = None if drafter_kind == "self" else other_tiny_model
    out = engine(tiny_model, drafter).generate(DOCUMENT, QUESTION, mode=mode, eta=0.0, gamma=4, max_new_tokens=100,
                                               gamma_schedule="constant", grammar=RESPONSE_FORMAT)
    jsonschema.validate(json.loads(out.text), SCHEMA)
    if mode != "rag":
        assert out.token_ids == lc_record.token_ids


@pytest.mark.parametrize("temperature, eta", [(0.0, 5.0), (1.0, 0.0), (1.0, 3.0)])
def test_rapid_sampling_and_eta_keep_the_grammar(tiny_model, other_tiny_model, temperature, eta):
    """The shift toward the drafter acts only among allowed tokens: 10 answers, all valid."""
    rapid = engine(tiny_model, other_tiny_model)
    generator = torch.Generator().manual_seed(3)
    for _ in range(10):
        out = rapid.generate(DOCUMENT, QUESTION, mode="rapid", eta=eta, temperature=temperature, max_new_tokens=100,
                             grammar=RESPONSE_FORMAT, generator=generator)
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_a_grammar_cut_by_max_tokens_says_length(tiny_model):
    out = engine(tiny_model).generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=5, grammar=RESPONSE_FORMAT)
    assert out.stats.stop_reason == "length" and out.text.startswith('{"')


@pytest.mark.parametrize("mode", ["lc", "sd", "ragsd", "rapid", "magicdec", "lookup", "rag"])
@pytest.mark.parametrize("drafter_kind", ["self", "random"])
def test_ignore_eos_under_a_grammar_ends_where_the_grammar_ends(tiny_model, other_tiny_model, mode, drafter_kind):
    """With ignore_eos a constrained answer goes on past an end of answer the grammar does not force, and ends
    (stop) where the grammar allows nothing else: drafts past that end are never emitted."""
    drafter = None if drafter_kind == "self" else other_tiny_model
    out = engine(tiny_model, drafter).generate(DOCUMENT, QUESTION, mode=mode, gamma=8, max_new_tokens=100,
                                               gamma_schedule="constant", ignore_eos=True, grammar=RESPONSE_FORMAT,
                                               drafter_start="first")
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert out.stats.stop_reason in ("stop", "eos")  # the grammar's end, never the length
