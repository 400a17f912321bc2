"""`rapidspec serve --replicas`: two replicas of the tiny model on a local Ray Serve (127.0.0.1, 2 CPUs).

8 concurrent chats from 4 conversations, each conversation's turns sent with
its ``x-session-id``, then as plain OpenAI requests (the proxy keys them by
their leading messages): nothing lost, every second turn reuses the first turn's
prefix (the conversation stayed on its replica); /health and /metrics cover
both replicas. A conversation whose replica is busy waits for it while its
line is short (and reuses its prefix), and goes to the other replica once
the line is at the router's bound (counted in /metrics). A replica killed
mid-answer: its plain request gets a 5xx and its stream ends with an error
event and ``[DONE]`` within seconds (none hangs), the next requests are
served by the other replica at once, Serve restarts it, and conversations
keep their prefix again.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import pytest

from rapidspec.engine.spec import EngineSpec
from rapidspec.models.spec import ModelSpec
from rapidspec.retrieval import RetrievalConfig
from rapidspec.scale.fleet import REPORT_EVERY_S
from rapidspec.server import ServerConfig
from tests.server_harness import HTTP, free_port, wait_until


NOTES = [f"Day {i}: the garden had {i} tulips and the kettle was blue." for i in range(30)]


@pytest.fixture(scope="module")
def replicas(local_ray, tiny_model_dir):
    from ray import serve

    from rapidspec.scale.replicas import deploy

    port = free_port()
    retrieval = RetrievalConfig(method="bm25", chunk_tokens=64, budget_tokens=128)
    spec = EngineSpec(ModelSpec(target=str(tiny_model_dir)), retrieval)
    config = ServerConfig(model_name="tiny", max_num_seqs=2, retrieval=retrieval)
    try:
        board = deploy(spec, config, replicas=2, resources={"num_cpus": 0.5}, host="127.0.0.1", port=port)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # bounded: until both replicas have reported
            try:
                if len(HTTP.get(f"{url}/health", timeout=5).json().get("replicas", [])) == 2:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the replicas did not come up within 240 s")
        _until_the_router_sends_to_both(url)
        yield url
        del board
    finally:
        serve.shutdown()


def _until_the_router_sends_to_both(url: str, timeout: float = 120) -> None:
    """Short requests of new sessions until each running replica has answered one: /health lists them from their
    own reports, while the proxy's router may learn of the second one later; a conversation whose first turn came
    before would find another home for its next (rendezvous hashing over the replicas the router knows)."""
    deadline, session = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        served, running = _served(url), [r["replica"] for r in _replicas(url)]  # not a killed one's old counts
        if len(running) == 2 and all(served.get(replica, 0) > 0 for replica in running):
            return
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello."}], "max_tokens": 1, "mode": "lc"}
        HTTP.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": f"warm-up-{session}"}, timeout=60)
        session += 1
        time.sleep(0.5)  # replicas report once a second
    pytest.fail(f"the router did not send to both replicas within {timeout:.0f} s: {_served(url)}")


def _turn(url: str, conversation: int | str, turns: int, header: bool) -> dict:
    notes = NOTES[conversation::4] if isinstance(conversation, int) else [conversation, *NOTES[:6]]
    messages = [{"role": "user", "content": " ".join(notes) + ("" if header else " (plain)")}]
    for turn in range(turns - 1):
        messages += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": f"And turn {turn}?"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "ignore_eos": True, "mode": "lc"}
    headers = {"x-session-id": f"conversation-{conversation}"} if header else {}
    response = HTTP.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _reused(answer: dict) -> int:
    return answer["rapidspec"]["stats"]["target_prefill_reused_tokens"]


LONG = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me everything."}], "max_tokens": 4000,
        "ignore_eos": True, "mode": "lc"}


class Stream:
    """A long streamed answer read in a thread until :meth:`close` (or its end); ``lines``: what arrived."""

    def __init__(self, url: str, session: str) -> None:
        self.lines: list[str] = []
        self.ended: float | None = None
        self.error: Exception | None = None
        self._stop = threading.Event()
        self._response: httpx.Response | None = None
        self._thread = threading.Thread(target=self._read, args=(url, session), daemon=True)
        self._thread.start()

    def _read(self, url: str, session: str) -> None:
        try:
            with HTTP.stream("POST", f"{url}/v1/chat/completions", json={**LONG, "stream": True},
                              headers={"x-session-id": session}, timeout=120) as response:
                self._response = response
                if self._stop.is_set():
                    return
                for line in response.iter_lines():
                    self.lines.append(line)
                    if self._stop.is_set():
                        break
        except httpx.HTTPError as err:  # a dropped connection, where an error event was due
            self.error = err
        self.ended = time.monotonic()

    def close(self, timeout: float = 60) -> None:
        """Stop reading: at the next line, or at once for a stream still waiting for its first one."""
        self._stop.set()
        if self._response is not None and not self.lines:  # queued: no line would come to see the flag
            with contextlib.suppress(Exception):
                self._response.close()
        self._thread.join(timeout)
        assert not self._thread.is_alive()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _replicas(url: str) -> list[dict]:
    return HTTP.get(f"{url}/health", timeout=10).json()["replicas"]


def _idle(url: str) -> bool:
    return all(r["running"] == r["waiting"] == 0 for r in _replicas(url))


def _busy(url: str, running: int, waiting: int) -> str | None:
    """The replica with ``running`` requests running and ``waiting`` waiting, if one has."""
    return next((r["replica"] for r in _replicas(url) if (r["running"], r["waiting"]) == (running, waiting)), None)


def _overflow_lines(url: str) -> list[str]:
    """/metrics' overflow counters, one line per reason (``line``: the home's line was full; ``wait``: it did not
    take the request within the router's max_wait_s)."""
    lines = HTTP.get(f"{url}/metrics", timeout=10).text.splitlines()
    return [line for line in lines if line.startswith("rapidspec:affinity_overflow_total")]


def _overflows(url: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in _overflow_lines(url))


@pytest.mark.parametrize("header", [True, False], ids=["x-session-id", "plain-openai"])
def test_conversations_stay_on_their_replica_and_nothing_is_lost(replicas, header):
    answers: dict[tuple[int, int], dict] = {}
    finished_before = sum(_settled(replicas).values())

    def chat(conversation: int) -> None:
        for turns in (1, 2):
            answers[(conversation, turns)] = _turn(replicas, conversation, turns, header)

    threads = [threading.Thread(target=chat, args=(c,)) for c in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert len(answers) == 8  # 8 chats, none lost
    for conversation in range(4):
        second = answers[(conversation, 2)]["rapidspec"]["stats"]
        # the first turn's cache was there; where not, say whether the router sent the turn elsewhere
        assert second["target_prefill_reused_tokens"] > 0, (conversation, _served(replicas), _overflow_lines(replicas))
    health = HTTP.get(f"{replicas}/health", timeout=10).json()
    assert health["status"] == "ok" and len(health["replicas"]) == 2
    assert "static/app.js" in HTTP.get(f"{replicas}/", timeout=10).text  # the page, through Serve's proxy
    # replicas report once a second
    assert wait_until(lambda: sum(_served(replicas).values()) == finished_before + 8, timeout=15)


def _settled(url: str, timeout: float = 30) -> dict[str, float]:
    """:func:`_served` once two reads a report apart agree: a request that ended just before is counted."""
    last, deadline = _served(url), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1.5 * REPORT_EVERY_S)
        now = _served(url)
        if now == last:
            return now
        last = now
    pytest.fail(f"the replicas' reports did not settle within {timeout:.0f} s: {last}")


def _served(url: str) -> dict[str, float]:
    """Replica -> finished requests, from the merged /metrics."""
    out: dict[str, float] = {}
    for line in HTTP.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("rapidspec:request_success_total{"):
            replica = line.split('replica="')[1].split('"')[0]
            out[replica] = out.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_a_busy_replica_holds_its_conversation_until_its_line_reaches_the_bound(replicas):
    """The bound is 2 x max_num_seqs = 4 requests (rapidspec.scale.router.default_max_line).

    Replicas report once a second, so every wait on /health passes through an idle fleet first: a report
    from before cannot pass for the state awaited.
    """
    _turn(replicas, "held", 1, header=True)
    overflows = _overflows(replicas)
    streams: list[Stream] = []
    try:
        assert wait_until(lambda: _idle(replicas), 60, 0.2)
        streams = [Stream(replicas, "conversation-held") for _ in range(3)]  # its home: 2 running, 1 waiting
        assert wait_until(lambda: _busy(replicas, 2, 1), 60, 0.2)
        answer: dict = {}
        second = threading.Thread(target=lambda: answer.update(_turn(replicas, "held", 2, header=True)))
        second.start()  # line 3 < 4: it waits for its home
        assert wait_until(lambda: _busy(replicas, 2, 2), 30, 0.1), (_replicas(replicas), _overflow_lines(replicas))
        for stream in streams:
            stream.close()  # the home's slots free up: the turn runs there
        second.join(120)
        assert _reused(answer) > 0 and _overflows(replicas) == overflows  # it found its prefix: it waited
        assert wait_until(lambda: _idle(replicas), 60, 0.2)
        streams = [Stream(replicas, "conversation-held") for _ in range(4)]  # the home's line: 4
        assert wait_until(lambda: _busy(replicas, 2, 2), 60, 0.2)
        started = time.monotonic()
        elsewhere = _turn(replicas, "held", 3, header=True)  # at the bound: the other, idle, replica answers
        assert time.monotonic() - started < 30 and elsewhere["usage"]["completion_tokens"] == 4  # not queued
        assert wait_until(lambda: _overflows(replicas) == overflows + 1, 10, 0.2)  # counted in /metrics
    finally:
        for stream in streams:
            stream.close()


def test_a_killed_replica_ends_its_requests_cleanly_and_the_others_serve_at_once(replicas):
    pids = {r["replica"]: r["pid"] for r in _replicas(replicas)}
    outcome: dict = {}
    assert wait_until(lambda: _idle(replicas), 60, 0.2)  # a report from before cannot name the wrong replica

    def long_answer() -> None:
        try:
            outcome["response"] = HTTP.post(f"{replicas}/v1/chat/completions", json=LONG,
                                             headers={"x-session-id": "doomed"}, timeout=120)
        except httpx.HTTPError as err:  # a dropped connection is an error too, not a hang
            outcome["error"] = err

    thread = threading.Thread(target=long_answer)
    thread.start()
    stream = Stream(replicas, "doomed")  # the same session: the same replica
    deadline = time.monotonic() + 60
    busy = None
    while (busy is None or not stream.lines) and time.monotonic() < deadline:
        busy = _busy(replicas, 2, 0)
        time.sleep(0.2)
    assert busy is not None and len(stream.lines) > 0
    os.kill(pids[busy], signal.SIGKILL)
    killed = time.monotonic()
    assert stream.join(30) and stream.ended - killed < 20  # ended within seconds, not hung
    events = [line.removeprefix("data: ") for line in stream.lines if line.startswith("data: ")]
    assert stream.error is None and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_unavailable" and error["type"] == "server_error"
    thread.join(150)
    assert not thread.is_alive()  # answered, not hung
    if "response" in outcome:  # the proxy's own 500, in OpenAI's body
        response = outcome["response"]
        assert response.status_code >= 500 and response.json()["error"]["code"] == "replica_unavailable"
    started = time.monotonic()
    for conversation in ("doomed", 0):  # the surviving replica serves the next requests at once
        assert _turn(replicas, conversation, 1, header=True)["usage"]["completion_tokens"] == 4
    assert time.monotonic() - started < 30

    def restarted() -> bool:  # Serve replaced the dead replica: two report again, the killed process not among them
        health = _replicas(replicas)
        return len(health) == 2 and pids[busy] not in {r["pid"] for r in health}

    assert wait_until(restarted, timeout=180, every=1.0)
    _until_the_router_sends_to_both(replicas)  # the router learns the new set by Serve's long poll, not at once
    for conversation in ("after-1", "after-2", "after-3"):  # conversations keep their prefix on the new set
        _turn(replicas, conversation, 1, header=True)
        assert _reused(_turn(replicas, conversation, 2, header=True)) > 0, conversation


def test_replica_options_are_checked_before_anything_starts(capsys):
    from rapidspec.cli import main

    assert main(["serve", "--ray-address", "auto"]) == 2
    assert "--ray-address and --replica-resources apply with --replicas" in capsys.readouterr().err
    assert main(["serve", "--replicas", "2", "--replica-resources", "[1]"]) == 2
    assert "--replica-resources must be a JSON object" in capsys.readouterr().err
    assert main(["serve", "--replicas", "2", "--port", "0"]) == 2
    assert "--replicas needs a --port" in capsys.readouterr().err
