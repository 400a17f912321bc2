"""``rapidspec bench serve --peer vllm``: vLLM's OpenAI server three ways (none, ngram, RAPID's proposer).

A stand-in vLLM (a small Python HTTP server run as the venv's ``python``, which
records its arguments, environment and bodies, counts vLLM's speculative
counters in /metrics and leaves a child behind as vLLM's engine core would)
checks the whole flow fast; a slow test runs the real vLLM of ``.venv-vllm``
on the built-in model.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from rapidspec import Rapid
from rapidspec.bench.serve.client import read_counters
from rapidspec.bench.serve.dataset import BenchRequest
from rapidspec.bench.serve.load import LoadConfig, counter_deltas
from rapidspec.bench.serve.vllm_peer import (VLLM_COUNTERS, VllmPeerConfig, VllmServer, max_model_len,
                                             parse_methods, speculative_config, vllm_load)
from rapidspec.cli import main
from rapidspec.errors import RapidspecError
from rapidspec.retrieval import RetrievalConfig
from rapidspec.vllm.environment import vllm_env, vllm_python
from tests.server_harness import running_server
from tests.specs import spec_of

SMALL = ["--document-tokens", "256", "--max-tokens", "4", "--ignore-eos", "--timeout", "60"]

FAKE_VLLM = textwrap.dedent('''\
    #!{python}
    """A stand-in vLLM OpenAI server: /health (no body), /v1/models, /metrics with vLLM's counters, streamed
    answers of max_tokens words; records args, environment and bodies; leaves a child behind on SIGTERM."""
    import json, os, signal, subprocess, sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    record = open({record!r}, "a")
    spec = "--speculative-config" in sys.argv
    if os.environ.get("FAKE_VLLM_FAIL") and os.environ["FAKE_VLLM_FAIL"] in " ".join(sys.argv):
        print("Traceback (most recent call last):\\nValueError: the proposer could not be loaded", flush=True)
        sys.exit(1)
    child = subprocess.Popen(["sleep", "300"])  # as vLLM's engine core, a child of the server
    env = {{k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_USE_V2_MODEL_RUNNER",
                                           "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")}}
    record.write(json.dumps({{"args": sys.argv[1:], "env": env, "child": child.pid,
                            "pid": os.getpid()}}) + "\\n"); record.flush()
    port = int(sys.argv[sys.argv.index("--port") + 1])
    counts = {{"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "generation": 0}}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code, body, kind="application/json"):
            self.send_response(code); self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/v1/models":
                self._send(200, b'{{"data": []}}')
            elif self.path == "/metrics":
                text = "".join(f'vllm:spec_decode_num_{{k}}_total{{{{engine="0"}}}} {{float(counts[k])}}\\n'
                               f'vllm:spec_decode_num_{{k}}_created{{{{engine="0"}}}} 1.7e9\\n'
                               for k in ("drafts", "draft_tokens", "accepted_tokens") if spec)
                text += f'vllm:generation_tokens_total{{{{engine="0"}}}} {{float(counts["generation"])}}\\n'
                self._send(200, text.encode(), "text/plain")
            else:
                self._send(404, b'{{"error": {{"message": "not found"}}}}')

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            record.write(json.dumps({{"body": body}}) + "\\n"); record.flush()
            n = body["max_tokens"]
            events = [{{"choices": [{{"delta": {{"content": "word "}}, "finish_reason": None}}]}} for _ in range(n)]
            events.append({{"choices": [{{"delta": {{}}, "finish_reason": "length"}}],
                           "usage": {{"prompt_tokens": 10, "completion_tokens": n,
                                     "prompt_tokens_details": {{"cached_tokens": 8}}}}}})
            counts["generation"] += n
            if spec:  # 2 rounds of 4 drafted tokens, 3 of them accepted in each
                counts["drafts"] += 2; counts["draft_tokens"] += 8; counts["accepted_tokens"] += 6
            text = "".join(f"data: {{json.dumps(e)}}\\n\\n" for e in events) + "data: [DONE]\\n\\n"
            self._send(200, text.encode(), "text/event-stream")

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()
''')


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch, tiny_model_dir):
    """The stand-in as RAPIDSPEC_VLLM_PYTHON, and an export that copies the tiny model's folder."""
    record = tmp_path / "record.jsonl"
    python = tmp_path / "python"
    python.write_text(FAKE_VLLM.format(python=sys.executable, record=str(record)))
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("RAPIDSPEC_VLLM_PYTHON", str(python))
    monkeypatch.setattr("rapidspec.bench.serve.process.GROUP_GRACE_S", 0.5)  # the stand-in's child never exits alone
    monkeypatch.setattr("rapidspec.bench.serve.load.COUNT_DELAY_S", 0.0)  # the stand-in counts before it answers
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "FAKE_VLLM_FAIL"):
        monkeypatch.delenv(name, raising=False)
    exported = []

    def export_model(name, folder):
        exported.append((name, folder))
        shutil.copytree(tiny_model_dir, folder)
        return folder

    monkeypatch.setattr("rapidspec.models.export.export_model", export_model)
    return python, record, exported


@pytest.fixture(autouse=True)
def no_api_key_from_the_environment(monkeypatch):
    monkeypatch.delenv("RAPIDSPEC_API_KEY", raising=False)


def _config(tmp_path, **kwargs) -> VllmPeerConfig:
    return VllmPeerConfig(**{"python": tmp_path / "python", "model": tmp_path / "m", "served_name": "builtin",
                             "max_model_len": 1024, "max_num_seqs": 2, "threads": 2} | kwargs)


def test_arguments_of_the_three_servers(tmp_path):
    plain = _config(tmp_path).args()
    assert plain[plain.index("--max-model-len") + 1] == "1024" and plain[plain.index("--max-num-seqs") + 1] == "2"
    assert plain[plain.index("--served-model-name") + 1] == "builtin" and "--enforce-eager" in plain
    assert plain[plain.index("--model") + 1] == str(tmp_path / "m") and "--speculative-config" not in plain
    for method, expected in (("ngram", {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                                        "prompt_lookup_min": 2}),
                             ("rapid", {"method": "custom_class", "model": "rapidspec.vllm.RapidProposer",
                                        "num_speculative_tokens": 5})):
        args = _config(tmp_path, method=method, speculative_tokens=5).args()
        assert json.loads(args[args.index("--speculative-config") + 1]) == expected
    command = _config(tmp_path, extra_args=("--dtype", "float32")).command(1234)
    assert command[:3] == [str(tmp_path / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--port") + 1] == "1234" and command[-2:] == ["--dtype", "float32"]
    assert _config(tmp_path, method="rapid").name == "vllm-rapid"
    for bad in (("--port", "1"), ("--speculative-config={}",), ("--served-model-name", "x")):
        with pytest.raises(RapidspecError, match="may not set the host, port, model"):
            _config(tmp_path, extra_args=bad)
    with pytest.raises(RapidspecError, match="unknown vLLM speculation"):
        speculative_config("eagle", 4)
    assert parse_methods("rapid, none") == ("rapid", "none")
    for bad in ("", "none,none", "medusa"):
        with pytest.raises(RapidspecError, match="--peer-speculation"):
            parse_methods(bad)


def test_environment_keeps_the_users_and_binds_rapidspecs_threads(tmp_path):
    env = _config(tmp_path, threads=1).environment({"PATH": "/bin"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(min(os.sched_getaffinity(0)))
    mine = _config(tmp_path).environment({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert mine["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and mine["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert {k: v for k, v in env.items() if not k.startswith("VLLM_CPU_")} == {
        k: v for k, v in vllm_env({"PATH": "/bin"}).items() if not k.startswith("VLLM_CPU_")}  # vllm_env: LD_PRELOAD


def test_the_vllm_load_inlines_documents_names_the_model_and_keeps_shared_fields():
    config = LoadConfig("http://127.0.0.1:1", api_key="k", ignore_eos=True,
                        extra_body={"mode": "rapid", "eta": 2, "seed": 4, "frequency_penalty": 0.5})
    request = BenchRequest(({"role": "user", "content": "Who?"},), ("doc",))
    load = vllm_load(config, "builtin")
    body = load.body(request)
    assert body["messages"] == request.inlined_messages() and body["model"] == "builtin"
    assert "documents" not in body and "mode" not in body and "eta" not in body and load.api_key is None
    assert (body["temperature"], body["seed"], body["frequency_penalty"], body["ignore_eos"]) == (0.0, 4, 0.5, True)
    assert vllm_load(LoadConfig("http://127.0.0.1:1", extra_body={"temperature": 0.7}), "m").body(request)[
        "temperature"] == 0.7


def test_vllm_counters_are_read_and_give_acceptance():
    text = ('vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0\n'
            'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9\n'
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 9.0\n'
            'vllm:prefix_cache_queries_total{engine="0"} 100.0\nvllm:prefix_cache_hits_total{engine="0"} 75.0\n'
            '# HELP vllm:generation_tokens_total Number of generation tokens.\n'
            'vllm:generation_tokens_total{engine="0"} 60.0\n')

    async def read(body: str):
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await read_counters(client, VLLM_COUNTERS)

    after = asyncio.run(read(text))
    assert after == {"generation_tokens": 60, "prefix_cache_hit_tokens": 75, "prefix_cache_query_tokens": 100,
                     "drafts": 10, "draft_tokens": 40, "accepted_tokens": 25}
    before = dict.fromkeys(after, 0.0) | {"drafts": 2.0, "draft_tokens": 8.0, "accepted_tokens": 1.0}
    delta = counter_deltas(before, after)
    assert delta["acceptance_rate"] == 24 / 32 and delta["mean_acceptance_length"] == 1 + 24 / 8
    assert delta["prefix_cache_hit_rate"] == 0.75
    none = counter_deltas(dict.fromkeys(after, 0.0), dict.fromkeys(after, 0.0))
    assert none["acceptance_rate"] is None and none["mean_acceptance_length"] is None


def test_max_model_len_holds_the_longest_prompt_answer_and_drafts(tiny_model):
    requests = [BenchRequest(({"role": "user", "content": "Who?"},), ("x " * 300,))]
    short = max_model_len(tiny_model.tokenizer, requests, 32, 16)
    assert short % 256 == 0 and short >= 600 + 32 + 16
    assert max_model_len(tiny_model.tokenizer, requests, 500, 16) > short


def test_a_missing_vllm_venv_is_one_line(tiny_model, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RAPIDSPEC_VLLM_PYTHON", str(tmp_path / "nothing"))
    code = main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--peer", "vllm", *SMALL])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "make vllm" in err


def test_vllm_options_are_checked_before_anything_runs(capsys, fake_vllm):
    for argv, message in ((["--peer", "llama.cpp", "--peer-speculation", "rapid"], "among none, ngram, draft"),
                          (["--peer-model", "builtin"], "apply to --peer vllm"),
                          (["--peer-speculative-tokens", "4"], "apply to --peer vllm"),
                          (["--peer", "vllm", "--peer-parallel", "2"], "apply to --peer llama.cpp"),
                          (["--peer", "vllm", "--peer-speculation", "eagle"], "--peer-speculation")):
        code = main(["bench", "serve", "--base-url", "http://127.0.0.1:1", *argv, *SMALL])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def _run(tiny_model, other_tiny_model, extra: list[str]):
    engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=200)),
                   target=tiny_model, drafter=other_tiny_model)
    with running_server(engine) as url:
        return main(["bench", "serve", "--base-url", url, "--num-prompts", "3", "--max-concurrency", "2",
                     "--peer", "vllm", "--peer-threads", "1", "--peer-speculative-tokens", "4",
                     "--extra-body", '{"mode": "rapid"}', *SMALL, *extra])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its parent is gone too
        return f.read().split(") ")[-1][:1] != "Z"


def test_the_three_vllm_servers_get_the_same_load_and_all_are_reported(tiny_model, other_tiny_model, fake_vllm,
                                                                       capsys):
    python, record, exported = fake_vllm
    code = _run(tiny_model, other_tiny_model, [])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert list(result["servers"]) == ["rapidspec", "vllm", "vllm-ngram", "vllm-rapid"]
    for s in result["servers"].values():
        assert (s["completed"], s["lost"], s["errors"], s["total_output_tokens"]) == (3, 0, 0, 12)
    for name in ("vllm-ngram", "vllm-rapid"):
        metrics = result["servers"][name]["server_metrics"]
        assert (metrics["drafts"], metrics["draft_tokens"], metrics["accepted_tokens"]) == (6, 24, 18)
        assert metrics["acceptance_rate"] == 0.75 and metrics["mean_acceptance_length"] == 4.0
        assert result["servers"][name]["server"]["exit_code"] == 0
    assert result["servers"]["vllm"]["server_metrics"]["acceptance_rate"] is None
    for label in ("vllm-ngram", "vllm-rapid", "draft acceptance rate", "75.0%", "mean accepted length", "4.00"):
        assert label in captured.out
    assert [name for name, _ in exported] == ["builtin"]
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    starts = [line for line in lines if "args" in line]
    assert len(starts) == 3 and not any(_alive(line["child"]) for line in starts)  # the engine cores are gone
    specs = []
    for start in starts:
        args = start["args"]
        assert args[args.index("--max-num-seqs") + 1] == "2" and args[args.index("--served-model-name") + 1] == "builtin"
        assert int(args[args.index("--max-model-len") + 1]) % 256 == 0 and "--enforce-eager" in args
        assert start["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and start["env"]["VLLM_CPU_KVCACHE_SPACE"] == "4"
        spec = args[args.index("--speculative-config") + 1] if "--speculative-config" in args else None
        specs.append(spec and json.loads(spec)["method"])
    assert specs == [None, "ngram", "custom_class"]
    bodies = [line["body"] for line in lines if "body" in line]
    assert len(bodies) == 12  # a test request and 3 timed ones on each server
    for body in bodies:
        assert "documents" not in body and "mode" not in body and body["temperature"] == 0.0
        assert body["model"] == "builtin" and "<documents>" in body["messages"][0]["content"]


def test_a_vllm_that_does_not_start_is_one_line_and_the_others_still_run(tiny_model, other_tiny_model, fake_vllm,
                                                                         capsys, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "custom_class")
    code = _run(tiny_model, other_tiny_model, ["--peer-speculation", "rapid,none"])
    captured = capsys.readouterr()
    assert code == 1
    failed = [line for line in captured.err.splitlines() if line.startswith("vllm-rapid")]
    assert len(failed) == 1 and "exited with code 1" in failed[0] and "log: " in failed[0]
    assert "Traceback" not in captured.err and "the proposer could not be loaded" in failed[0]
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert list(result["servers"]) == ["rapidspec", "vllm-rapid", "vllm"]
    assert result["servers"]["vllm-rapid"]["failed"] and result["servers"]["vllm"]["completed"] == 3
    log = result["servers"]["vllm-rapid"]["server"]["log"]
    assert log in failed[0] and "ValueError" in open(log).read()
    assert "no (see stderr)" in captured.out


def test_a_failed_test_request_on_vllm_is_one_line_naming_the_log(tiny_model, other_tiny_model, fake_vllm,
                                                                  capsys, monkeypatch):
    from rapidspec.bench.serve import load

    real = load.send_request

    async def refused_by_vllm(client, index, body, session=None):
        result = await real(client, index, body, session)
        if index == -1 and "model" in body:  # the test request of a vLLM server
            result.outcome, result.detail = "error", "HTTP 400: the prompt is longer than max_model_len"
        return result

    monkeypatch.setattr(load, "send_request", refused_by_vllm)
    code = _run(tiny_model, other_tiny_model, ["--peer-speculation", "none"])
    captured = capsys.readouterr()
    failed = [line for line in captured.err.splitlines() if line.startswith("vllm:")]
    assert code == 1 and len(failed) == 1 and "max_model_len" in failed[0] and "(log: /" in failed[0], captured.err
    assert "Traceback" not in captured.err


def test_the_vllm_server_stops_its_group(fake_vllm, tmp_path):
    python, record, _ = fake_vllm
    server = VllmServer(_config(tmp_path, python=python, start_timeout_s=30))
    with server:
        assert server.url.startswith("http://127.0.0.1:")
    child = json.loads(record.read_text().splitlines()[0])["child"]
    assert server.exit_code == 0 and not _alive(child)


def test_the_failure_line_is_the_cause_in_vllms_log(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(
        "(APIServer pid=1) WARNING [system_utils.py:255] fd limit errors like `OSError: [Errno 24] Too many`\n"
        "(Worker pid=3) ERROR 11-26 23:19:27 [multiproc_executor.py:953] ModuleNotFoundError: No module named 'x'\n"
        "(EngineCore pid=2) ERROR 11-26 [core.py:1510] Exception: WorkerProc initialization failed due to ...\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    server = VllmServer(_config(tmp_path))
    server.log_path = str(log)
    assert server.last_log_line() == "ModuleNotFoundError: No module named 'x'"
    log.write_text("INFO starting\nnothing failed here\n")
    assert server.last_log_line() == "nothing failed here"


def test_sigterm_stops_the_vllm_server_started_here(fake_vllm, tiny_model, other_tiny_model, tiny_model_dir):
    """``timeout`` or ``kill`` on bench serve stops the vLLM server it started (a group of its own, out of reach
    of a signal to bench serve's group) as Ctrl-C does."""
    python, record, _ = fake_vllm
    engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=200)),
                   target=tiny_model, drafter=other_tiny_model)
    with running_server(engine) as url:
        bench = subprocess.Popen(
            [sys.executable, "-m", "rapidspec", "bench", "serve", "--base-url", url, "--num-prompts", "1",
             "--peer", "vllm", "--peer-model", str(tiny_model_dir), "--peer-speculation", "none", "--peer-threads",
             "1", "--document-tokens", "256", "--max-tokens", "4", "--timeout", "60"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while "args" not in (record.read_text() if record.exists() else "") and time.monotonic() < deadline:
                assert bench.poll() is None, bench.communicate()
                time.sleep(0.1)
            started = json.loads(record.read_text().splitlines()[0])
            bench.send_signal(signal.SIGTERM)
            _, err = bench.communicate(timeout=60)
        finally:
            bench.kill()
    assert bench.returncode == 130 and "interrupted" in err, err
    assert not _alive(started["pid"]) and not _alive(started["child"])


@pytest.mark.slow
@pytest.mark.vllm
def test_real_vllm_against_rapidspec(capsys, tmp_path, monkeypatch):
    """vLLM's own server (from .venv-vllm) answers the built-in load three ways; every server stops cleanly.
    RAPID's proposer prepares its drafters inline, so the 8-token answers get drafts however busy the machine."""
    if vllm_python() is None:
        pytest.skip("vLLM is not set up here (no .venv-vllm: `make vllm` makes it)")
    monkeypatch.setenv("RAPIDSPEC_VLLM_OPTIONS", '{"prepare": "inline"}')
    code = main(["bench", "serve", "--num-prompts", "2", "--max-concurrency", "2", "--peer", "vllm",
                 "--server-timeout", "300", "--document-tokens", "512", "--max-tokens", "8", "--ignore-eos",
                 "--timeout", "300", "--result-file", str(tmp_path / "all.json")])
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert json.loads((tmp_path / "all.json").read_text()) == result
    assert list(result["servers"]) == ["rapidspec", "vllm", "vllm-ngram", "vllm-rapid"]
    assert code == 0, captured.err
    for s in result["servers"].values():
        assert (s["completed"], s["lost"], s["total_output_tokens"]) == (2, 0, 16)
        assert s["server"]["started_here"] and s["server"]["exit_code"] == 0
    for name in ("vllm-ngram", "vllm-rapid"):
        assert result["servers"][name]["server_metrics"]["drafts"] > 0
    ours, plain = result["servers"]["rapidspec"], result["servers"]["vllm"]
    # the same prompt on both servers: the same template and tokenizer, so (nearly) the same input tokens
    assert abs(ours["total_input_tokens"] - plain["total_input_tokens"]) <= 0.02 * ours["total_input_tokens"]
