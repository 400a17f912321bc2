"""Hostile and malformed bodies against a live server on the tiny model (127.0.0.1).

For every answer: no 5xx, OpenAI's error body ``{"error": {"message", "type",
"param", "code"}}`` on every 4xx, no traceback in any body; afterwards the
server still answers and /health shows nothing running or waiting. Bodies come
from schemathesis (valid and schema-violating ones, from the app's own
/openapi.json, derandomized and bounded; the completion and token routes) and
from a hand-written table; ``test_server_hostile`` goes on systematically. The
engine generates at most ``CAP`` tokens whatever a body asks, so a valid body
asking for 10**6 tokens stays cheap. The answers are counted in
:mod:`tests.hostile`.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from rapidspec import Rapid
from rapidspec.retrieval import RetrievalConfig
from tests.hostile import GOOD, HI, REFUSED, CappedEngine, check, post
from tests.server_harness import HTTP, running_server
from tests.specs import spec_of

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import positive_data_acceptance  # noqa: E402

EXAMPLES = 50  # schemathesis bodies per (completion route, mode); half that for the token routes


@pytest.fixture(scope="module")
def engine(tiny_model, other_tiny_model):
    return CappedEngine(Rapid(spec_of(retrieval=RetrievalConfig(method="bm25")),
                              target=tiny_model, drafter=other_tiny_model))


@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine) as url:
        yield url


@pytest.fixture(scope="module")
def api(server):
    spec = HTTP.get(f"{server}/openapi.json", timeout=10).json()
    return schemathesis.openapi.from_dict(spec, config=schemathesis.Config())


# ------------------------------------------------------------ property-based (schemathesis)
#: Every operation of the server's OpenAPI document (checked against /openapi.json below).
OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
              ("POST", "/detokenize"), ("GET", "/health"), ("HEAD", "/health"), ("GET", "/metrics"),
              ("GET", "/v1/models"), ("GET", "/version")]


def test_the_operations_are_those_of_the_document(api):
    listed = [(method.upper(), path) for path, item in api.raw_schema["paths"].items() for method in item]
    assert sorted(listed) == sorted(OPERATIONS)


@pytest.mark.parametrize("method, path, mode", [(method, path, mode) for method, path in OPERATIONS
                                                 for mode in ("positive", "negative")
                                                 if mode == "positive" or method == "POST"])  # GETs take no input
def test_every_route_passes_schemathesis_checks(api, server, method, path, mode):
    """Bodies and parameters from the server's own OpenAPI document, answered as it says: schemathesis's checks
    (no 5xx, documented statuses and content types, answers valid under their schemas, schema-invalid bodies
    refused) and ours (:func:`tests.hostile.check`; usable bodies answered or refused naming their field)."""
    operation = api[path][method]
    completion = path.startswith("/v1/") and method == "POST"

    # half of the valid bodies get a usable conversation and lose the refused fields, so their options reach the engine
    # no shrinking: a failure is reported with the body as generated, and the count stays one request per body
    @settings(max_examples=EXAMPLES if completion else EXAMPLES // 5 if method != "POST" else EXAMPLES // 2,
              deadline=30_000, derandomize=True, database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate])
    @given(case=operation.as_strategy(schemathesis.GenerationMode(mode)), usable=st.booleans())
    def run(case, usable):
        usable = usable and completion and mode == "positive" and isinstance(case.body, dict)
        if usable:
            case.body |= {"messages": HI} if "messages" in case.body else {"prompt": "hi"}
            case.body = {k: v for k, v in case.body.items() if k not in REFUSED}
            if case.body.get("model") is not None:
                case.body["model"] = "tiny"  # a model the server does not serve is a 404, as OpenAI answers
        response = case.call(base_url=server, timeout=60)
        error = check(response.status_code, response.headers.get("content-type", [""])[0], response.content,
                      case.body)
        # a body the schema allows may still ask what the server refuses (top_logprobs without logprobs, more
        # tokens than the window): a usable body is answered, or refused with a 400 naming one of its fields
        if usable and response.status_code != 200:
            assert response.status_code == 400 and error["param"], response.text[:500]
            assert re.split(r"[.\[]", error["param"])[0] in case.body, (error, case.body)
        case.validate_response(response, excluded_checks=[positive_data_acceptance] if method == "POST" else [])

    run()


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models", "/version", "/openapi.json", "/v1/nothing"])
def test_the_get_routes(server, path):
    response = HTTP.get(f"{server}{path}", params={"x": "\x00", "model": "'"}, timeout=10)
    check(response.status_code, response.headers.get("content-type", ""), response.content)
    assert response.status_code == (404 if path == "/v1/nothing" else 200)


# ------------------------------------------------------------ hand-written hostile bodies
def chat(**fields):
    return json.dumps(GOOD | fields).encode()


HOSTILE = [  # (id, raw body, extra headers, allowed statuses, expected error.param or None)
    ("empty", b"", None, {400}, None),
    ("null", b"null", None, {400}, None),
    ("list", b"[]", None, {400}, None),
    ("string", b'"hello"', None, {400}, None),
    ("deep-nesting", b'{"messages": ' + b"[" * 10000 + b"]" * 10000 + b"}", None, {400}, None),
    ("deep-object", b'{"metadata": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b', "messages": []}', None, {400}, None),
    ("1e400", chat().replace(b'"max_tokens": 3', b'"max_tokens": 3, "temperature": 1e400'), None, {400}, None),
    ("NaN", chat().replace(b'"max_tokens": 3', b'"max_tokens": 3, "temperature": NaN'), None, {400}, None),
    ("Infinity", chat().replace(b'"max_tokens": 3', b'"max_tokens": 3, "top_p": Infinity'), None, {400}, None),
    ("max_tokens=-1", chat(max_tokens=-1), None, {400}, "max_tokens"),
    ("max_tokens=0", chat(max_tokens=0), None, {400}, "max_tokens"),
    ("max_tokens=2**70", chat(max_tokens=2**70), None, {400}, "max_tokens"),
    ("max_completion_tokens=2**70", chat(max_completion_tokens=2**70), None, {400}, "max_completion_tokens"),
    ("seed=2**64", chat(seed=2**64), None, {400}, "seed"),
    ("temperature=1e-40", chat(temperature=1e-40), None, {400}, "temperature"),
    ("temperature=null", chat(temperature=None), None, {200}, None),
    ("max_gamma=1e7", chat(max_gamma=10_000_000, gamma_schedule="cost"), None, {400}, "max_gamma"),
    ("chunk_tokens=1", chat(chunk_tokens=1, documents=["word " * 200]), None, {400}, "chunk_tokens"),
    ("budget_tokens=1e12", chat(budget_tokens=10**12), None, {400}, "budget_tokens"),
    ("streaming_tokens=1e12", chat(mode="magicdec", streaming_tokens=10**12), None, {400}, "streaming_tokens"),
    ("non-utf8", b'{"messages": [{"role": "user", "content": "\xff\xfe\x80"}]}', None, {400}, None),
    ("text/plain", chat(), {"content-type": "text/plain"}, {400, 415}, None),
    ("form", b"messages=hi", {"content-type": "application/x-www-form-urlencoded"}, {400, 415}, None),
    ("missing-role", chat(messages=[{"content": "hi"}]), None, {400}, "messages[0].role"),
    ("role-tool", chat(messages=[{"role": "tool", "content": "hi", "tool_call_id": "1"}]), None, {400}, None),
    ("content-parts", chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]), None,
     {200}, None),
    ("image-part", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     None, {400}, None),
    ("content-null", chat(messages=[{"role": "user", "content": None}]), None, {400}, None),
    ("10000-empty-messages", chat(messages=[{"role": "user", "content": ""}] * 10000), None, {200, 400}, None),
    ("10000-messages", chat(messages=[{"role": "user", "content": "hi"}] * 10000), None, {200, 400}, None),
    ("messages-of-numbers", chat(messages=[1, None, [], "hi"]), None, {400}, None),
    ("stop-1000", chat(stop=[f"s{i}" for i in range(1000)]), None, {400}, "stop"),
    ("unknown-mode", chat(mode="warp"), None, {400}, "mode"),
    ("other-model", chat(model="gpt-4o"), None, {404}, "model"),
    ("stream_options-without-stream", chat(stream_options={"include_usage": True}), None, {400}, "stream_options"),
    ("documents-junk", chat(documents=[None, 3, {"title": []}]), None, {400}, None),
    ("huge-string-field", chat(user="u" * 200_000), None, {200}, None),
    # texts BM25 finds no word in (found by the generated bodies: a 500 from bm25s' empty vocabulary)
    ("document-of-punctuation", chat(documents=["!!!"]), None, {200, 400}, None),
    ("document-of-stopwords", chat(documents=["the a"]), None, {200, 400}, None),
    ("document-of-emoji", chat(documents=["\U0001F600"]), None, {200, 400}, None),
    ("history-of-punctuation", chat(messages=[{"role": role, "content": "?"} for role in ("user", "assistant", "user")],
                                    recent_messages=0), None, {200, 400}, None),
]


@pytest.mark.parametrize("raw, headers, statuses, param", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_bodies(server, raw, headers, statuses, param):
    response, error = post(server, raw=raw, headers=headers)
    assert response.status_code in statuses, response.text[:500]
    if param is not None:
        assert error["param"] == param, error
    if response.status_code == 404:
        assert error["code"] == "model_not_found"


@pytest.mark.parametrize("raw", [b'{"messages": [', b'{"model": "tiny",}', b"{'model': 'tiny'}"],
                         ids=["truncated", "trailing-comma", "single-quotes"])
def test_invalid_json_is_json_invalid_and_names_no_field(server, raw):
    response, error = post(server, raw=raw)
    assert response.status_code == 400 and error["code"] == "json_invalid"
    assert error["param"] is None, error  # not the character offset


@pytest.mark.parametrize("body", [{"prompt": None}, {"prompt": []}, {"prompt": ["a", "b"]}, {"prompt": [1, 2]},
                                  {"prompt": "hi", "echo": True}, {"prompt": "hi", "logprobs": 99}])
def test_hostile_text_completions(server, body):
    response, _ = post(server, "/v1/completions", {"model": "tiny", "max_tokens": 3} | body)
    assert response.status_code == 400, response.text[:500]


@pytest.mark.parametrize("path, body", [
    ("/detokenize", {"tokens": [2**70]}), ("/detokenize", {"tokens": [-1]}), ("/detokenize", {"tokens": [10**9]}),
    ("/detokenize", {"tokens": "abc"}), ("/tokenize", {"prompt": "hi", "messages": HI}), ("/tokenize", {}),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}), ("/tokenize", {"prompt": "hi", "model": "x"}),
])
def test_hostile_token_routes(api, server, path, body):
    if path not in api.raw_schema["paths"]:
        pytest.skip(f"the app has no {path}")
    response, _ = post(server, path, body)
    assert 400 <= response.status_code < 500, response.text[:500]


# ------------------------------------------------------------ the policy for fields (target behaviour)
@pytest.mark.parametrize("extra", [{"foo": 1}, {"service_tier": "auto"}, {"reasoning_effort": "low"},
                                   {"reasoning_effort": "low"}], ids=lambda extra: next(iter(extra)))
def test_fields_nobody_defines_are_ignored_with_a_warning(server, caplog, extra):
    with caplog.at_level(logging.WARNING, logger="rapidspec"):
        response, _ = post(server, body=GOOD | extra)
    assert response.status_code == 200, response.text[:500]
    assert next(iter(extra)) in caplog.text


def test_unknown_stream_options_are_ignored(server):
    body = GOOD | {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    response, _ = post(server, body=body)
    assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")


UNSUPPORTED = [("functions", [{"name": "f"}]), ("function_call", "auto"), ("logit_bias", {"50256": -100}), ("n", 2)]
#: Tool fields the tiny model (no chat template) cannot honour, each a 400 naming it.
TOOLS_REFUSED = [("tools", [], "non-empty list"),
                 ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], "has no tools"),
                 ("tools", [{"type": "function", "function": {"name": "f f"}}], "function.name"),
                 ("tool_choice", "required", "needs tools"),
                 ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}, "invalid json"),
                 ("response_format", {"type": "yaml"}, "type must be")]


@pytest.mark.parametrize("field, value", UNSUPPORTED, ids=[f"{f}={json.dumps(v)[:20]}" for f, v in UNSUPPORTED])
@pytest.mark.parametrize("stream", [False, True])
def test_openai_fields_rapidspec_does_not_implement_are_a_400_naming_them(server, field, value, stream):
    response, error = post(server, body=GOOD | {field: value, "stream": stream})
    assert response.status_code == 400, response.text[:500]
    assert error["param"] == field and "not supported" in error["message"], error


@pytest.mark.parametrize("field, value, words", TOOLS_REFUSED, ids=[f"{f}-{w}" for f, _, w in TOOLS_REFUSED])
@pytest.mark.parametrize("stream", [False, True])
def test_tools_and_formats_the_server_cannot_honour_are_a_400_naming_them(server, field, value, words, stream):
    response, error = post(server, body=GOOD | {field: value, "stream": stream})
    assert response.status_code == 400, response.text[:500]
    assert error["param"].startswith(field) and words in error["message"], error


@pytest.mark.parametrize("body", [{"response_format": {"type": "text"}}, {"n": 1}, {"tool_choice": None},
                                  {"logit_bias": None}, {"tools": None}, {"functions": None},
                                  {"response_format": {"type": "json_object"}}, {"tool_choice": "none"}])
def test_harmless_values_of_those_fields_pass(server, body):
    assert post(server, body=GOOD | body)[0].status_code == 200


# ------------------------------------------------------------ limits (ServerConfig fields)
def test_a_body_over_max_request_bytes_is_a_413(engine):
    with running_server(engine, max_request_bytes=4096) as url:
        response, error = post(url, body=GOOD | {"user": "u" * 8192})
        assert response.status_code == 413 and error is not None
        chunks = (b'{"messages": [{"role": "user", "content": "' + b"x" * 1024 for _ in range(8))
        response = HTTP.post(f"{url}/v1/chat/completions", content=chunks, timeout=30)  # no Content-Length
        assert check(response.status_code, "", response.content) and response.status_code == 413
        assert post(url, body=GOOD)[0].status_code == 200


def test_an_api_key_guards_v1_and_metrics_but_not_health(engine):
    with running_server(engine, api_key="k") as url:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                             ("GET", "/metrics")]:
            for auth in ({}, {"authorization": "Bearer wrong"}, {"authorization": "k"}):
                response = HTTP.request(method, f"{url}{path}", json=GOOD, headers=auth, timeout=30)
                check(response.status_code, response.headers.get("content-type", ""), response.content)
                assert response.status_code == 401, (path, auth, response.text)
        assert HTTP.get(f"{url}/health", timeout=10).status_code == 200
        assert post(url, body=GOOD, headers={"authorization": "Bearer k"})[0].status_code == 200
