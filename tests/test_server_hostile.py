"""Hostile requests generated systematically against a live server on the tiny model (127.0.0.1).

Every text field x unicode edge cases (lone surrogates must be a 400 naming
the field), every number field x float and integer extremes (streaming and
not, with log-probabilities for the sampling knobs), and structure sizes.
Each answer goes through :func:`tests.hostile.check` (no 5xx, no traceback,
OpenAI's error body); the last test prints the count of every hostile suite
(``hostile: N requests, M 5xx``). Bounded: about 2,000 requests of at most
``CAP`` generated tokens each.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest

from rapidspec import Rapid
from rapidspec.retrieval import RetrievalConfig
from tests.hostile import GOOD, HI, STATUSES, TRIED, CappedEngine, post
from tests.server_harness import HTTP, running_server
from tests.specs import spec_of


@pytest.fixture(scope="module")
def server(tiny_model, other_tiny_model):
    engine = CappedEngine(Rapid(spec_of(retrieval=RetrievalConfig(method="bm25")),
                                target=tiny_model, drafter=other_tiny_model))
    with running_server(engine, max_document_tokens=8192) as url:
        yield url


# ------------------------------------------------------------ text fields x unicode
LONE_SURROGATES = {"high": "\ud800", "low": "\udfff", "inside": "a\udc00b", "two-highs": "\udbff\ud800",
                   "reversed-pair": "\udc00\ud800"}
VALID_TEXTS = {"empty": "", "space": " ", "nul": "\x00", "bom": "\ufeff", "rtl-override": "\u202e hi",
               "combining": "e\u0301" * 300, "noncharacter": "\uffff", "max-codepoint": "\U0010ffff",
               "zwj-emoji": "\U0001F469\u200d\U0001F469\u200d\U0001F467", "zero-width": "\u200b", "crlf": "\r\n",
               "controls": "\x01\x07\x1b[31m", "cjk": "\u4e2d\u6587", "pair-escapes": "\ud83d\ude00"}
# where a text goes: (route, body builder, the field an error must name)
TEXT_FIELDS = [
    ("/v1/chat/completions", lambda v: {"messages": [{"role": "user", "content": v}]}, "messages[0].content"),
    ("/v1/chat/completions", lambda v: {"messages": [{"role": "user", "content": [{"type": "text", "text": v}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", lambda v: {"messages": [{"role": v, "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", lambda v: {"messages": [{"role": "system", "content": v}, *HI]}, "messages[0].content"),
    ("/v1/chat/completions", lambda v: {"messages": HI, "documents": [v]}, "documents[0]"),
    ("/v1/chat/completions", lambda v: {"messages": HI, "documents": [{"title": v, "text": "a b"}]},
     "documents[0].title"),
    ("/v1/chat/completions", lambda v: {"messages": HI, "documents": ["cats and dogs"], "query": v}, "query"),
    ("/v1/chat/completions", lambda v: {"messages": HI, "stop": [v]}, "stop[0]"),
    ("/v1/chat/completions", lambda v: {"messages": HI, "stop": v}, "stop"),
    ("/v1/chat/completions", lambda v: {"messages": HI, "user": v}, "user"),
    ("/v1/chat/completions", lambda v: {"messages": HI, "model": v}, "model"),
    ("/v1/chat/completions", lambda v: {"messages": HI, "mode": v}, "mode"),
    ("/v1/chat/completions", lambda v: {"messages": HI, "metadata": {"k": v}}, "metadata.k"),
    ("/v1/chat/completions", lambda v: {"messages": HI, v: 1}, "body"),
    ("/v1/completions", lambda v: {"prompt": v}, "prompt"),
    ("/v1/completions", lambda v: {"prompt": [v]}, "prompt[0]"),
    ("/tokenize", lambda v: {"prompt": v}, "prompt"),
    ("/tokenize", lambda v: {"messages": [{"role": "user", "content": v}]}, "messages[0].content"),
]


@pytest.mark.parametrize("route, build, field", TEXT_FIELDS, ids=[f"{r}:{f}" for r, _, f in TEXT_FIELDS])
def test_text_that_is_not_utf8_is_a_400_naming_its_field_everywhere(server, route, build, field):
    for name, text in LONE_SURROGATES.items():
        body = {"max_tokens": 2, **build(text)} if route != "/tokenize" else build(text)
        response, error = post(server, route, body)
        assert response.status_code == 400, (name, response.text[:300])
        assert error["code"] == "invalid_text" and error["param"] == field, (name, error)


@pytest.mark.parametrize("route, build, field", TEXT_FIELDS, ids=[f"{r}:{f}" for r, _, f in TEXT_FIELDS])
@pytest.mark.parametrize("stream", [False, True])
def test_valid_unicode_never_gets_a_5xx(server, route, build, field, stream):
    if stream and route == "/tokenize":
        pytest.skip("/tokenize does not stream")
    for name, text in VALID_TEXTS.items():
        body = build(text) if route == "/tokenize" else {"max_tokens": 2, "stream": stream, **build(text)}
        response, error = post(server, route, body)
        assert error is None or error["code"] != "invalid_text", (name, error)


@pytest.mark.parametrize("path", ["content", "documents", "query", "prompt"])
def test_raw_surrogate_bytes_are_a_400(server, path):
    """ED A0 80 is U+D800 in UTF-8's shape; Python's JSON decoder accepts it."""
    lone = b'"\xed\xa0\x80"'
    raw = {"content": b'{"messages": [{"role": "user", "content": ' + lone + b"}]}",
           "documents": b'{"messages": [{"role": "user", "content": "hi"}], "documents": [' + lone + b"]}",
           "query": b'{"messages": [{"role": "user", "content": "hi"}], "documents": ["a b"], "query": ' + lone + b"}",
           "prompt": b'{"prompt": ' + lone + b"}"}[path]
    route = "/v1/completions" if path == "prompt" else "/v1/chat/completions"
    response, error = post(server, route, raw=raw)
    assert response.status_code == 400 and error["code"] == "invalid_text", response.text[:300]


# ------------------------------------------------------------ number fields x extremes
NUMBERS = [0, -0.0, -1, 1, 0.5, 1e-5, 1e-300, 5e-324, 1e300, 1.7976931348623157e308, 2**31, 2**53 + 1, 2**63, 2**64,
           -(2**63), 10**30, True, "1", [], {}]
RAW_NUMBERS = [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400"]
NUMBER_FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "eta", "gamma", "max_gamma",
                 "draft_confidence", "top_k", "draft_gate", "sink_tokens", "streaming_tokens", "budget_tokens",
                 "chunk_tokens", "recent_messages", "seed", "top_logprobs", "n", "best_of", "frequency_penalty",
                 "presence_penalty", "repetition_penalty"]
SAMPLING_FLOATS = ["temperature", "top_p", "eta", "draft_gate", "draft_confidence"]


def _answer_is_sound(response: httpx.Response) -> None:
    """A 200 holds an answer (a string) and only finite log-probabilities; a stream has no error event."""
    if response.status_code != 200:
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), response.text[-500:]
        return
    body = json.loads(response.text, parse_constant=lambda c: pytest.fail(f"{c} in a JSON answer"))
    choice = body["choices"][0]
    assert isinstance(choice["message"]["content"] if "message" in choice else choice["text"], str)
    for entry in ((choice.get("logprobs") or {}).get("content") or []):
        assert math.isfinite(entry["logprob"]) and all(math.isfinite(t["logprob"]) for t in entry["top_logprobs"])


@pytest.mark.parametrize("field", NUMBER_FIELDS)
@pytest.mark.parametrize("stream", [False, True])
def test_number_extremes_never_get_a_5xx(server, field, stream):
    base = GOOD | {"stream": stream, "documents": ["cats and dogs and birds"]}
    if field == "top_logprobs":
        base |= {"logprobs": True}
    for value in NUMBERS:
        response, error = post(server, body=base | {field: value})
        if error is not None and response.status_code == 400 and error["param"] is not None:
            assert error["param"].split(".")[0].split("[")[0] == field, error
        _answer_is_sound(response)
    for raw in RAW_NUMBERS:
        text = json.dumps(base | {field: 12345}).replace("12345", raw.decode())
        response, _ = post(server, raw=text.encode())
        assert response.status_code == 400, (raw, response.text[:300])


@pytest.mark.parametrize("field", SAMPLING_FLOATS)
@pytest.mark.parametrize("stream", [False, True])
def test_sampling_extremes_with_log_probabilities(server, field, stream):
    """eta 1e300 overflowed float32 (inf x 0 = NaN: 500s, empty text); top_p 1e-300 dropped every token."""
    base = GOOD | {"stream": stream, "mode": "rapid", "temperature": 1.0, "seed": 1, "logprobs": True,
                   "top_logprobs": 5, "documents": ["cats and dogs and birds"]}
    for value in NUMBERS:
        response, _ = post(server, body=base | {field: value})
        _answer_is_sound(response)


def test_the_float_faults_found_by_the_probe(server):
    response, error = post(server, body=GOOD | {"eta": 1e300})
    assert response.status_code == 400 and error["param"] == "eta"
    for greedy in (True, False):
        body = GOOD | {"top_p": 1e-300, "temperature": 0.0 if greedy else 1.0, "logprobs": True, "ignore_eos": True}
        response, _ = post(server, body=body)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3, response.text


def test_completion_logprobs_extremes(server):
    for value in NUMBERS:
        response, _ = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": value})
        _answer_is_sound(response)


# ------------------------------------------------------------ structure sizes
SIZES = [  # (id, body changes, allowed statuses)
    ("60000-empty-messages", {"messages": [{"role": "user", "content": ""}] * 60_000}, {400}),
    ("60000-empty-messages-middle", {"messages": [{"role": "user", "content": ""}] * 60_000, "truncate": "middle"},
     {400}),
    ("2MB-query", {"documents": ["cats"], "query": "q" * 2_000_000, "truncate": "middle"}, {400}),
    ("2MB-document", {"documents": ["word " * 400_000], "truncate": "middle"}, {400}),
    ("1000-documents", {"documents": ["cats and dogs"] * 1000, "truncate": "middle"}, {200, 400}),
    ("10000-content-parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 10_000}]},
     {200, 400}),
    ("16-stop", {"stop": [f"s{i}" for i in range(16)]}, {200}),
    ("17-stop", {"stop": [f"s{i}" for i in range(17)]}, {400}),
    ("long-stop", {"stop": ["x" * 100_000]}, {400}),
    ("deep-metadata", {"metadata": json.loads('{"a": ' * 200 + "1" + "}" * 200)}, {200, 400}),
    ("100k-unknown-keys", {f"k{i}": i for i in range(100_000)}, {200}),
    ("developer-role", {"messages": [{"role": "developer", "content": "Be brief."}, *HI]}, {200}),
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}, {400}),
    ("modalities", {"modalities": ["text", "audio"]}, {400}),
    ("modalities-text", {"modalities": ["text"]}, {200}),
    ("prediction", {"prediction": {"type": "content", "content": "hi"}}, {400}),
]


@pytest.mark.parametrize("changes, statuses", [s[1:] for s in SIZES], ids=[s[0] for s in SIZES])
def test_structure_sizes(server, changes, statuses):
    response, error = post(server, body=GOOD | changes)
    assert response.status_code in statuses, response.text[:300]
    if "audio" in changes or "prediction" in changes or changes.get("modalities") == ["text", "audio"]:
        assert "not supported" in error["message"] and error["param"] in changes


def test_head_health_is_a_200(server):
    assert httpx.head(f"{server}/health", timeout=10).status_code == 200


# ------------------------------------------------------------ afterwards (keep last)
def test_the_server_still_answers_and_nothing_is_left_running(server, capsys, record_property):
    response, _ = post(server, body=GOOD)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] is not None
    health = HTTP.get(f"{server}/health", timeout=10).json()
    assert health["running"] == 0 and health["waiting"] == 0, health
    statuses = ", ".join(f"{status}: {count}" for status, count in sorted(STATUSES.items()))
    line = f"hostile: {TRIED['bodies']} requests, {TRIED['5xx']} 5xx ({statuses})"
    record_property("hostile", line)  # in --junitxml reports too
    with capsys.disabled():
        print(f"\n{line}")
    assert TRIED["5xx"] == 0, line
