"""How long a small request and /health wait beside legal but expensive requests (docs/serving.md quotes it).

    python -m benchmarks.serve_beside --repeats 3 [--serve-args '--shared-prefill-tokens 0']
    python -m benchmarks.serve_beside --repeats 1 --cases lc --document-tokens 32000 --delay 300 --timeout 900

Starts `rapidspec serve` (built-in model by default) on 127.0.0.1; for each expensive request below, --repeats
times: sends it, sends a small chat request (8 tokens) --delay seconds later, and asks /health every 50 ms until
both are answered. Reports, per case, the expensive request's status and seconds, the small request's whole
answer time and /health's slowest answer (medians over the repeats), and the small request alone first.

* a first-seen document of 8K tokens, or --document-tokens (mode lc: the target prefills it, piece after piece;
  with --delay the small request comes that far into the prefill);
* a first-seen document of four windows (mode rag, truncate middle: sizing, retrieval and embedding);
* 60,000 empty messages (truncate middle);
* a 2 MB query (truncate middle);
* a 2 MB /tokenize;
* an answer of 256 tokens, and one with 20 log-probabilities each.

Prints a table, then one JSON object as the last line. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.document_once import commit_line, cpu_line
from rapidspec.bench.serve.process import LaunchConfig, LocalServer
from rapidspec.prompting.demo_document import demo_document

SMALL = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "ignore_eos": True}
HEALTH_EVERY_S = 0.05
TIMEOUT_S = 300


def cases(window: int, document_tokens: int = 8192) -> dict[str, tuple[str, Callable[[], dict]]]:
    """name -> (route, body maker); bodies are made one at a time, the document new each time (first seen)."""
    question = [{"role": "user", "content": "What happened on the third day?"}]

    def document() -> str:
        half = demo_document(target_tokens=2 * window - 1024).document
        return f"Log {uuid.uuid4().hex}.\n{half}\n\n{half}"

    return {
        f"first-seen {document_tokens / 1000:.0f}K-token document (lc: the target's prefill)": (
            "/v1/chat/completions", lambda: {
                "messages": question, "mode": "lc", "max_tokens": 8,
                "documents": [f"Log {uuid.uuid4().hex}.\n" + demo_document(target_tokens=document_tokens).document]}),
        "first-seen 4-window document (rag)": ("/v1/chat/completions", lambda: {
            "messages": question, "mode": "rag", "truncate": "middle", "max_tokens": 8, "documents": [document()]}),
        "60,000 empty messages": ("/v1/chat/completions", lambda: {
            "messages": [{"role": "user", "content": ""}] * 60_000 + question, "truncate": "middle", "max_tokens": 8}),
        "2 MB query": ("/v1/chat/completions", lambda: {
            "messages": question, "documents": ["a short note"], "query": "q " * 1_000_000, "truncate": "middle",
            "max_tokens": 8}),
        "2 MB /tokenize": ("/tokenize", lambda: {"prompt": "word " * 400_000}),
        "256 tokens, no logprobs": ("/v1/chat/completions", lambda: {
            "messages": question, "max_tokens": 256, "ignore_eos": True}),
        "256 tokens with 20 logprobs": ("/v1/chat/completions", lambda: {
            "messages": question, "max_tokens": 256, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}),
    }


def timed_post(client: httpx.Client, route: str, body: dict, out: dict) -> None:
    started = time.perf_counter()
    out["status"] = client.post(route, json=body).status_code
    out["seconds"] = time.perf_counter() - started
    out["ended"] = time.perf_counter()


def beside(client: httpx.Client, route: str, body: dict, delay: float, timeout: float = TIMEOUT_S) -> dict:
    """The expensive request, the small one ``delay`` s later, /health polled until both are answered.

    One client (its connections made before the clock starts), so no client set-up holds this process's GIL
    while another thread times an answer.
    """
    expensive: dict = {}
    small: dict = {}
    health: list[tuple[float, float]] = []  # (seconds, when it was asked)
    heavy = threading.Thread(target=timed_post, args=(client, route, body, expensive))
    heavy.start()
    time.sleep(delay)
    light = threading.Thread(target=timed_post, args=(client, "/v1/chat/completions", SMALL, small))
    light.start()
    deadline = time.monotonic() + timeout
    while (heavy.is_alive() or light.is_alive()) and time.monotonic() < deadline:
        started = time.perf_counter()
        client.get("/health")
        health.append((time.perf_counter() - started, started))
        time.sleep(HEALTH_EVERY_S)
    heavy.join(timeout)
    light.join(timeout)
    if "status" not in expensive:
        raise RuntimeError(f"the expensive request got no answer within --timeout {timeout:.0f} s")
    if small.get("status") != 200:
        raise RuntimeError(f"the small request got {small.get('status')}")
    slowest, asked = max(health, default=(0.0, 0.0))
    return {"status": expensive.get("status"), "expensive_s": expensive.get("seconds"), "small_s": small["seconds"],
            "health_max_s": slowest, "health_checks": len(health),
            "health_max_before_expensive_end_s": expensive.get("ended", asked) - asked}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="builtin")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default="", help="only the cases whose names hold this text (default: all)")
    parser.add_argument("--delay", type=float, default=0.3, help="seconds between the expensive and the small request")
    parser.add_argument("--document-tokens", type=int, default=8192, help="the lc case's document length")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S,
                        help="seconds each request may take (a 32K-token document's prefill takes minutes)")
    parser.add_argument("--serve-args", default="", help="more options of rapidspec serve, as one string")
    args = parser.parse_args(argv)
    if not 1 <= args.repeats <= 20:
        parser.error("--repeats must be in [1, 20]")
    if not args.timeout > 0:
        parser.error("--timeout must be > 0")
    if not 1024 <= args.document_tokens <= 131072:
        parser.error("--document-tokens must be in [1024, 131072]")
    results: dict[str, list[dict]] = {}
    load = os.getloadavg()[0]
    with LocalServer(LaunchConfig(("--target", args.target, *shlex.split(args.serve_args)))) as server, \
            httpx.Client(base_url=server.url, timeout=args.timeout) as client:
        window = client.get("/v1/models").json()["data"][0]["max_model_len"]
        for _ in range(2):  # warm up (the first request loads the retrieval models)
            client.post("/v1/chat/completions", json=SMALL | {"documents": ["a note"]})
        alone = []
        for _ in range(args.repeats):
            out: dict = {}
            timed_post(client, "/v1/chat/completions", SMALL, out)
            alone.append(out["seconds"])
        for _ in range(args.repeats):
            for name, (route, make_body) in cases(window, args.document_tokens).items():
                if args.cases in name:
                    results.setdefault(name, []).append(beside(client, route, make_body(), args.delay, args.timeout))
    medians = {name: {key: statistics.median(r[key] for r in runs) for key in ("expensive_s", "small_s", "health_max_s")}
               | {"statuses": sorted({r["status"] for r in runs})} for name, runs in results.items()}
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average at the start {load:.2f}; "
          f"{cpu_line()}; {commit_line()}; {' '.join(sys.argv)}")
    table = Table(title=f"beside expensive requests ({args.target}, window {window}, medians of {args.repeats})")
    for column in ("expensive request", "its status", "its seconds", "small request s", "/health slowest s"):
        table.add_column(column, justify="left" if column == "expensive request" else "right")
    table.add_row("(none: the small request alone)", "", "", f"{statistics.median(alone):.2f}", "")
    for name, m in medians.items():
        table.add_row(name, ",".join(map(str, m["statuses"])), f"{m['expensive_s']:.2f}", f"{m['small_s']:.2f}",
                      f"{m['health_max_s']:.3f}")
    Console().print(table)
    print(json.dumps({"target": args.target, "window": window, "repeats": args.repeats, "small_alone_s": alone,
                      "medians": medians, "runs": results, "server_exit_code": server.exit_code}))
    return 0 if server.exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
