"""The OpenAI-compatible server, driven through the official ``openai`` client on 127.0.0.1.

The engine is a tiny random model (fp32), so answers are random bytes, but the
invariants still hold: greedy with eta = 0 gives lc's tokens through the server.
"""

from __future__ import annotations

import threading

import openai
import pytest

from rapidspec import Rapid
from rapidspec.drafting.eta_default import DEFAULT_ETA
from rapidspec.retrieval import RetrievalConfig
from tests.server_harness import HTTP, SlowEngine, metric, running_server, wait_until
from tests.specs import spec_of

RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=200)
NOTES = [f"Day {i}: the garden had {i} tulips and the kettle was blue." for i in range(40)]
HISTORY = [
    {"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(NOTES[:30])
] + [{"role": "user", "content": "How many tulips were there on day 17?"}]


@pytest.fixture(scope="module")
def engine(tiny_model, other_tiny_model):
    return Rapid(spec_of(retrieval=RETRIEVAL), target=tiny_model, drafter=other_tiny_model)


@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine, max_document_tokens=32768) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_and_health(client, server, engine):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = HTTP.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["running"] == 0 and health["waiting"] == 0
    # which eta rapid uses when a request names none, and why (the drafter is another model of the same size)
    assert health["rapid_eta"] == {"default": DEFAULT_ETA["larger"], "reason": "default for a drafter at least as large as the target",
                                   "drafter": engine.drafter_label, "drafter_relation": "larger"}


def test_health_names_the_step_costs_the_decisions_read(client, server):
    """A cost-scheduled request reads the target's verify costs: /health shows them with when and how measured."""
    client.chat.completions.create(model="tiny", messages=HISTORY, max_tokens=4,
                                   extra_body={"ignore_eos": True, "mode": "rapid", "gamma_schedule": "cost",
                                               "drafter_start": "first"})
    entries = HTTP.get(f"{server}/health").json()["calibration"]
    verify = [e for e in entries if "verify at" in e["key"]]
    assert verify and all({"base", "per_token", "measured_at", "load", "others", "busy"} <= set(e) for e in verify)


def test_chat_completion_usage_and_statistics(client):
    out = client.chat.completions.create(
        model="tiny", messages=HISTORY, max_tokens=12,
        extra_body={"ignore_eos": True, "mode": "rapid", "gamma": 3, "drafter_start": "first"},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    stats = out.model_extra["rapidspec"]["stats"]
    assert out.usage.completion_tokens == stats["new_tokens"] == 12
    assert out.usage.prompt_tokens == stats["prompt_tokens_target"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert stats["mode"] == "rapid" and stats["gamma"] == 3 and stats["drafted_tokens"] > 0
    assert stats["eta"] == DEFAULT_ETA["larger"] and stats["eta_source"] == "default for a drafter at least as large as the target"
    assert out.model_extra["rapidspec"]["retrieval"]["num_chunks"] > 0
    assert out.model_extra["rapidspec"]["retrieved_turns"]
    assert stats["drafter_joined_at"] == 0 and stats["time_to_first_token"] > 0
    spec = out.model_extra["metrics"]["speculative_decoding"]  # vLLM's per-request schema
    assert spec["num_draft_tokens"] == stats["drafted_tokens"] and spec["num_accepted_draft_tokens"] == stats["accepted_tokens"]
    assert sum(spec["acceptance_histogram"]) == spec["num_drafts"] == stats["rounds"] - stats["plain_rounds"]


def test_greedy_eta_zero_through_the_server_equals_lc(client, engine):
    lc = engine.chat(HISTORY, mode="lc", max_new_tokens=16, ignore_eos=True)
    for mode in ("lc", "ragsd", "rapid", "magicdec"):
        extra = {"mode": mode, "ignore_eos": True} | ({"eta": 0} if mode == "rapid" else {})
        extra |= {"streaming_tokens": 64} if mode == "magicdec" else {}
        out = client.chat.completions.create(model="tiny", messages=HISTORY, max_tokens=16, extra_body=extra)
        assert out.choices[0].message.content == lc.text, mode
    extra = {"mode": "ragsd", "ignore_eos": True, "gamma_schedule": "cost"}
    out = client.chat.completions.create(model="tiny", messages=HISTORY, max_tokens=16, extra_body=extra)
    assert out.choices[0].message.content == lc.text
    assert out.model_extra["rapidspec"]["stats"]["gamma_schedule"] == "cost"


def test_streaming_matches_non_streaming_and_reports_usage(client):
    body = dict(model="tiny", messages=HISTORY, max_tokens=10, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**body).choices[0].message.content
    chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert finish[0].model_extra["rapidspec"]["stats"]["new_tokens"] == 10
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    for chunk in (finish[0], chunks[-1]):  # vLLM's per-request metrics beside usage and the statistics
        assert chunk.model_extra["metrics"]["speculative_decoding"]["num_draft_tokens"] == \
            finish[0].model_extra["rapidspec"]["stats"]["drafted_tokens"]
    no_usage = list(client.chat.completions.create(**body, stream=True))
    assert all(c.usage is None for c in no_usage)


def test_documents_and_retrieved_spans(client):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "How many tulips on day 33?"}], max_tokens=4,
        extra_body={"documents": [{"title": "Garden log", "text": "\n".join(NOTES)}], "budget_tokens": 120},
    )
    retrieval = out.model_extra["rapidspec"]["retrieval"]
    assert 0 < retrieval["num_tokens"] <= 120
    assert all(c["char_end"] > c["char_start"] for c in retrieval["chunks"])


def test_next_turn_reuses_the_history(client):
    first = client.chat.completions.create(model="tiny", messages=HISTORY, max_tokens=4, extra_body={"mode": "lc"})
    follow = HISTORY + [{"role": "assistant", "content": "Seventeen."}, {"role": "user", "content": "And the kettle?"}]
    second = client.chat.completions.create(model="tiny", messages=follow, max_tokens=4, extra_body={"mode": "lc"})
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1
    assert second.model_extra["rapidspec"]["stats"]["target_prefill_reused_tokens"] == cached


def test_text_completions_with_documents_and_streaming(client):
    out = client.completions.create(model="tiny", prompt="The garden log says", max_tokens=5,
                                    extra_body={"documents": NOTES[:5], "ignore_eos": True})
    assert out.object == "text_completion" and out.usage.completion_tokens == 5
    streamed = list(client.completions.create(model="tiny", prompt="The garden log says", max_tokens=5, stream=True,
                                              extra_body={"documents": NOTES[:5], "ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text


LONG = "word " * 5000
BAD_BODIES = [
    ('{"model": "tiny", "messages": [', "json_invalid", None),
    ({"model": "tiny"}, "missing", "messages"),
    ({"model": "tiny", "messages": "hello"}, None, "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2}, None, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, None, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**5},
     "context_length_exceeded", "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, None, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_gamma": 10**7,
      "gamma_schedule": "cost"}, None, "max_gamma"),
    ({"model": "tiny", "messages": []}, None, "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": LONG}]}, "context_length_exceeded", "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "mode": "sd", "eta": 2}, None, "eta"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "mode": "magicdec", "sink_tokens": 8,
      "streaming_tokens": 10}, None, "streaming_tokens"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, None, "messages[0].role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, None, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "drafter_backend": "vllm"}, None, "drafter_backend"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, None, "seed"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e-40}, None, "temperature"),
    # the tiny target has no GGUF file for llama.cpp to read
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "drafter_backend": "llama.cpp"}, None, None),
]


@pytest.mark.parametrize("body, code, param", BAD_BODIES)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_is_a_400_with_openai_error_schema(server, body, code, param, stream):
    if stream and isinstance(body, dict):
        body = body | {"stream": True}
    response = HTTP.post(f"{server}/v1/chat/completions", timeout=30, headers={"content-type": "application/json"},
                          **({"content": body} if isinstance(body, str) else {"json": body}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert "Traceback" not in response.text and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_model_is_a_404_as_openai_answers(server, stream):
    body = {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    response = HTTP.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")


def test_null_means_the_default_for_every_optional_field(client):
    """OpenAI clients send null for "default"; none of them may fail the request."""
    nulls = {name: None for name in ("temperature", "top_p", "n", "stop", "seed", "stream", "stream_options", "user",
                                     "metadata", "store", "frequency_penalty", "presence_penalty", "repetition_penalty", "logprobs",
                                     "max_completion_tokens", "mode", "eta", "gamma", "gamma_schedule", "max_gamma",
                                     "draft_confidence", "top_k", "draft_gate", "residual", "ignore_eos", "truncate",
                                     "sink_tokens", "streaming_tokens", "drafter_backend", "documents", "query",
                                     "recent_messages", "retrieval", "budget_tokens", "chunk_tokens")}
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                         extra_body=nulls)
    assert out.choices[0].message.content is not None and out.usage.completion_tokens <= 3


def test_truncate_option_lets_a_long_prompt_through(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": LONG + "\n\nWhat?"}],
                                         max_tokens=2, extra_body={"truncate": "middle", "mode": "lc"})
    assert out.model_extra["rapidspec"]["stats"]["document_tokens_truncated"] > 0


def test_unknown_route_is_a_404_in_the_same_schema(server):
    response = HTTP.get(f"{server}/v1/nothing")
    assert response.status_code == 404 and "error" in response.json()


def test_full_queue_answers_429_and_nothing_is_lost(engine):
    slow = SlowEngine(engine, delay=0.05)
    with running_server(slow, max_queue=1, max_num_seqs=1) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        body = dict(model="tiny", messages=HISTORY, extra_body={"ignore_eos": True, "mode": "lc"})
        running = client.chat.completions.create(**body, max_tokens=400, stream=True)
        next(iter(running))  # the engine is now busy
        results = {}
        waiter = threading.Thread(target=lambda: results.update(
            waiting=client.chat.completions.create(**body, max_tokens=3)))
        waiter.start()
        assert wait_until(lambda: HTTP.get(f"{url}/health").json()["waiting"] == 1)
        with pytest.raises(openai.RateLimitError) as err:
            client.chat.completions.create(**body, max_tokens=3)
        assert err.value.status_code == 429 and err.value.body["code"] == "queue_full"
        running.close()  # the client goes away: the engine is freed at the next round
        waiter.join(30)
        assert results["waiting"].usage.completion_tokens == 3
        assert metric(url, "rapidspec:request_failure_total", reason="queue_full") == 1
        assert wait_until(lambda: metric(url, "rapidspec:request_failure_total", reason="cancelled") == 1)


def test_a_short_request_is_answered_while_a_long_one_streams(engine):
    slow = SlowEngine(engine, delay=0.05)
    with running_server(slow, max_num_seqs=2) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        body = dict(model="tiny", messages=HISTORY, extra_body={"ignore_eos": True, "mode": "rapid"})
        long = client.chat.completions.create(**body, max_tokens=400, stream=True)
        next(iter(long))  # the long answer is running
        short = client.chat.completions.create(**body, max_tokens=3)
        assert short.usage.completion_tokens == 3
        # the short one leaves the running set just after its answer's end is sent
        assert wait_until(lambda: HTTP.get(f"{url}/health").json()["running"] == 1, timeout=10)  # the long one runs
        assert HTTP.get(f"{url}/health").json()["max_num_seqs"] == 2
        long.close()
        assert slow.chunks_made < 400


def test_a_client_that_disconnects_frees_the_engine(engine):
    slow = SlowEngine(engine, delay=0.05)
    with running_server(slow) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.chat.completions.create(model="tiny", messages=HISTORY, max_tokens=2000, stream=True,
                                                extra_body={"ignore_eos": True, "mode": "lc"})
        next(iter(stream))
        stream.close()
        assert wait_until(lambda: HTTP.get(f"{url}/health").json()["running"] == 0)
        made = slow.chunks_made
        assert made < 200  # stopped long before 2000 tokens
        out = client.chat.completions.create(model="tiny", messages=HISTORY, max_tokens=2)
        assert out.usage.completion_tokens == 2


def test_metrics_move(client, server):
    before = metric(server, "rapidspec:request_success_total", finished_reason="length")
    generated = metric(server, "rapidspec:generation_tokens_total")
    hits, refused = metric(server, "rapidspec:prefix_cache_hits_total"), metric(
        server, "rapidspec:request_failure_total", reason="bad_request")
    for _ in range(2):  # the second finds the first's prompt in the prefix cache
        client.chat.completions.create(model="tiny", messages=HISTORY, max_tokens=6,
                                       extra_body={"ignore_eos": True, "mode": "rapid", "drafter_start": "first"})
    assert HTTP.post(f"{server}/v1/chat/completions", content=b"hello", timeout=30).status_code == 400
    not_utf8 = HTTP.post(f"{server}/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "\xff"}]}',
                         headers={"Content-Type": "application/json"}, timeout=30)
    assert not_utf8.status_code == 400 and "not valid JSON in UTF-8" in not_utf8.json()["error"]["message"]
    assert metric(server, "rapidspec:request_success_total", finished_reason="length") == before + 2
    assert metric(server, "rapidspec:generation_tokens_total") == generated + 12
    assert metric(server, "rapidspec:spec_decode_num_draft_tokens_total") > 0
    assert 0 <= metric(server, "rapidspec:spec_decode_draft_acceptance_rate") <= 1
    assert metric(server, "rapidspec:time_to_first_token_seconds_count") > 0
    assert metric(server, "rapidspec:e2e_request_latency_seconds_count") > 0
    assert metric(server, "rapidspec:prefix_cache_hits_total") > hits
    assert metric(server, "rapidspec:request_failure_total", reason="bad_request") == refused + 2
    assert metric(server, "rapidspec:prefix_cache_bytes") > 0  # the first request's cache, kept


def test_a_body_that_is_not_a_json_object_is_a_400(server):
    response = HTTP.post(f"{server}/v1/chat/completions", content=b"hello", timeout=30)
    assert response.status_code == 400 and "JSON object" in response.json()["error"]["message"]


def test_sigterm_lets_the_running_request_finish_and_exits_0(tiny_model_dir):
    """`rapidspec serve` in a subprocess (a tiny model saved to disk): SIGTERM mid-stream; the limits' flags."""
    import os
    import signal
    import time

    from tests.server_harness import serve_subprocess

    model_dir = tiny_model_dir
    with serve_subprocess("--target", str(model_dir), "--retrieval", "bm25", "--shutdown-timeout", "20",
                          "--dtype", "float32", "--max-model-len", "3600", "--request-time-limit", "120",
                          env=os.environ | {"RAPIDSPEC_API_KEY": "sesame"}) as (process, url):
        assert HTTP.get(f"{url}/v1/models").status_code == 401
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0, timeout=60)
        assert client.models.list().data[0].model_extra["max_model_len"] == 3600
        stream = client.chat.completions.create(model=str(model_dir), messages=HISTORY, max_tokens=1500, stream=True,
                                                extra_body={"ignore_eos": True, "mode": "lc"})
        chunks = iter(stream)
        received = [next(chunks)]
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        received.extend(chunks)
        finish = [c.choices[0].finish_reason for c in received if c.choices and c.choices[0].finish_reason]
        assert finish == ["length"]  # the in-flight request completed
        assert process.wait(timeout=30) == 0
        assert time.monotonic() - started < 30
    log = process.stdout.read().decode()
    assert "Traceback" not in log


def test_penalties_are_request_fields_with_the_engines_meaning(client, engine):
    """frequency_penalty, presence_penalty (OpenAI's) and repetition_penalty (vLLM's extra) reach the engine; out of
    range they are a 400 naming the field."""
    messages = [{"role": "user", "content": "Say something about apples and pears."}]
    penalties = {"frequency_penalty": 1.0, "presence_penalty": 0.5}
    served = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, **penalties,
                                            extra_body={"repetition_penalty": 1.5, "mode": "lc"})
    direct = engine.chat(messages, max_new_tokens=24, mode="lc", repetition_penalty=1.5, **penalties)
    assert served.choices[0].message.content == direct.text
    plain = engine.chat(messages, max_new_tokens=24, mode="lc")
    assert plain.token_ids != direct.token_ids
    for field, value in (("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0)):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, extra_body={field: value})
        assert field in str(caught.value)
