"""Load test of `rapidspec serve`: concurrent chat requests, bad ones and early disconnects.

    python benchmarks/serve_load.py --requests 32 --max-tokens 16 --max-queue 16

Starts `rapidspec serve` on 127.0.0.1 (a free port; the built-in model unless
--target says otherwise), then sends --requests chat requests at once, all
about one LoCoMo conversation (so they share a prefix): of every 8, four are
plain, two stream, one is malformed (bad JSON, a misspelt field or a prompt
longer than the window, in turn) and one streams and disconnects after its
first chunk. Every request must end in a clear outcome: completed, rejected
with 429 (queue full), a 400 for the malformed ones, or disconnected on
purpose; "lost" (no answer, a 5xx or a connection error) must be 0. Then it
checks /health, reads /metrics, stops the server with SIGTERM and reports its
exit code. Bounded: --timeout seconds for the whole load, loopback only.
Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from rapidspec.evaluation.datasets import locomo_sessions

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "locomo" / "locomo_dev.json"
MALFORMED = ("json", "field", "too_long")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def conversation(path: Path, sessions: int) -> tuple[list[dict], list[str]]:
    sample = json.loads(path.read_text(encoding="utf-8"))[0]
    history = [m for session in locomo_sessions(sample["conversation"])[:sessions] for m in session]
    questions = [str(q["question"]) for q in sample["qa"]][:64]
    return history, questions


async def one_request(client: httpx.AsyncClient, index: int, history, questions, max_tokens: int) -> dict:
    kind = ("plain", "plain", "plain", "plain", "stream", "stream", "malformed", "disconnect")[index % 8]
    messages = history + [{"role": "user", "content": questions[index % len(questions)]}]
    body: dict = {"messages": messages, "max_tokens": max_tokens}
    content = None
    if kind == "malformed":
        flavour = MALFORMED[(index // 8) % len(MALFORMED)]
        if flavour == "json":
            content = b'{"messages": [{"role": "user", "content": "cut off'
        elif flavour == "field":
            body["gama"] = 3
        else:
            body["messages"] = [{"role": "user", "content": "word " * 20000}]
    if kind in ("stream", "disconnect"):
        body["stream"] = True
    started = time.perf_counter()
    result = {"index": index, "kind": kind, "status": None, "ttft": None, "latency": None, "outcome": "lost"}
    try:
        request = client.build_request("POST", "/v1/chat/completions", json=None if content else body, content=content,
                                       headers={"content-type": "application/json"})
        response = await client.send(request, stream=True)
        result["status"] = response.status_code
        try:
            if response.status_code != 200:
                await response.aread()
                expected = response.status_code == 429 or (response.status_code == 400 and kind == "malformed")
                has_schema = "error" in response.json()
                result["outcome"] = ("rejected" if response.status_code == 429 else "bad_request") if (
                    expected and has_schema) else "error"
                return result
            if not body.get("stream"):
                data = json.loads(await response.aread())
                result["latency"] = time.perf_counter() - started
                result["outcome"] = "completed" if data["choices"][0]["finish_reason"] in ("stop", "length") else "error"
                return result
            finished = False
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result["outcome"] = "error"
                    return result
                choice = (chunk.get("choices") or [{}])[0]
                if choice.get("delta", {}).get("content") and result["ttft"] is None:
                    result["ttft"] = time.perf_counter() - started
                    if kind == "disconnect":
                        result["outcome"] = "disconnected"
                        return result
                finished = finished or bool(choice.get("finish_reason"))
            result["latency"] = time.perf_counter() - started
            result["outcome"] = "completed" if finished else "error"
            return result
        finally:
            await response.aclose()
    except (httpx.HTTPError, ValueError, KeyError) as err:
        result["detail"] = repr(err)
        return result


async def load(url: str, args, history, questions) -> list[dict]:
    limits = httpx.Limits(max_connections=args.requests)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        tasks = [one_request(client, i, history, questions, args.max_tokens) for i in range(args.requests)]
        return await asyncio.wait_for(asyncio.gather(*tasks), args.timeout)


def percentile(values: list[float], q: float) -> float | None:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else (values or [None])[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=2, help="LoCoMo sessions in the shared history (default: 2)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole load")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--target", default="builtin")
    parser.add_argument("--drafter-quantize", default="int8")
    args = parser.parse_args(argv)
    if not 1 <= args.requests <= 256:
        parser.error("--requests must be in [1, 256]")
    history, questions = conversation(args.data, args.sessions)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="serve_load_", suffix=".log", delete=False)
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; from rapidspec.cli import main; sys.exit(main())", "serve",
         "--host", "127.0.0.1", "--port", str(port), "--target", args.target, "--drafter-quantize",
         args.drafter_quantize, "--retrieval", "bm25", "--max-queue", str(args.max_queue)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    console = Console(stderr=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                console.print(f"serve_load: error: the server did not start (log: {log.name})")
                return 1
            time.sleep(0.5)
        started = time.perf_counter()
        results = asyncio.run(load(url, args, history, questions))
        wall = time.perf_counter() - started
        settled = time.monotonic() + 60
        while (health := httpx.get(f"{url}/health", timeout=5).json())["running"] or health["waiting"]:
            if time.monotonic() > settled:
                break
            time.sleep(0.5)
        metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in
                   httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
                   if line.startswith(("rapidspec:prefix_cache_hit_requests_total", "rapidspec:generation_tokens_total"))}
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            exit_code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            exit_code = server.wait()

    counts = {o: sum(r["outcome"] == o for r in results)
              for o in ("completed", "rejected", "bad_request", "disconnected", "error", "lost")}
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None and r["outcome"] == "completed"]
    latencies = [r["latency"] for r in results if r["latency"] is not None]
    summary = {
        "requests": args.requests, "max_queue": args.max_queue, "max_tokens": args.max_tokens, "wall_s": wall,
        **counts, "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
        "latency_p50_s": percentile(latencies, 50), "latency_p95_s": percentile(latencies, 95),
        "health_after": health, "server_exit_code": exit_code, "metrics": metrics, "server_log": log.name,
    }
    table = Table(title=f"rapidspec serve under load ({args.requests} requests at once, queue bound {args.max_queue})")
    table.add_column("")
    table.add_column("value", justify="right")
    for key in ("completed", "rejected", "bad_request", "disconnected", "error", "lost"):
        table.add_row(key, str(counts[key]))
    for key in ("ttft_p50_s", "ttft_p95_s", "latency_p50_s", "latency_p95_s", "wall_s"):
        table.add_row(key, "-" if summary[key] is None else f"{summary[key]:.2f}")
    table.add_row("health after", f"{health['status']}, running {health['running']}, waiting {health['waiting']}")
    table.add_row("server exit code after SIGTERM", str(exit_code))
    Console().print(table)
    print(json.dumps(summary))
    return 0 if counts["lost"] == 0 and counts["error"] == 0 and exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
