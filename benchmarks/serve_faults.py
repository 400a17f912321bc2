"""How fast `rapidspec serve` recovers from clients that misbehave (the figures docs/serving.md quotes).

    python benchmarks/serve_faults.py --repeats 3

Starts `rapidspec serve` (built-in model by default) on 127.0.0.1 and measures, --repeats times each:

* a non-streaming client that gives up (client timeout) mid-answer: seconds from its leaving until
  /health shows the engine free;
* the same for a streaming client that closes its stream after the first chunk;
* a client that leaves during a long prefill (a document of --prefill-tokens tokens): seconds until free;
* a 5 MB document: seconds until its 400, and the latency of a small request sent at the same moment.

Prints a table of medians, then one JSON object as the last line. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import httpx
from rich.console import Console
from rich.table import Table

from rapidspec.bench.serve.process import LaunchConfig, LocalServer
from rapidspec.prompting.demo_document import demo_document

LONG_ANSWER = {"max_tokens": 2000, "ignore_eos": True, "mode": "rapid"}
SMALL = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}


def seconds_until_free(url: str, left: float, timeout: float = 60) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/health", timeout=5).json()["running"] == 0:
            return time.perf_counter() - left
        time.sleep(0.01)
    raise RuntimeError("the engine was not free within the timeout")


def wait_free(url: str) -> None:
    seconds_until_free(url, time.perf_counter(), timeout=600)


def plain_leaves(url: str, question: dict) -> float:
    try:
        httpx.post(f"{url}/v1/chat/completions", json=question | LONG_ANSWER, timeout=3.0)
    except httpx.ReadTimeout:
        return seconds_until_free(url, time.perf_counter())
    raise RuntimeError("the answer finished before the client's timeout; ask for a longer one")


def stream_leaves(url: str, question: dict) -> float:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=question | LONG_ANSWER | {"stream": True},
                      timeout=60) as response:
        for line in response.iter_lines():
            if '"content"' in line and '"content": ""' not in line:
                break
    return seconds_until_free(url, time.perf_counter())


def prefill_leaves(url: str, document: str) -> float:
    body = {"messages": [{"role": "user", "content": "Summarise the log."}], "documents": [document],
            "max_tokens": 8, "mode": "lc"}
    try:
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1.0)
    except httpx.ReadTimeout:
        return seconds_until_free(url, time.perf_counter())
    raise RuntimeError("the prefill finished within a second; use a longer --prefill-tokens")


def huge_document(url: str) -> tuple[float, float, int]:
    body = {"messages": [{"role": "user", "content": "What is in it?"}], "documents": ["a few words. " * 400_000]}
    small: dict = {}

    def send_small() -> None:
        started = time.perf_counter()
        small["status"] = httpx.post(f"{url}/v1/chat/completions", json=SMALL, timeout=120).status_code
        small["seconds"] = time.perf_counter() - started

    beside = threading.Thread(target=send_small)
    started = time.perf_counter()
    beside.start()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    error_seconds = time.perf_counter() - started
    beside.join(130)
    if response.status_code != 400 or small.get("status") != 200:
        raise RuntimeError(f"expected a 400 and a 200, got {response.status_code} and {small.get('status')}")
    return error_seconds, small["seconds"], len(json.dumps(body).encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="builtin")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-tokens", type=int, default=7000, help="document size of the prefill case")
    args = parser.parse_args(argv)
    if not 1 <= args.repeats <= 20:
        parser.error("--repeats must be in [1, 20]")
    item = demo_document(target_tokens=2000)
    question = {"messages": [{"role": "user", "content": item.question}], "documents": [item.document]}
    long_document = demo_document(target_tokens=args.prefill_tokens).document
    serve_args = ("--target", args.target, "--max-new-tokens", "2000")
    runs: dict[str, list[float]] = {"plain_client_leaves_s": [], "stream_client_leaves_s": [],
                                    "client_leaves_in_prefill_s": [], "document_5mb_error_s": [],
                                    "small_request_beside_it_s": []}
    with LocalServer(LaunchConfig(serve_args)) as server:
        url = server.url
        httpx.post(f"{url}/v1/chat/completions", json=question | {"max_tokens": 4}, timeout=600)  # warm up
        for _ in range(args.repeats):
            runs["plain_client_leaves_s"].append(plain_leaves(url, question))
            runs["stream_client_leaves_s"].append(stream_leaves(url, question))
            wait_free(url)
            runs["client_leaves_in_prefill_s"].append(prefill_leaves(url, long_document))
            error_s, small_s, size = huge_document(url)
            runs["document_5mb_error_s"].append(error_s)
            runs["small_request_beside_it_s"].append(small_s)
            wait_free(url)
    summary = {name: statistics.median(values) for name, values in runs.items()}
    summary |= {"repeats": args.repeats, "document_bytes": size, "server_exit_code": server.exit_code, "runs": runs}
    table = Table(title=f"rapidspec serve faults ({args.target}, medians of {args.repeats})")
    table.add_column("")
    table.add_column("seconds", justify="right")
    for name in runs:
        table.add_row(name, f"{summary[name]:.3f}")
    Console().print(table)
    print(json.dumps(summary))
    return 0 if server.exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
