"""A client that leaves before its stream's first byte is counted and its job stopped (server.responses.EventStream).

Starlette never starts a streaming body whose response start cannot be sent, so the stream's own ``finally``
(which cancels the job and counts the request) never ran: a soak closed 144 streams and the server counted 140.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from rapidspec import Rapid
from rapidspec.server.app import ServerConfig, create_app
from rapidspec.server.responses import EventStream

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1", "method": "POST",
         "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
         "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}


def _gone_at(sent_before_failing: int):
    """An ASGI send that fails like a closed socket after ``sent_before_failing`` messages, and what it sent."""
    sent = []

    async def send(message):
        if len(sent) >= sent_before_failing:
            raise OSError("the client closed the connection")
        sent.append(message)

    return send, sent


async def _never_disconnects():
    await asyncio.sleep(3600)


def test_a_stream_that_never_started_calls_unsent_once():
    ran, unsent = [], []

    async def events():
        ran.append("started")
        yield "data: 1\n\n"

    send, _ = _gone_at(0)
    with pytest.raises(Exception):  # Starlette turns the OSError into ClientDisconnect
        asyncio.run(EventStream(events(), lambda: unsent.append(1))(dict(SCOPE), _never_disconnects, send))
    assert ran == [] and unsent == [1]


def test_a_stream_cut_midway_is_closed_at_once_and_not_counted_twice():
    closed, unsent = [], []

    async def events():
        try:
            for i in range(5):
                yield f"data: {i}\n\n"
        finally:
            closed.append("finally")  # what the server's stream does here: cancel the job, count the request

    send, sent = _gone_at(2)  # the response start and one event, then the socket is gone
    with pytest.raises(Exception):
        asyncio.run(EventStream(events(), lambda: unsent.append(1))(dict(SCOPE), _never_disconnects, send))
    assert len(sent) == 2 and closed == ["finally"] and unsent == []


def test_the_server_counts_and_stops_a_stream_whose_client_left_before_it_began(tiny_model):
    app = create_app(Rapid(target=tiny_model, drafter=None), ServerConfig(model_name="tiny", disconnect_poll_seconds=0.1))
    state = app.state.server
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400,
                       "ignore_eos": True, "mode": "lc", "stream": True}).encode()
    scope = {**SCOPE, "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    delivered = []

    async def receive():
        if not delivered:
            delivered.append(1)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # the server notices the client only when it writes

    send, sent = _gone_at(0)
    try:
        with pytest.raises(Exception):
            asyncio.run(app(scope, receive, send))
        assert sent == []
        assert state.metrics.registry.get_sample_value("rapidspec:request_failure_total",
                                                  {"model_name": "tiny", "reason": "cancelled"}) == 1
        deadline = time.monotonic() + 30
        while state.worker.running and time.monotonic() < deadline:  # stopped after its current round
            time.sleep(0.02)
        assert state.worker.running == 0
    finally:
        state.worker.stop()
