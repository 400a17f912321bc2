"""``rapidspec bench serve --peer llama.cpp``: the peer's requests, settings, process and report.

A stand-in ``llama-server`` (a small Python HTTP server that records what it
is sent) checks the whole flow fast; a slow test runs llama.cpp's real
``llama-server`` (built by the set-up) on the built-in GGUF.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap

import pytest

from rapidspec import Rapid
from rapidspec.bench.llama_server import ENV_BINARY, cached_binary_path, cpu_key, find_llama_server, llama_server_binary
from rapidspec.bench.serve.dataset import BenchRequest, builtin_requests
from rapidspec.bench.serve.load import LoadConfig
from rapidspec.bench.serve.peer import PeerConfig, PeerServer, peer_load, slot_context
from rapidspec.cli import main
from rapidspec.errors import RapidspecError
from rapidspec.prompting.conversation import DOCUMENTS_SYSTEM, FULL_SOURCE, Message, with_documents
from rapidspec.retrieval import RetrievalConfig
from rapidspec.retrieval.tokenizers import builtin_gguf_path
from tests.server_harness import running_server
from tests.specs import spec_of

SMALL = ["--document-tokens", "256", "--max-tokens", "4", "--ignore-eos", "--timeout", "60"]

FAKE_SERVER = textwrap.dedent('''\
    #!{python}
    """A stand-in llama-server: /health, streamed chat answers of max_tokens words; records args and bodies."""
    import json, signal, sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    record = open({record!r}, "a")
    record.write(json.dumps({{"args": sys.argv[1:]}}) + "\\n"); record.flush()
    port = int(sys.argv[sys.argv.index("--port") + 1])

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code, body, kind="application/json"):
            self.send_response(code); self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, b'{{"status": "ok"}}')
            elif self.path == "/v1/models":
                self._send(200, b'{{"data": []}}')
            else:
                self._send(404, b'{{"error": {{"message": "not found"}}}}')

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            record.write(json.dumps({{"body": body}}) + "\\n"); record.flush()
            n = body["max_tokens"]
            events = [{{"choices": [{{"delta": {{"content": "word "}}, "finish_reason": None}}]}} for _ in range(n)]
            events.append({{"choices": [{{"delta": {{}}, "finish_reason": "length"}}],
                           "usage": {{"prompt_tokens": 10, "completion_tokens": n,
                                     "prompt_tokens_details": {{"cached_tokens": 3}}}}}})
            text = "".join(f"data: {{json.dumps(e)}}\\n\\n" for e in events) + "data: [DONE]\\n\\n"
            self._send(200, text.encode(), "text/event-stream")

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()
''')


@pytest.fixture
def fake_llama_server(tmp_path, monkeypatch):
    record = tmp_path / "record.jsonl"
    binary = tmp_path / "llama-server"
    binary.write_text(FAKE_SERVER.format(python=sys.executable, record=str(record)))
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(ENV_BINARY, str(binary))
    return binary, record


@pytest.fixture(autouse=True)
def no_api_key_from_the_environment(monkeypatch):
    monkeypatch.delenv("RAPIDSPEC_API_KEY", raising=False)


def test_documents_are_placed_as_the_target_reads_them():
    messages = (Message("system", "Be brief."), Message("user", "Who?"))
    placed = with_documents(messages, ["doc one", "doc two"])
    assert placed[0] == Message("system", "Be brief.\n\n" + DOCUMENTS_SYSTEM.format(
        source=FULL_SOURCE, documents="doc one\n\ndoc two"))
    assert placed[1:] == [Message("user", "Who?")]
    request = BenchRequest(({"role": "user", "content": "Who?"},), ("doc",))
    assert request.inlined_messages() == [{"role": "system", "content": DOCUMENTS_SYSTEM.format(
        source=FULL_SOURCE, documents="doc")}, {"role": "user", "content": "Who?"}]
    assert BenchRequest(({"role": "user", "content": "Hi"},)).inlined_messages() == [{"role": "user", "content": "Hi"}]


def test_the_peer_load_sends_documents_inline_greedy_and_no_rapidspec_fields():
    config = LoadConfig("http://127.0.0.1:1", extra_body={"mode": "rapid", "eta": 2, "seed": 4}, ignore_eos=True)
    request = BenchRequest(({"role": "user", "content": "Who?"},), ("doc",))
    body = peer_load(config).body(request)
    assert "documents" not in body and "mode" not in body and "eta" not in body
    assert body["temperature"] == 0.0 and body["seed"] == 4 and body["ignore_eos"] is True
    assert body["messages"] == request.inlined_messages()
    sampled = peer_load(LoadConfig("http://127.0.0.1:1", extra_body={"temperature": 0.7})).body(request)
    assert sampled["temperature"] == 0.7
    assert config.body(request)["documents"] == ["doc"]  # rapidspec's own load is unchanged
    with pytest.raises(RapidspecError, match="repetition_penalty cannot be compared with llama-server"):
        peer_load(LoadConfig("http://127.0.0.1:1", extra_body={"repetition_penalty": 1.1}))


def test_peer_config_checks_and_arguments(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    config = PeerConfig(binary=tmp_path / "llama-server", gguf=gguf, threads=2, parallel=4, slot_context=1024)
    args = config.args()
    assert args[args.index("--parallel") + 1] == "4" and args[args.index("-c") + 1] == "4096"
    assert args[args.index("-t") + 1] == "2" and "--kv-unified" in args and "--cache-reuse" in args
    with pytest.raises(RapidspecError, match="does not exist"):
        PeerConfig(binary=gguf, gguf=tmp_path / "none.gguf", threads=2, parallel=1, slot_context=1)
    with pytest.raises(RapidspecError, match="may not set the host, port or model"):
        PeerConfig(binary=gguf, gguf=gguf, threads=2, parallel=1, slot_context=1, extra_args=("--port", "1"))


@pytest.mark.slow  # reads the default model's GGUF
def test_slot_context_holds_the_longest_prompt_and_answer():
    from transformers import AutoTokenizer

    gguf = builtin_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    requests = builtin_requests(1024)
    tokens = slot_context(tokenizer, requests, 100)
    assert tokens % 256 == 0 and tokens >= 1024 + 100
    assert slot_context(tokenizer, requests, 400) > tokens


def test_a_missing_llama_server_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(ENV_BINARY, raising=False)
    assert find_llama_server() is None and cpu_key() == cpu_key()
    assert cached_binary_path("1.2.3").parent.name == f"1.2.3-{cpu_key()}"
    with pytest.raises(RapidspecError, match="llama-server is not built: run `python -m rapidspec.bench.llama_server`"):
        llama_server_binary(build=False)
    monkeypatch.setenv(ENV_BINARY, str(tmp_path / "nothing"))
    with pytest.raises(RapidspecError, match="not an executable file"):
        find_llama_server()


def test_a_peer_without_a_gguf_is_one_line(tiny_model, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_BINARY, str(tmp_path / "nothing"))
    code = main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--peer", "llama.cpp",
                 "--peer-gguf", str(tmp_path / "missing.gguf"), *SMALL])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--peer-gguf FILE" in err


@pytest.mark.slow  # reads the default model's GGUF
def test_the_peer_gets_the_same_load_and_both_are_reported(tiny_model, other_tiny_model, fake_llama_server, capsys):
    binary, record = fake_llama_server
    engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=200)),
                   target=tiny_model, drafter=other_tiny_model)
    with running_server(engine) as url:
        code = main(["bench", "serve", "--base-url", url, "--num-prompts", "3", "--max-concurrency", "2",
                     "--peer", "llama.cpp", "--peer-gguf", str(builtin_gguf_path()), "--peer-threads", "1",
                     "--peer-parallel", "2",
                     "--extra-body", '{"mode": "rapid"}', *SMALL])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert list(result["servers"]) == ["rapidspec", "llama.cpp"]
    ours, peer = result["servers"]["rapidspec"], result["servers"]["llama.cpp"]
    for s in (ours, peer):
        assert (s["completed"], s["lost"], s["errors"], s["total_output_tokens"]) == (3, 0, 0, 12)
    assert peer["inline_documents"] and not ours["inline_documents"] and peer["server"]["exit_code"] == 0
    assert peer["cached_input_tokens"] == 9 and "TTFT median (ms)" in captured.out
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    args = lines[0]["args"]
    assert args[args.index("--parallel") + 1] == "2" and args[args.index("-t") + 1] == "1"
    assert args[args.index("-m") + 1] == str(builtin_gguf_path())
    bodies = [line["body"] for line in lines[1:]]
    assert len(bodies) == 4  # the test request and 3 timed ones
    for body in bodies:
        assert "documents" not in body and "mode" not in body and body["temperature"] == 0.0
        assert body["messages"][0]["role"] == "system" and "<documents>" in body["messages"][0]["content"]


def test_the_peer_server_is_stopped(fake_llama_server, tmp_path):
    binary, _ = fake_llama_server
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    server = PeerServer(PeerConfig(binary=binary, gguf=gguf, threads=1, parallel=1, slot_context=256,
                                   start_timeout_s=30))
    with server:
        assert server.url.startswith("http://127.0.0.1:")
    assert server.exit_code == 0


@pytest.mark.slow
def test_real_llama_server_against_rapidspec(capsys, tmp_path):
    """llama.cpp's own server (built by the set-up) answers the built-in load; both servers stop cleanly."""
    if os.environ.get(ENV_BINARY) is None and find_llama_server() is None:
        pytest.skip("llama-server is not built here (the set-up builds it on CPU machines)")
    code = main(["bench", "serve", "--target", "builtin:smollm2-135m", "--num-prompts", "2", "--max-concurrency", "2",
                 "--peer", "llama.cpp",
                 "--server-timeout", "300", "--document-tokens", "512", "--max-tokens", "8", "--ignore-eos",
                 "--timeout", "300", "--result-file", str(tmp_path / "both.json")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert json.loads((tmp_path / "both.json").read_text()) == result
    for s in result["servers"].values():
        assert (s["completed"], s["lost"], s["total_output_tokens"]) == (2, 0, 16)
        assert s["server"]["started_here"] and s["server"]["exit_code"] == 0
    ours, peer = result["servers"]["rapidspec"], result["servers"]["llama.cpp"]
    # the same prompt on both servers: the same template and tokenizer, so (nearly) the same input tokens
    assert abs(ours["total_input_tokens"] - peer["total_input_tokens"]) <= 0.02 * ours["total_input_tokens"]
