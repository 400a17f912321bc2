"""SIGTERM drains `rapidspec serve`: running requests finish, new ones get 503 (OpenAI's body, Retry-After), then exit.

One test sends a real SIGTERM to `rapidspec serve` in a subprocess (the tiny
model saved to disk); one drives the drain of a server in a thread (the
signal handler called directly) to check its time limit: what still runs
after it is cancelled and the server exits.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from rapidspec import Rapid
from rapidspec.retrieval import RetrievalConfig
from rapidspec.server import ServerConfig, create_app
from rapidspec.server.http import RETRY_AFTER_S, DrainingServer, uvicorn_config
from tests.server_harness import HTTP, SlowEngine, free_port, metric, serve_subprocess, wait_until
from tests.specs import spec_of

ASK = {"messages": [{"role": "user", "content": "Tell me a long story."}], "ignore_eos": True, "mode": "lc"}


def _assert_refused(url: str) -> None:
    """A new generation request is a 503 in OpenAI's body, with Retry-After; /health says draining."""
    refused = HTTP.post(f"{url}/v1/chat/completions", json={**ASK, "max_tokens": 4}, timeout=10)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"] == {"message": refused.json()["error"]["message"], "type": "server_error",
                                       "param": None, "code": "shutting_down"}
    assert refused.headers["retry-after"] == str(RETRY_AFTER_S)
    health = HTTP.get(f"{url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert metric(url, "rapidspec:request_failure_total", reason="shutting_down") >= 1  # /metrics still answers


def _events(lines) -> list:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def test_sigterm_drains_running_requests_refuses_new_ones_and_exits_0(tiny_model_dir):
    with serve_subprocess("--target", str(tiny_model_dir), "--retrieval", "bm25", "--dtype", "float32",
                          "--shutdown-timeout", "60", "--max-model-len", "1024", "--request-time-limit", "120") \
            as (process, url):
        with HTTP.stream("POST", f"{url}/v1/chat/completions", json={**ASK, "max_tokens": 600, "stream": True},
                          timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # generating
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()

            def draining() -> bool:
                return HTTP.get(f"{url}/health", timeout=5).json()["status"] == "draining"
            assert wait_until(draining, timeout=10, every=0.05)
            _assert_refused(url)
            events = _events(lines)
        assert events[-1] == "[DONE]"  # the running request finished
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e)["choices"]]
        assert finish[-1] == "length"
        assert process.wait(timeout=30) == 0
        assert time.monotonic() - signalled < 60
    log = process.stdout.read().decode()
    assert "Traceback" not in log and "draining" in log


@pytest.fixture(scope="module")
def engine(tiny_model, other_tiny_model):
    return Rapid(spec_of(retrieval=RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=200)),
                 target=tiny_model, drafter=other_tiny_model)


def test_the_drain_ends_at_its_time_limit_and_cancels_what_still_runs(engine):
    slow = SlowEngine(engine, delay=0.05)  # a 2,000-token answer takes over a minute
    app = create_app(slow, ServerConfig(model_name="tiny", disconnect_poll_seconds=0.1))
    port = free_port()
    server = DrainingServer(uvicorn_config(app, "127.0.0.1", port, log_level="warning", timeout_graceful_shutdown=2),
                            app.state.server.drain, timeout_s=2.0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    assert wait_until(lambda: server.started, timeout=30)
    received: list[str] = []

    def long_stream() -> None:
        try:
            with HTTP.stream("POST", f"{url}/v1/chat/completions", json={**ASK, "max_tokens": 2000, "stream": True},
                              timeout=60) as stream:
                received.extend(stream.iter_lines())
        except httpx.HTTPError:
            received.append("cut")

    client = threading.Thread(target=long_stream)
    client.start()
    try:
        assert wait_until(lambda: slow.chunks_made > 0, timeout=30)
        server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        _assert_refused(url)
        started = time.monotonic()
        thread.join(30)
        assert not thread.is_alive() and time.monotonic() - started < 10  # 2 s of drain, then at most 2 s more
        client.join(30)
        assert not client.is_alive() and "data: [DONE]" not in received  # cancelled, not finished
    finally:
        server.should_exit = True
        thread.join(15)
