"""Do conversations keep their replica under load? (`serve --replicas 2`, the figure docs/scaling.md quotes)

    python benchmarks/affinity_load.py --router affinity --hog
    python benchmarks/affinity_load.py --router consistent-hash --hog

Deploys two replicas of the tiny test model (2 layers, byte tokenizer; or
--target PATH) on a local Ray Serve (127.0.0.1, 2 CPUs, half a CPU and
--max-num-seqs 2 each, as tests/test_replicas.py does), then, --rounds times,
sends 4 conversations x 2 turns at once as plain OpenAI requests (no session
header: the proxy keys them by their leading messages), each conversation's
second turn after its first. With --hog another process spins on one core
meanwhile. Counts the second turns that reused their first turn's prefix
(``target_prefill_reused_tokens > 0``: they found it on their replica) and
reads ``rapidspec:affinity_overflow_total`` from /metrics. Prints one line per
round, then one JSON object as the last line. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import httpx

ROUTERS = {"affinity": "rapidspec.scale.router.AffinityRouter",
           "consistent-hash": "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"}
NOTES = [f"Day {i}: the garden had {i} tulips and the kettle was blue." for i in range(30)]
#: A process that spins on one core, for at most ten minutes.
HOG = "import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end: pass"


def turn(url: str, round_: int, conversation: int, turns: int) -> dict:
    """One turn of a conversation (its first user message is its own), as tests/test_replicas.py sends it."""
    messages = [{"role": "user", "content": f"Round {round_}. " + " ".join(NOTES[conversation::4])}]
    for i in range(turns - 1):
        messages += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": f"And turn {i}?"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "ignore_eos": True, "mode": "lc"}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def one_round(url: str, round_: int, conversations: int = 4) -> int:
    """Second turns (of ``conversations`` sent at once) that reused their prefix."""
    reused: dict[int, int] = {}

    def chat(conversation: int) -> None:
        turn(url, round_, conversation, 1)
        second = turn(url, round_, conversation, 2)["rapidspec"]["stats"]
        reused[conversation] = second["target_prefill_reused_tokens"]

    threads = [threading.Thread(target=chat, args=(c,)) for c in range(conversations)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return sum(1 for tokens in reused.values() if tokens > 0)


def overflows(url: str) -> float:
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("rapidspec:affinity_overflow_total"))


def tiny_model_dir(folder: str) -> str:
    """The tiny model of the test suite, saved as a Hugging Face directory."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.conftest import make_tiny_model

    model = make_tiny_model(0)
    model.model.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    return folder


def wait_for_replicas(url: str, count: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if len(httpx.get(f"{url}/health", timeout=5).json().get("replicas", [])) == count:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"the replicas did not come up within {timeout:g} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router", choices=sorted(ROUTERS), default="affinity")
    parser.add_argument("--hog", action="store_true", help="another process spins on one core during the rounds")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--idle", type=float, default=0.0,
                        help="seconds without requests before each round (Serve's queue-length cache expires after 10)")
    parser.add_argument("--target", default=None, help="a model directory (default: the tiny test model)")
    parser.add_argument("--port", type=int, default=8471)
    args = parser.parse_args()

    import ray
    from ray import serve

    from rapidspec.engine.spec import EngineSpec
    from rapidspec.models.spec import ModelSpec
    from rapidspec.retrieval import RetrievalConfig
    from rapidspec.scale.proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV
    from rapidspec.scale.replicas import deploy
    from rapidspec.server import ServerConfig

    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK
    folder = tempfile.mkdtemp(prefix="rapidspec-affinity-")
    target = args.target or tiny_model_dir(folder)
    retrieval = RetrievalConfig(method="bm25", chunk_tokens=64, budget_tokens=128)
    config = ServerConfig(model_name="tiny", max_num_seqs=2, retrieval=retrieval)
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    url, hog, results = f"http://127.0.0.1:{args.port}", None, []
    try:
        board = deploy(EngineSpec(ModelSpec(target=target), retrieval), config, replicas=2, resources={"num_cpus": 0.5}, port=args.port,
                       router=ROUTERS[args.router])  # noqa: F841  (held while serving)
        wait_for_replicas(url, 2)
        if args.hog:
            hog = subprocess.Popen([sys.executable, "-c", HOG])
        for round_ in range(args.rounds):
            time.sleep(args.idle)
            results.append(one_round(url, round_))
            print(f"round {round_}: {results[-1]} of 4 second turns reused their prefix", flush=True)
        overflowed = overflows(url)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait(10)
        serve.shutdown()
        ray.shutdown()
    print(json.dumps({"router": args.router, "hog": args.hog, "reused_of_4": results, "overflows": overflowed,
                      "target": args.target or "tiny test model"}))


if __name__ == "__main__":
    main()
