"""The server's limits and OpenAI's field policy on a live server (127.0.0.1, free port, bounded waits)."""

from __future__ import annotations

import logging
import time

import httpx
import openai
import pytest

from rapidspec import DecodeConfig, Rapid
from rapidspec.errors import RapidspecError
from rapidspec.retrieval import RetrievalConfig
from rapidspec.server import ServerConfig, create_app
from tests.server_harness import HTTP, SlowEngine, running_server, wait_until
from tests.specs import spec_of

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Rapid(spec_of(retrieval=RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=200)),
                 target=tiny_model)


@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine) as url:
        yield url


def post(url: str, body, timeout: float = 30, **options) -> httpx.Response:
    return HTTP.post(f"{url}/v1/chat/completions", json=body, timeout=timeout, **options)


def test_api_key_guards_everything_but_health(engine):
    with running_server(engine, api_key="sesame") as url:
        assert HTTP.get(f"{url}/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/version"):
            refused = HTTP.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"})
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert post(url, {"messages": HI, "max_tokens": 2}).status_code == 401
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0, timeout=30)
        assert client.chat.completions.create(model="tiny", messages=HI, max_tokens=2).choices[0].message.role == "assistant"
        assert HTTP.get(f"{url}/metrics", headers={"Authorization": "Bearer sesame"}).status_code == 200


def test_request_bytes_over_the_limit_are_a_413_with_or_without_content_length(engine):
    with running_server(engine, max_request_bytes=4096) as url:
        big = {"messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 2}
        response = post(url, big)
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        chunked = HTTP.post(f"{url}/v1/chat/completions", content=iter([b'{"messages": [', b" " * 5000, b"]}"]),
                             headers={"content-type": "application/json"}, timeout=30)
        assert chunked.status_code == 413
        assert post(url, {"messages": HI, "max_tokens": 2}).status_code == 200


def test_cors_is_off_by_default_and_opens_to_the_allowed_origins(engine, server):
    origin = {"Origin": "http://app.example"}
    assert "access-control-allow-origin" not in HTTP.get(f"{server}/v1/models", headers=origin).headers
    with running_server(engine, allowed_origins=("http://app.example",), api_key="k") as url:
        preflight = httpx.options(f"{url}/v1/chat/completions", headers=origin | {
            "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "http://app.example"
        allowed = HTTP.get(f"{url}/v1/models", headers=origin | {"Authorization": "Bearer k"})
        assert allowed.headers["access-control-allow-origin"] == "http://app.example"


def test_max_model_len_is_the_window_of_every_request(engine):
    with running_server(engine, decode=DecodeConfig(truncate="error", max_model_len=256)) as url:
        assert HTTP.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == 256
        too_long = post(url, {"messages": [{"role": "user", "content": "word " * 100}], "max_tokens": 4})
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(RapidspecError, match="exceeds the model's 4096-token window"):
        create_app(engine, ServerConfig("tiny", decode=DecodeConfig(max_model_len=8192)))


class CountingEngine(SlowEngine):
    def __init__(self, engine) -> None:
        super().__init__(engine, delay=0.0)
        self.prompts_built = 0

    def chat_prompts(self, *args, **options):
        self.prompts_built += 1
        return self._engine.chat_prompts(*args, **options)


@pytest.mark.parametrize("truncate, limit", [("error", None), ("middle", 20000)])
def test_a_document_too_large_is_refused_before_the_engine_sees_it(engine, truncate, limit):
    counting = CountingEngine(engine)
    with running_server(counting, max_document_tokens=limit) as url:
        started = time.perf_counter()
        body = {"messages": HI, "documents": ["a few words. " * 400_000], "truncate": truncate, "max_tokens": 2}
        response = post(url, body)  # 5.2 MB of text
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert time.perf_counter() - started < 20  # counting stops at the limit (about a second here)
        assert counting.prompts_built == 0
        assert post(url, {"messages": HI, "max_tokens": 2}).status_code == 200


def test_a_non_streaming_client_that_leaves_frees_the_engine_within_a_round(engine):
    slow = SlowEngine(engine, delay=0.05)
    with running_server(slow) as url:
        with pytest.raises(httpx.ReadTimeout):
            post(url, {"messages": HI, "max_tokens": 400, "ignore_eos": True, "mode": "lc"}, timeout=1.0)
        assert wait_until(lambda: HTTP.get(f"{url}/health").json()["running"] == 0, timeout=10)
        assert slow.chunks_made < 100  # stopped within a few rounds of the client leaving (400 asked, 0.05 s each)


def test_time_limit_ends_the_answer_with_finish_reason_length(engine):
    slow = SlowEngine(engine, delay=0.02)
    with running_server(slow, decode=DecodeConfig(truncate="error", time_limit_s=0.3)) as url:
        out = post(url, {"messages": HI, "max_tokens": 400, "ignore_eos": True, "mode": "lc"}).json()
        assert out["choices"][0]["finish_reason"] == "length" and out["rapidspec"]["stats"]["stop_reason"] == "time"
        assert out["usage"]["completion_tokens"] < 400


UNSUPPORTED = [("functions", [{"name": "f"}]), ("function_call", "auto"), ("logit_bias", {"50": 1}), ("n", 2)]


@pytest.mark.parametrize("name, value", UNSUPPORTED)
def test_openai_fields_rapidspec_does_not_implement_are_a_400_naming_them(server, name, value):
    response = post(server, {"messages": HI, "max_tokens": 2, name: value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == name and "not supported" in error["message"]


def test_unknown_fields_are_ignored_with_a_warning(server, caplog):
    harmless = {"service_tier": "auto", "parallel_tool_calls": False, "reasoning_effort": "low", "vendor_x": {"a": 1},
                "response_format": {"type": "text"}, "logit_bias": {}, "tool_choice": "none"}
    with caplog.at_level(logging.WARNING, logger="rapidspec.server.app"):
        response = post(server, {"messages": HI, "max_tokens": 2, **harmless})
    assert response.status_code == 200, response.text
    assert "3 ('reasoning_effort', 'service_tier', 'vendor_x')" in caplog.text


def test_the_unknown_fields_log_line_is_bounded_and_escaped(server, caplog):
    """100k unknown keys made one 2 MB line, and a key holding a newline forged a log record."""
    body = {"messages": HI, "max_tokens": 2, "x\nERROR forged": 1, **{f"k{i:06d}": 0 for i in range(100_000)}}
    with caplog.at_level(logging.WARNING, logger="rapidspec"):
        response = post(server, body)
    assert response.status_code == 200, response.text
    [line] = [r.getMessage() for r in caplog.records if "ignored request fields" in r.getMessage()]
    assert len(line) < 600 and "\n" not in line and "100001 (" in line and line.endswith(", ...)"), line


def test_max_new_tokens_is_not_a_request_field(server, caplog):
    """It was logged as ignored but applied; max_tokens is the field."""
    with caplog.at_level(logging.WARNING, logger="rapidspec"):
        response = post(server, {"messages": HI, "max_tokens": 3, "max_new_tokens": 1, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    assert "max_new_tokens" in caplog.text


def test_stream_options_needs_stream_and_usage_is_null_until_the_last_chunk(server):
    refused = post(server, {"messages": HI, "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_options"
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=30)
    chunks = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens <= 4
    raw = HTTP.post(f"{server}/v1/chat/completions", json={"messages": HI, "max_tokens": 3, "stream": True,
                                                           "stream_options": {"include_usage": True}}, timeout=30)
    events = [line for line in raw.text.splitlines() if line.startswith("data: {")]
    assert all('"usage": null' in line for line in events[:-1])


def test_chat_logprobs_streamed_and_not_agree(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=30)
    body = dict(model="tiny", messages=HI, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                extra_body={"ignore_eos": True, "mode": "rapid"})
    out = client.chat.completions.create(**body)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in content)
    streamed = [e for c in client.chat.completions.create(**body, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    assert client.chat.completions.create(model="tiny", messages=HI, max_tokens=2).choices[0].logprobs is None


def test_completion_logprobs_in_the_legacy_shape(server):
    out = HTTP.post(f"{server}/v1/completions", json={"prompt": "The kettle", "max_tokens": 5, "logprobs": 2,
                                                        "ignore_eos": True}, timeout=30).json()
    logprobs = out["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 5
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"]) and logprobs["text_offset"][0] == 0


def test_tokenize_detokenize_and_version(server, engine):
    tokenized = HTTP.post(f"{server}/tokenize", json={"prompt": "hello kettle", "return_token_strs": True}).json()
    assert tokenized["tokens"] == engine.tokenizer.encode("hello kettle") and tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["max_model_len"] == 4096 and len(tokenized["token_strs"]) == tokenized["count"]
    detokenized = HTTP.post(f"{server}/detokenize", json={"tokens": tokenized["tokens"]}).json()
    assert "hello kettle" in detokenized["prompt"]
    for body in ({"tokens": [-1]}, {"tokens": [10**9]}, {"prompt": "a", "messages": HI}, {}):
        route = "/detokenize" if "tokens" in body else "/tokenize"
        response = HTTP.post(f"{server}{route}", json=body)
        assert response.status_code == 400 and "error" in response.json()
    assert HTTP.get(f"{server}/version").json()["version"]
