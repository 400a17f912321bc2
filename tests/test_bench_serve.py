"""``rapidspec bench serve``: statistics, request parsing, datasets, and bounded live runs on the tiny model."""

from __future__ import annotations

import asyncio
import json
import math
import statistics

import httpx
import pytest

from rapidspec import Rapid
from rapidspec.cli import join_two_word_command, main
from rapidspec.errors import RapidspecError
from rapidspec.bench.serve.load import LoadConfig, arrival_times, counter_deltas, normalize_base_url
from rapidspec.bench.serve.client import send_request
from rapidspec.bench.serve.dataset import BUILTIN_QUESTIONS, BenchRequest, builtin_requests, file_requests
from rapidspec.bench.serve.stats import RequestResult, distribution, percentile, summarize
from rapidspec.retrieval import RetrievalConfig
from tests.server_harness import SlowEngine, free_port, running_server
from tests.specs import spec_of

RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=200)
# A short built-in document (~1.2K bytes: the byte-level tiny model's window is 4K tokens).
SMALL = ["--document-tokens", "256", "--max-tokens", "4", "--ignore-eos", "--timeout", "60"]


@pytest.fixture(autouse=True)
def no_api_key_from_the_environment(monkeypatch):
    monkeypatch.delenv("RAPIDSPEC_API_KEY", raising=False)


# ------------------------------------------------------------ statistics
def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    for q in (10, 25, 75, 90, 95, 99):  # numpy's "linear" is statistics' "inclusive"
        expected = statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        assert percentile(values, q) == pytest.approx(expected)
    assert percentile([7.0], 95) == 7.0 and percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_distribution_is_in_milliseconds():
    out = distribution("ttft", [0.1, 0.2, 0.3])
    assert out["mean_ttft_ms"] == pytest.approx(200) and out["median_ttft_ms"] == pytest.approx(200)
    assert set(out) == {"mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p95_ttft_ms", "p99_ttft_ms"}
    assert all(v is None for v in distribution("itl", []).values())


def test_tpot_and_itl_from_known_timestamps():
    r = RequestResult(0, "completed", ttft=0.1, latency=0.7, chunk_times=[0.1, 0.3, 0.35, 0.6], output_tokens=7)
    assert r.tpot == pytest.approx(0.1)  # (0.7 - 0.1) / (7 - 1)
    assert r.itls == pytest.approx([0.2, 0.05, 0.25])
    assert RequestResult(1, "completed", ttft=0.1, latency=0.2, output_tokens=1).tpot is None
    assert RequestResult(2, "completed", latency=0.2, output_tokens=5).tpot is None  # not streamed


def test_summary_counts_outcomes_and_throughput():
    results = [
        RequestResult(0, "completed", ttft=0.1, latency=0.5, chunk_times=[0.1, 0.3], output_tokens=4, prompt_tokens=10,
                      cached_tokens=6),
        RequestResult(1, "completed", ttft=0.2, latency=1.0, chunk_times=[0.2, 0.6], output_tokens=4, prompt_tokens=10),
        RequestResult(2, "rejected", status=429, detail="HTTP 429: busy"),
        RequestResult(3, "error", status=400, detail="HTTP 400: bad"),
        RequestResult(4, "error", lost=True, detail="ConnectError"),
    ]
    s = summarize(results, duration=2.0)
    assert (s["completed"], s["rejected"], s["errors"], s["lost"]) == (2, 1, 2, 1)
    assert s["total_output_tokens"] == 8 and s["total_input_tokens"] == 20 and s["cached_input_tokens"] == 6
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 4.0 and s["total_token_throughput"] == 14.0
    assert s["mean_output_tokens_per_chunk"] == 2.0
    assert s["mean_ttft_ms"] == pytest.approx(150) and s["mean_e2el_ms"] == pytest.approx(750)
    assert s["mean_tpot_ms"] == pytest.approx((400 / 3 + 800 / 3) / 2)
    assert s["mean_itl_ms"] == pytest.approx(300)  # gaps 0.2 and 0.4
    assert s["first_error"] == "request 3: HTTP 400: bad"


def test_counter_deltas():
    before = dict.fromkeys(("generation_tokens", "prefix_cache_hit_requests", "prefix_cache_hit_tokens",
                            "prefix_cache_query_tokens", "draft_tokens", "accepted_tokens"), 1.0)
    after = before | {"draft_tokens": 11.0, "accepted_tokens": 6.0, "prefix_cache_query_tokens": 5.0}
    delta = counter_deltas(before, after)
    assert delta["acceptance_rate"] == 0.5 and delta["prefix_cache_hit_rate"] == 0.0
    assert counter_deltas(None, after) is None


def test_prompt_lookup_drafts_are_counted_by_the_server_and_reported():
    """Rounds drafted by prompt lookup before the drafter joined count in /metrics apart from the drafter's, and
    bench serve reads them (a run whose drafter never joined once reported no drafting at all)."""
    from rich.console import Console

    from rapidspec.bench.serve.client import read_counters
    from rapidspec.bench.serve.report import outcome_table
    from rapidspec.server.metrics import ServerMetrics
    from rapidspec.stats import GenerationStats

    metrics = ServerMetrics("m", waiting=lambda: 0, running=lambda: 0)

    async def counters():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=metrics.render()))
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            return await read_counters(client)

    before = asyncio.run(counters())
    metrics.finished(GenerationStats(mode="rapid", new_tokens=20, lookup_drafted_tokens=12,
                                     lookup_accepted_tokens=5), "stop")
    delta = counter_deltas(before, asyncio.run(counters()))
    assert (delta["lookup_draft_tokens"], delta["lookup_accepted_tokens"]) == (12, 5)
    assert delta["draft_tokens"] == 0 and delta["acceptance_rate"] is None  # the drafter's own: none
    summary = LoadConfig(base_url="http://h:1").describe() | summarize([], 1.0) | {"dataset": "builtin",
                                                                                  "server_metrics": delta}
    console = Console(width=200, record=True)
    console.print(outcome_table(summary))
    text = console.export_text()
    assert "server: prompt-lookup drafts accepted" in text and "5 of 12" in text


# ------------------------------------------------------------ load shape and options
def test_arrival_times():
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    times = arrival_times(2000, 10.0, seed=1)
    assert times == arrival_times(2000, 10.0, seed=1) and times != arrival_times(2000, 10.0, seed=2)
    assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:]))
    assert times[-1] / 1999 == pytest.approx(0.1, rel=0.1)  # mean gap 1 / rate


def test_load_config_validation_and_body():
    assert normalize_base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    for bad in ("localhost:8000", "ftp://x", "http://", "not a url"):
        with pytest.raises(RapidspecError, match="--base-url"):
            LoadConfig(base_url=bad)
    for kwargs, flag in (({"num_prompts": 0}, "--num-prompts"), ({"max_concurrency": 0}, "--max-concurrency"),
                         ({"request_rate": 0}, "--request-rate"), ({"request_rate": math.nan}, "--request-rate"),
                         ({"max_tokens": 0}, "--max-tokens"), ({"timeout_s": 0}, "--timeout"),
                         ({"extra_body": {"stream": False}}, "--extra-body")):
        with pytest.raises(RapidspecError, match=flag):
            LoadConfig(base_url="http://127.0.0.1:1", **kwargs)
    config = LoadConfig(base_url="http://h:1", max_tokens=5, ignore_eos=True, api_key="s3cret", extra_body={"mode": "lc"})
    body = config.body(BenchRequest(({"role": "user", "content": "q"},), ("doc",)))
    assert body == {"messages": [{"role": "user", "content": "q"}], "max_tokens": 5, "stream": True,
                    "stream_options": {"include_usage": True}, "documents": ["doc"], "ignore_eos": True, "mode": "lc"}
    assert config.headers == {"Authorization": "Bearer s3cret"} and "s3cret" not in repr(config)
    assert "api_key" not in config.describe() and config.describe()["request_rate"] == "inf"
    mixed = LoadConfig(base_url="http://h:1", max_tokens=(8, 128))
    request = BenchRequest(({"role": "user", "content": "q"},))
    assert [mixed.body(request, i)["max_tokens"] for i in range(4)] == [8, 128, 8, 128]
    assert mixed.describe()["max_tokens"] == [8, 128]
    with pytest.raises(RapidspecError, match="--max-tokens"):
        LoadConfig(base_url="http://h:1", max_tokens=(8, 0))


def test_bench_serve_is_two_words_and_bench_is_unchanged():
    assert join_two_word_command(["-v", "bench", "serve", "--num-prompts", "2"]) == ["-v", "bench-serve", "--num-prompts", "2"]
    assert join_two_word_command(["bench", "--lengths", "1024"]) == ["bench", "--lengths", "1024"]
    assert join_two_word_command(["serve", "--port", "1"]) == ["serve", "--port", "1"]


# ------------------------------------------------------------ answers, parsed without a server
def _answer(handler) -> RequestResult:
    async def go():
        async with httpx.AsyncClient(base_url="http://test", transport=httpx.MockTransport(handler)) as client:
            return await send_request(client, 0, {"messages": [], "stream": True})
    return asyncio.run(go())


def _sse(*events) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def test_vllms_speculative_metrics_are_read_from_the_last_chunks():
    """Any server sending vLLM's metrics.speculative_decoding (rapidspec serve does) is summarised alike."""
    metrics = {"speculative_decoding": {"num_drafts": 3, "num_draft_tokens": 12, "num_accepted_draft_tokens": 9}}
    chunk = {"choices": [{"delta": {"content": "hi"}, "finish_reason": None}]}
    last = {"choices": [{"delta": {}, "finish_reason": "length"}], "metrics": metrics}
    result = _answer(lambda request: httpx.Response(200, content=_sse(chunk, last, "[DONE]")))
    assert result.outcome == "completed" and result.speculative == metrics["speculative_decoding"]
    plain = _answer(lambda request: httpx.Response(200, content=_sse(chunk, last | {"metrics": None}, "[DONE]")))
    assert plain.speculative is None  # a server without it: nothing
    s = summarize([result, result, plain], 1.0)
    assert (s["spec_requests"], s["spec_num_drafts"], s["spec_num_draft_tokens"]) == (2, 6, 24)
    assert s["spec_draft_acceptance_rate"] == 0.75 and s["spec_mean_acceptance_length"] == 4.0
    assert "spec_requests" not in summarize([plain], 1.0)


def test_answers_are_classified():
    delta = lambda text, finish=None: {"choices": [{"delta": {"content": text}, "finish_reason": finish}]}  # noqa: E731
    usage = {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 9}}
    good = _answer(lambda r: httpx.Response(200, content=_sse(delta("a"), delta("bc"), delta("", "length"), usage, "[DONE]")))
    assert good.outcome == "completed" and not good.lost and len(good.chunk_times) == 2 and good.output_tokens == 3
    cut = _answer(lambda r: httpx.Response(200, content=_sse(delta("a"))))
    assert cut.outcome == "error" and cut.lost and "without a finish reason" in cut.detail
    event = _answer(lambda r: httpx.Response(200, content=_sse(delta("a"), {"error": {"message": "boom"}})))
    assert event.outcome == "error" and not event.lost
    for status, outcome, lost in ((429, "rejected", False), (400, "error", False), (503, "error", True)):
        r = _answer(lambda r, s=status: httpx.Response(s, json={"error": {"message": "no"}}))
        assert (r.outcome, r.lost, r.detail) == (outcome, lost, f"HTTP {status}: no")

    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    assert _answer(refuse).lost


# ------------------------------------------------------------ datasets
def test_builtin_requests_share_one_document():
    requests = builtin_requests(256)
    assert len(requests) == len(BUILTIN_QUESTIONS) and len({r.documents for r in requests}) == 1
    assert [r.messages[-1]["content"] for r in requests] == list(BUILTIN_QUESTIONS)


def test_dataset_files(tmp_path):
    records = tmp_path / "records.jsonl"
    records.write_text("\n".join(json.dumps({"document": f"doc {i}", "question": f"q {i}"}) for i in range(3)))
    requests = file_requests(records)
    assert [(r.documents, r.messages[-1]["content"]) for r in requests] == [((f"doc {i}",), f"q {i}") for i in range(3)]
    locomo = tmp_path / "locomo.json"
    conversation = {"speaker_a": "Ann", "speaker_b": "Bob", "session_1_date_time": "1 May",
                    "session_1": [{"speaker": "Ann", "text": "hi"}, {"speaker": "Bob", "text": "hello"}]}
    locomo.write_text(json.dumps([{"conversation": conversation, "qa": [{"question": "Who?"}, {"question": "When?"}]}]))
    requests = file_requests(locomo)
    assert len(requests) == 2 and not requests[0].documents
    assert [m["role"] for m in requests[0].messages] == ["user", "assistant", "user"]
    bad = tmp_path / "bad.json"
    bad.write_text("[{\"document\": \"d\"}]")
    with pytest.raises(RapidspecError, match="record 1"):
        file_requests(bad)
    with pytest.raises(RapidspecError, match="not found"):
        file_requests(tmp_path / "missing.json")


# ------------------------------------------------------------ live runs on the tiny model
@pytest.fixture(scope="module")
def engine(tiny_model, other_tiny_model):
    return Rapid(spec_of(retrieval=RETRIEVAL), target=tiny_model, drafter=other_tiny_model)


def _run(capsys, *argv) -> tuple[int, dict, str]:
    code = main(["bench", "serve", *argv])
    captured = capsys.readouterr()
    return code, json.loads(captured.out.strip().splitlines()[-1]), captured.err


def test_live_run_with_concurrency(engine, capsys, tmp_path):
    result_file = tmp_path / "result.json"
    with running_server(engine) as url:
        code, s, _ = _run(capsys, "--base-url", url, "--num-prompts", "6", "--max-concurrency", "2", *SMALL,
                          "--result-file", str(result_file))
    assert code == 0
    assert (s["completed"], s["rejected"], s["errors"], s["lost"]) == (6, 0, 0, 0)
    assert s["total_output_tokens"] == 24 and s["max_concurrency"] == 2 and s["dataset"] == "builtin"
    assert s["mean_ttft_ms"] > 0 and s["median_tpot_ms"] > 0 and s["p99_itl_ms"] > 0 and s["p90_e2el_ms"] > 0
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    assert s["server_metrics"]["generation_tokens"] == 24  # the test request is not counted
    assert s["server_metrics"]["prefix_cache_hit_requests"] >= 1  # every request shares the document
    assert s["health_after"]["running"] == 0 and s["health_after"]["waiting"] == 0
    assert json.loads(result_file.read_text()) == s


def test_live_run_at_a_request_rate_without_streaming(engine, capsys):
    with running_server(engine) as url:
        code, s, _ = _run(capsys, "--base-url", url + "/v1", "--num-prompts", "4", "--request-rate", "20",
                          "--seed", "3", "--no-stream", *SMALL)
    assert code == 0 and s["completed"] == 4 and s["lost"] == 0 and s["request_rate"] == 20
    assert s["duration"] >= arrival_times(4, 20, 3)[-1]
    assert s["mean_ttft_ms"] is None and s["mean_itl_ms"] is None and s["mean_e2el_ms"] > 0
    assert s["total_output_tokens"] == 16


def test_a_full_queue_is_counted_as_rejected(engine, capsys):
    slow = SlowEngine(engine, delay=0.05)
    with running_server(slow, max_queue=0, max_num_seqs=1) as url:
        code, s, _ = _run(capsys, "--base-url", url, "--num-prompts", "4", "--max-concurrency", "4", *SMALL)
    assert code == 0 and s["errors"] == 0 and s["lost"] == 0
    assert s["rejected"] >= 1 and s["completed"] >= 1 and s["completed"] + s["rejected"] == 4


def test_a_refused_test_request_stops_the_run(engine, capsys):
    with running_server(engine) as url:
        code = main(["bench", "serve", "--base-url", url, "--num-prompts", "2", *SMALL, "--extra-body", '{"gamma": 0}'])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("rapidspec bench serve: error: the test request failed") and "HTTP 400" in err
    assert len(err.splitlines()) == 1


def test_api_key_is_sent(engine, capsys):
    with running_server(engine, api_key="s3cret") as url:
        code, s, _ = _run(capsys, "--base-url", url, "--num-prompts", "2", "--api-key", "s3cret", *SMALL)
        assert code == 0 and s["completed"] == 2 and s["server_metrics"]["generation_tokens"] == 8
        assert "s3cret" not in json.dumps(s)
        code = main(["bench", "serve", "--base-url", url, "--num-prompts", "2", *SMALL])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.endswith("needs an API key (401): pass --api-key or set RAPIDSPEC_API_KEY")


def test_unreachable_server_is_one_line(capsys):
    code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2", *SMALL])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("rapidspec bench serve: error: cannot reach the server at http://127.0.0.1:")


def test_server_options_need_no_base_url(capsys):
    code = main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--max-queue", "3"])
    assert code == 2 and "--max-queue apply to the server started here" in capsys.readouterr().err


def test_a_server_started_here_is_stopped(tiny_model_dir, capsys):
    code, s, _ = _run(capsys, "--target", str(tiny_model_dir), "--retrieval", "bm25", "--num-prompts", "2",
                      "--server-timeout", "120", "--api-key", "s3cret", *SMALL)
    assert code == 0 and s["completed"] == 2 and s["lost"] == 0 and s["server_metrics"] is not None
    assert s["server"]["started_here"] and s["server"]["exit_code"] == 0
    assert s["base_url"].startswith("http://127.0.0.1:")


def test_sessions_report_prefix_reuse_per_session():
    from rapidspec.bench.serve.stats import RequestResult, summarize

    def done(index, session, prompt, cached):
        return RequestResult(index, outcome="completed", session=session, prompt_tokens=prompt, cached_tokens=cached,
                             output_tokens=1, latency=1.0)

    s = summarize([done(0, "conversation-0", 100, 0), done(1, "conversation-1", 100, 0),
                   done(2, "conversation-0", 100, 90), done(3, "conversation-1", 100, 50)], duration=1.0)
    assert s["prefix_reuse_by_session"] == {"conversation-0": 0.45, "conversation-1": 0.25}
    from rich.console import Console

    from rapidspec.bench.serve.report import outcome_table

    console = Console(width=200, record=True)
    four = {"a": 0.5, "b": 0.5, "c": 1.0, "d": 1.0}
    summary = LoadConfig(base_url="http://h:1").describe() | s | {"dataset": "builtin", "prefix_reuse_by_session": four}
    console.print(outcome_table(summary))
    assert "50.0% / 75.0% / 100.0%" in console.export_text()  # the median of an even count lies between the two middle
    assert "prefix_reuse_by_session" not in summarize([done(0, None, 100, 0)], duration=1.0)
    config = LoadConfig(base_url="http://h:1", sessions=True)
    assert config.describe()["sessions"] is True


def test_serve_args_may_start_with_a_dash():
    """``--serve-args '--batch-steps'`` was read by argparse as an option of its own (exit 2)."""
    from rapidspec.cli import build_parser, join_options_strings

    argv = join_options_strings(["bench-serve", "--serve-args", "--batch-steps --gamma 4", "--peer-args", "-fa on"])
    args = build_parser().parse_args(argv)
    assert args.serve_args == "--batch-steps --gamma 4" and args.peer_args == "-fa on"
