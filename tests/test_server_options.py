"""Every request option that changes the decoding path, crossed, over HTTP on the tiny model (127.0.0.1).

Options each fine alone may break together (a JSON schema with ``ignore_eos``
in a drafting mode once raised inside the engine). The cases are every pair of
option values (allpairspy's pairwise covering) and, beside them, every mode x
output shape x ``ignore_eos`` drafting from the first round with room to end
the answer (the target drafts for itself, so its drafts run past the
grammar's end), the other options rotating. For every
answer: no 5xx; a refusal is a 400 in OpenAI's body naming the field it
refuses; a 200 is well formed (non-streamed and streamed), its log
probabilities one per token where asked, and its JSON or tool calls valid under
their schema wherever the grammar ended the answer (not a stop string or the
length). Drafting is checked from the answer's ``metrics.speculative_decoding``:
every case of a model-drafting mode that drafts from the first round drafted
tokens, and ``lc`` and ``rag`` drafted none.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json

import httpx
import jsonschema
import pytest
from allpairspy import AllPairs

from rapidspec import Rapid
from rapidspec.retrieval import RetrievalConfig
from tests.hostile import check
from tests.server_harness import HTTP, running_server
from tests.test_server_tools import SCHEMAS, TEMPLATE, TOOLS
from tests.specs import spec_of

MODES = ["lc", "rag", "sd", "ragsd", "rapid", "magicdec", "lookup"]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "rain": {"type": "boolean"}},
          "required": ["city", "rain"], "additionalProperties": False}
SHAPES = {  # output shape -> the body's fields (chat only for tools)
    "text": {},
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
    "tools_required": {"tools": TOOLS, "tool_choice": "required"},
    "tools_auto": {"tools": TOOLS},
}
DOCUMENT = " ".join(f"On day {i} it rained in Oslo and the sun shone in Lima." for i in range(40))
OPTIONS = {  # name -> values; the first value of each is the default case
    "route": ["chat", "completions"],
    "stream": [False, True],
    "logprobs": [False, True],
    "stop": [None, ("\n", "}")],
    "sampling": [(0.0, None), (1.0, 7)],  # (temperature, seed)
    "n": [None, 1, 2, "best_of=2"],
    "max_tokens": [1, 64, 10**6],  # 64: room for the JSON (a byte per token)
    "drafting": [("first", "constant"), ("auto", "auto")],  # (drafter_start, gamma_schedule): always, or as it pays
}
NAMES = ["mode", "shape", "ignore_eos", *OPTIONS]


def pairwise_cases() -> list[tuple]:
    return [tuple(case) for case in AllPairs([MODES, list(SHAPES), [False, True], *OPTIONS.values()])]


#: What the crossed cases fix so that every one reaches the drafting rounds and the grammar's end.
REACHING = {"stop": None, "n": None, "max_tokens": 64, "drafting": ("first", "constant")}


def crossed_cases() -> list[tuple]:
    """Every mode x shape x ignore_eos, drafting from the first round with room to end; the rest rotate."""
    rotating = {name: itertools.cycle(values) for name, values in OPTIONS.items() if name not in REACHING}
    return [(mode, shape, ignore_eos, *(REACHING[name] if name in REACHING else next(rotating[name])
                                        for name in OPTIONS))
            for mode, shape, ignore_eos in itertools.product(MODES, SHAPES, [False, True])]


CASES = sorted(set(pairwise_cases() + crossed_cases()), key=repr)


def body_of(case: dict) -> tuple[str, dict]:
    """The route and the body of one case."""
    temperature, seed = case["sampling"]
    body = {"model": "tiny", "mode": case["mode"], "ignore_eos": case["ignore_eos"], "stream": case["stream"],
            "temperature": temperature, "seed": seed, "max_tokens": case["max_tokens"],
            "stop": None if case["stop"] is None else list(case["stop"]),
            "drafter_start": case["drafting"][0], "gamma_schedule": case["drafting"][1], "documents": [DOCUMENT],
            "gamma": 4}
    if case["n"] == "best_of=2":
        body["best_of"] = 2
    elif case["n"] is not None:
        body["n"] = case["n"]
    if case["stream"]:
        body["stream_options"] = {"include_usage": True}
    chat = case["route"] == "chat" or case["shape"].startswith("tools")
    body |= SHAPES[case["shape"]]
    if chat:
        body["messages"] = [{"role": "user", "content": "Where did it rain on day 3? Answer in JSON."}]
        if case["logprobs"]:
            body |= {"logprobs": True, "top_logprobs": 2}
        return "/v1/chat/completions", body
    body["prompt"] = "Where did it rain on day 3?"
    if case["logprobs"]:
        body["logprobs"] = 2
    return "/v1/completions", body


def refused_field(body: dict) -> str | None:
    """The field a 400 must name for this body, None when it must be answered."""
    if body.get("n", 1) != 1:
        return "n"
    if body.get("best_of", 1) != 1:
        return "best_of"
    if body["max_tokens"] > 10**5:
        return "max_tokens"
    return None


@pytest.fixture(scope="module")
def server(tiny_model, byte_tokenizer):
    """The target drafts for itself: its drafts are accepted, so rounds run past the grammar's end."""
    tokenizer = copy.deepcopy(byte_tokenizer)
    tokenizer.chat_template = TEMPLATE
    target = dataclasses.replace(tiny_model, tokenizer=tokenizer)
    with running_server(Rapid(spec_of(retrieval=RetrievalConfig(method="bm25", chunk_tokens=64,
                                                                budget_tokens=128)), target=target)) as url:
        yield url


#: Modes whose drafter drafts every round once it joined (lookup drafts only where the text repeats).
MODEL_DRAFTING = {"sd", "ragsd", "rapid", "magicdec"}


def read_stream(text: str) -> tuple[dict, str, list, list, str | None, dict | None, dict | None]:
    """A stream's parts: (first chunk, content, tool call parts, log probabilities, finish reason, usage,
    metrics)."""
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-500:]
    events = [json.loads(line) for line in lines[:-1]]
    assert events and all("error" not in e for e in events), text[-500:]
    content, calls, logprobs, finish, usage, metrics = "", [], [], None, None, None
    for event in events:
        usage = event.get("usage") or usage
        metrics = event.get("metrics") or metrics
        for choice in event["choices"]:
            assert choice["index"] == 0
            delta = choice.get("delta", choice)
            content += delta.get("content") or delta.get("text") or ""
            calls += delta.get("tool_calls") or []
            lp = choice.get("logprobs")
            logprobs += (lp.get("content") or []) if isinstance(lp, dict) and "content" in lp else (
                lp.get("tokens") or [] if isinstance(lp, dict) else [])
            finish = choice.get("finish_reason") or finish
    return events[0], content, calls, logprobs, finish, usage, metrics


def read_whole(answer: dict) -> tuple[str, list, list, str | None, dict, dict | None]:
    """A non-streamed answer's (content, tool calls, log probabilities, finish reason, usage, metrics)."""
    [choice] = answer["choices"]
    message = choice.get("message") or {}
    content = message.get("content") if "message" in choice else choice.get("text")
    lp = choice.get("logprobs") or {}
    logprobs = lp.get("content") or [] if "content" in lp else lp.get("tokens") or []
    return (content or "", message.get("tool_calls") or [], logprobs, choice["finish_reason"], answer["usage"],
            answer.get("metrics"))


def joined_calls(parts: list) -> list[tuple[str, str]]:
    """Tool calls from a stream's parts (joined by index) or a whole answer's calls: (name, arguments)."""
    calls: dict[int, list[str]] = {}
    for i, part in enumerate(parts):
        joined = calls.setdefault(part.get("index", i), ["", ""])
        joined[0] += part["function"].get("name") or ""
        joined[1] += part["function"].get("arguments") or ""
    return [tuple(c) for c in calls.values()]


def check_answer(case: dict, body: dict, response: httpx.Response) -> None:
    if case["stream"]:
        _, content, call_parts, logprobs, finish, usage, metrics = read_stream(response.text)
    else:
        content, call_parts, logprobs, finish, usage, metrics = read_whole(response.json())
    assert finish in ("stop", "length", "tool_calls"), finish
    assert usage and usage["completion_tokens"] >= 1 and usage["completion_tokens"] <= body["max_tokens"]
    drafted = metrics["speculative_decoding"]["num_draft_tokens"]
    if case["mode"] in MODEL_DRAFTING and case["drafting"] == ("first", "constant") and body["max_tokens"] >= 2:
        assert drafted > 0, metrics  # the drafter joined before the first round and drafted in it
    if case["mode"] in ("lc", "rag"):
        assert drafted == 0, metrics
    if case["logprobs"]:
        assert len(logprobs) == usage["completion_tokens"], (len(logprobs), usage)
    calls = joined_calls(call_parts)
    ended_by_grammar = finish in ("stop", "tool_calls") and body["stop"] is None  # not a stop string, not the length
    if case["shape"] == "tools_required" and ended_by_grammar:
        assert finish == "tool_calls" and calls and not content
    for name, arguments in calls:
        if ended_by_grammar:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if case["shape"].startswith("json") and ended_by_grammar:
        value = json.loads(content)
        if case["shape"] == "json_schema":
            jsonschema.validate(value, SCHEMA)
        else:
            assert isinstance(value, dict)


@pytest.mark.parametrize("values", CASES, ids=lambda values: "-".join(map(str, values)).replace(" ", ""))
def test_option_combinations(server, values):
    case = dict(zip(NAMES, values))
    path, body = body_of(case)
    response = HTTP.post(f"{server}{path}", json=body, timeout=120)
    error = check(response.status_code, response.headers.get("content-type", ""), response.content, body)
    refused = refused_field(body)
    if refused is not None:
        assert response.status_code == 400 and error["param"] == refused, response.text[:500]
        return
    assert response.status_code == 200, response.text[:500]
    check_answer(case, body, response)


def test_the_cases_cover_every_mode_shape_and_ignore_eos_and_every_pair():
    cases = [dict(zip(NAMES, values)) for values in CASES]
    assert {(c["mode"], c["shape"], c["ignore_eos"]) for c in cases} == set(
        itertools.product(MODES, SHAPES, [False, True]))
    values = [[False, True] if name == "ignore_eos" else MODES if name == "mode" else list(SHAPES)
              if name == "shape" else OPTIONS[name] for name in NAMES]
    for (i, a), (j, b) in itertools.combinations(enumerate(values), 2):
        seen = {(repr(c[NAMES[i]]), repr(c[NAMES[j]])) for c in cases}
        assert seen == {(repr(x), repr(y)) for x in a for y in b}, (NAMES[i], NAMES[j])
