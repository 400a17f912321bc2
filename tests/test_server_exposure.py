"""What a server on an open port must hold against (issue: hardening, round two), on the tiny model.

Connection level (raw sockets): half-sent heads are closed within the read
timeout, stalled bodies get 408, oversize heads 400, HEAD /health 200.
Requests beside expensive ones: preparation (sizing, retrieval, prompts)
runs off the engine thread and is counted by the time limit; abandoned
requests free what they hold; log-probabilities never wait on the size
checks' tokenizer; /tokenize is bounded. Waits are on events, not on
timings, except the read timeout itself (0.4 s here, each wait bounded).
"""

from __future__ import annotations

import gc
import json
import socket
import threading
import time
import weakref

import httpx
import pytest

from rapidspec import Rapid
from rapidspec.config import DecodeConfig
from rapidspec.retrieval import RetrievalConfig
from rapidspec.server.worker import Worker
from tests.hostile import GOOD, HI, check, post
from tests.server_harness import HTTP, SlowEngine, running_server, wait_until
from tests.specs import spec_of

READ_TIMEOUT_S = 0.4


class GatedEngine:
    """An engine whose preparation of a request with a document holding "GATE" waits until ``gate`` is set."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.gate, self.preparing = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def chat_prompts(self, messages, config, **options):
        if any("GATE" in d for d in options.get("documents") or ()):
            self.preparing.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return self._engine.chat_prompts(messages, config, **options)


@pytest.fixture(scope="module")
def rapid(tiny_model, other_tiny_model):
    return Rapid(spec_of(retrieval=RetrievalConfig(method="bm25")), target=tiny_model, drafter=other_tiny_model)


@pytest.fixture(scope="module")
def server(rapid):
    with running_server(rapid, read_timeout_s=READ_TIMEOUT_S) as url:
        yield url


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _read_all(sock: socket.socket, within: float) -> bytes:
    """What the server sends until it closes the connection (bounded by ``within`` seconds)."""
    sock.settimeout(within)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, socket.timeout):
        raise AssertionError(f"the server kept the connection open for more than {within} s; got {data[:200]!r}")
    except ConnectionResetError:
        pass
    return data


# ------------------------------------------------------------ connection level
@pytest.mark.parametrize("sent", [
    b"", b"POST /v1/chat/completions HTTP/1.1\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: 1",
    b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Long: " + b"a" * 30_000,
], ids=["nothing", "request-line", "unfinished-header", "long-unfinished-header"])
def test_a_half_sent_head_is_closed_within_the_read_timeout(server, sent):
    started = time.monotonic()  # before the connection: the server's timer starts when it accepts it
    with _connect(server) as sock:
        sock.sendall(sent)
        _read_all(sock, within=READ_TIMEOUT_S + 5)
        assert time.monotonic() - started >= READ_TIMEOUT_S * 0.9


def test_many_half_open_connections_are_all_closed(server):
    socks = [_connect(server) for _ in range(50)]
    try:
        for sock in socks:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        for sock in socks:
            _read_all(sock, within=READ_TIMEOUT_S + 10)
    finally:
        for sock in socks:
            sock.close()
    assert post(server, body=GOOD)[0].status_code == 200


def test_a_stalled_body_gets_a_408_and_the_connection_closes(server):
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"messages\":")
        data = _read_all(sock, within=READ_TIMEOUT_S + 5)
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    check(408, "application/json", data.split(b"\r\n\r\n", 1)[1])


def test_a_kept_alive_connection_gets_the_same_timeout_for_its_next_head(server):
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n")
        data = _read_all(sock, within=READ_TIMEOUT_S + 10)
    assert data.count(b"HTTP/1.1 200") == 1, data[:300]


@pytest.mark.parametrize("sent, status", [
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n", 400),
    (b"\x00\xff\xfe garbage\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\n\r\n", 400),  # no Host
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
    (b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 200),
], ids=["1MB-header", "garbage", "no-host", "bad-chunk", "negative-length", "head-health"])
def test_malformed_http_is_a_4xx(server, sent, status):
    with _connect(server) as sock:
        try:
            sock.sendall(sent)
        except (BrokenPipeError, ConnectionResetError):  # refused before all of it was sent
            pass
        data = _read_all(sock, within=READ_TIMEOUT_S + 10)
    assert data.startswith(f"HTTP/1.1 {status}".encode()), data[:300]
    assert b"Traceback" not in data


# ------------------------------------------------------------ beside expensive requests
def test_preparation_runs_off_the_engine_thread(rapid):
    """A first-seen long document's retrieval held the engine: a small request waited 9 s beside it."""
    engine = GatedEngine(rapid)
    with running_server(engine) as url:
        slow = {}
        thread = threading.Thread(target=lambda: slow.update(r=post(url, body=GOOD | {"documents": ["GATE cats"]})[0]))
        thread.start()
        try:
            assert engine.preparing.wait(30)
            small = post(url, body=GOOD)[0]  # answered while the other one is still being prepared
            assert small.status_code == 200 and thread.is_alive()
            assert HTTP.get(f"{url}/health", timeout=10).json()["waiting"] == 1  # the prepared one holds a place
        finally:
            engine.gate.set()
            thread.join(30)
        assert slow["r"].status_code == 200


def test_preparation_counts_against_the_time_limit(rapid):
    engine = GatedEngine(rapid)
    decode = DecodeConfig(truncate="error", time_limit_s=0.5)
    threading.Timer(1.5, engine.gate.set).start()
    with running_server(engine, decode=decode) as url:
        response, error = post(url, body=GOOD | {"documents": ["GATE cats"]})
    assert response.status_code == 400 and error["code"] == "time_limit_exceeded", response.text


def test_a_client_that_leaves_during_preparation_frees_its_place(rapid):
    engine = GatedEngine(rapid)
    with running_server(engine) as url:
        with pytest.raises(httpx.TimeoutException):
            HTTP.post(f"{url}/v1/chat/completions", json=GOOD | {"documents": ["GATE cats"]}, timeout=1.0)
        assert wait_until(lambda: HTTP.get(f"{url}/health", timeout=5).json()["waiting"] == 0, timeout=10)
        engine.gate.set()
        assert post(url, body=GOOD)[0].status_code == 200


def test_a_cancelled_waiting_job_drops_its_work_at_once():
    """Abandoned requests kept their bodies until a slot freed (+1.8 GB after 80 waves)."""
    import asyncio

    class Payload:
        pass

    async def scenario():
        worker = Worker(max_queue=4, max_num_seqs=1)
        hold = threading.Event()

        def blocking(emit, cancelled):
            hold.wait(10)

        worker.submit(blocking)  # holds the only slot
        payload = Payload()
        alive = weakref.ref(payload)

        def work(emit, cancelled, kept=payload):
            return None

        job = worker.submit(work)
        del payload, work
        job.cancel()
        gc.collect()
        gone = alive() is None
        hold.set()
        await asyncio.to_thread(worker.stop)
        return gone, worker.waiting

    gone, waiting = asyncio.run(scenario())
    assert gone and waiting == 0


def test_log_probabilities_never_wait_on_the_size_checks_tokenizer(rapid):
    """Token texts were decoded on the event loop under the lock /tokenize held: /health took 1.3 s."""
    apps = []
    with running_server(SlowEngine(rapid, delay=0.05), apps=apps) as url:
        lock = apps[0].state.server.tokens._lock
        body = GOOD | {"stream": True, "logprobs": True, "top_logprobs": 3, "max_tokens": 6, "ignore_eos": True}
        with HTTP.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: ") and '"logprobs": {' in line)
            with lock:  # a size check or /tokenize holding it
                rest = [line for line in lines if line.startswith("data: ")]
                assert HTTP.get(f"{url}/health", timeout=5).status_code == 200
    assert rest[-1] == "data: [DONE]" and json.loads(first[6:])["choices"][0]["logprobs"]["content"]


def test_tokenize_is_bounded(rapid):
    with running_server(rapid, max_document_tokens=1000) as url:
        for body, param in [({"prompt": "a" * 5000}, "prompt"),
                            ({"messages": [{"role": "user", "content": ""}] * 2000 + HI}, "messages")]:
            response, error = post(url, "/tokenize", body)
            assert response.status_code == 400 and error["code"] == "context_length_exceeded", response.text
            assert error["param"] == param
        assert post(url, "/tokenize", {"prompt": "a" * 500})[0].json()["count"] >= 500


def test_logprob_bytes_and_offsets_of_tokens_that_split_a_character(byte_tokenizer):
    """The bytes were the token text's (U+FFFD's three bytes) and each split piece moved text_offset on."""
    from rapidspec.server.responses import Reply
    from rapidspec.server.tokens import TokenPieces
    from rapidspec.verification.logprobs import TokenLogprob

    ids = byte_tokenizer.encode("\u20aca", add_special_tokens=False)  # three tokens for the euro sign, then "a"
    entries = [TokenLogprob(t, -0.5, ((t, -0.5),)) for t in ids]
    chat = Reply(True, "tiny", pieces=TokenPieces(byte_tokenizer)).logprobs(entries)["content"]
    assert [entry["bytes"] for entry in chat] == [[0xE2], [0x82], [0xAC], [0x61]]
    assert bytes(sum((entry["bytes"] for entry in chat), [])).decode() == "\u20aca"
    assert chat[0]["top_logprobs"][0]["bytes"] == [0xE2]
    text = Reply(False, "tiny", pieces=TokenPieces(byte_tokenizer)).logprobs(entries)
    assert text["text_offset"] == [0, 0, 0, 1]  # offsets into "\u20aca": the euro sign starts at 0, "a" at 1


def test_developer_is_read_as_system(server):
    body = GOOD | {"messages": [{"role": "developer", "content": "Be brief."}, *HI]}
    assert post(server, body=body)[0].status_code == 200


# ------------------------------------------------------------ the command line
def test_an_empty_api_key_is_refused_before_anything_loads(monkeypatch, capsys):
    """--api-key "" (or an empty RAPIDSPEC_API_KEY, e.g. an unset shell variable) started an open server."""
    from rapidspec import models
    from rapidspec.cli import main

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["serve", "--api-key", ""]) == 2
    assert "the API key is empty" in capsys.readouterr().err
    monkeypatch.setenv("RAPIDSPEC_API_KEY", "")
    assert main(["serve"]) == 2
    assert "the API key is empty" in capsys.readouterr().err


@pytest.mark.slow  # resolves the default model's files (installed by the set-up)
def test_a_bad_drafter_is_refused_before_the_target_loads(monkeypatch, capsys, tmp_path):
    from rapidspec import models
    from rapidspec.cli import main

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    document = tmp_path / "doc.txt"
    document.write_text("cats")
    assert main(["generate", "--document", str(document), "--question", "q", "--drafter", "/no/such/model"]) == 2
    assert "cannot load model '/no/such/model' offline" in capsys.readouterr().err


def test_an_endless_document_is_one_line(capsys):
    from rapidspec.cli import main

    assert main(["generate", "--document", "/dev/zero", "--question", "q"]) == 2
    assert "is larger than 256 MiB" in capsys.readouterr().err


def test_the_size_check_counts_each_message_and_the_query(byte_tokenizer):
    """60,000 empty messages or a 2 MB query passed the size check and held the engine for seconds."""
    from rapidspec.errors import RapidspecError
    from rapidspec.prompting.conversation import Message
    from rapidspec.server.tokens import ServerTokens

    tokens = ServerTokens(byte_tokenizer, max_document_tokens=1000)
    hi = (Message("user", "hi"),)
    tokens.check_fits(hi * 100, (), "middle", 512, query="q" * 500)
    for messages, query in [((Message("user", ""),) * 60_000, None), (hi, "q" * 2_000_000)]:
        with pytest.raises(RapidspecError, match="more than 1000 tokens"):
            tokens.check_fits(messages, (), "middle", 512, query=query)
