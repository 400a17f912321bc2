"""`rapidspec serve --replicas`: two replicas of the tiny model on a local Ray Serve (127.0.0.1, 2 CPUs).

8 concurrent chats from 4 conversations, each conversation's turns sent with
its ``x-session-id``, then as plain OpenAI requests (the proxy keys them by
their leading messages): nothing lost, every second turn reuses the first turn's
prefix (the conversation stayed on its replica); /health and /metrics cover
both replicas; a replica killed mid-answer: its request gets a 5xx, none
hangs (Ray Serve's proxy answers it with a 500, in OpenAI's body), the next
requests are served.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from rapidspec.models.spec import ModelSpec
from rapidspec.retrieval import RetrievalConfig
from rapidspec.server import ServerConfig
from tests.server_harness import free_port, wait_until

NOTES = [f"Day {i}: the garden had {i} tulips and the kettle was blue." for i in range(30)]


@pytest.fixture(scope="module")
def replicas(tiny_model_dir):
    import ray
    from ray import serve

    from rapidspec.scale.replicas import deploy

    from rapidspec.scale.proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK  # as `rapidspec serve --replicas` sets it for its local Ray
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    port = free_port()
    spec = ModelSpec(target=str(tiny_model_dir))
    config = ServerConfig(model_name="tiny", max_num_seqs=2,
                          retrieval=RetrievalConfig(method="bm25", chunk_tokens=64, budget_tokens=128))
    try:
        board = deploy(spec, config, replicas=2, resources={"num_cpus": 0.5}, host="127.0.0.1", port=port)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # bounded: until both replicas have reported
            try:
                if len(httpx.get(f"{url}/health", timeout=5).json().get("replicas", [])) == 2:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the replicas did not come up within 240 s")
        yield url
        del board
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop(PROXY_CALLBACK_ENV, None)


def _turn(url: str, conversation: int, turns: int, header: bool) -> dict:
    messages = [{"role": "user", "content": " ".join(NOTES[conversation::4]) + ("" if header else " (plain)")}]
    for turn in range(turns - 1):
        messages += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": f"And turn {turn}?"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "ignore_eos": True, "mode": "lc"}
    headers = {"x-session-id": f"conversation-{conversation}"} if header else {}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("header", [True, False], ids=["x-session-id", "plain-openai"])
def test_conversations_stay_on_their_replica_and_nothing_is_lost(replicas, header):
    answers: dict[tuple[int, int], dict] = {}

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
        assert second["target_prefill_reused_tokens"] > 0, conversation  # the first turn's cache was there
    health = httpx.get(f"{replicas}/health", timeout=10).json()
    assert health["status"] == "ok" and len(health["replicas"]) == 2
    assert "static/app.js" in httpx.get(f"{replicas}/", timeout=10).text  # the page, through Serve's proxy

    def served() -> dict[str, float]:  # replica -> finished requests, from the merged /metrics
        out: dict[str, float] = {}
        for line in httpx.get(f"{replicas}/metrics", timeout=10).text.splitlines():
            if line.startswith("rapidspec:request_success_total{"):
                replica = line.split('replica="')[1].split('"')[0]
                out[replica] = out.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    finished = 8 if header else 16  # the plain run follows the one with headers
    assert wait_until(lambda: sum(served().values()) == finished, timeout=15)  # replicas report once a second


def test_a_killed_replica_fails_its_request_cleanly_and_the_next_ones_are_served(replicas):
    health = httpx.get(f"{replicas}/health", timeout=10).json()
    pids = {r["replica"]: r["pid"] for r in health["replicas"]}
    outcome: dict = {}

    def long_answer() -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me everything."}], "max_tokens": 4000,
                "ignore_eos": True, "mode": "lc"}
        try:
            outcome["response"] = httpx.post(f"{replicas}/v1/chat/completions", json=body,
                                             headers={"x-session-id": "doomed"}, timeout=120)
        except httpx.HTTPError as err:  # a dropped connection is an error too, not a hang
            outcome["error"] = err

    thread = threading.Thread(target=long_answer)
    thread.start()
    deadline = time.monotonic() + 60
    busy = None
    while busy is None and time.monotonic() < deadline:
        for replica in httpx.get(f"{replicas}/health", timeout=10).json()["replicas"]:
            if replica["running"]:
                busy = replica["replica"]
        time.sleep(0.2)
    assert busy is not None
    os.kill(pids[busy], signal.SIGKILL)
    thread.join(150)
    assert not thread.is_alive()  # answered, not hung
    if "response" in outcome:  # the proxy's own 500, in OpenAI's body
        response = outcome["response"]
        assert response.status_code >= 500 and response.json()["error"]["code"] == "replica_unavailable"
    for conversation in range(2):  # the surviving (and the restarted) replicas serve the next requests
        assert _turn(replicas, conversation, 1, header=True)["usage"]["completion_tokens"] == 4

    def restarted() -> bool:  # Serve replaced the dead replica: two report again, the killed process not among them
        health = httpx.get(f"{replicas}/health", timeout=10).json()
        return len(health["replicas"]) == 2 and pids[busy] not in {r["pid"] for r in health["replicas"]}

    assert wait_until(restarted, timeout=180, every=1.0)


def test_replica_options_are_checked_before_anything_starts(capsys):
    from rapidspec.cli import main

    assert main(["serve", "--ray-address", "auto"]) == 2
    assert "--ray-address and --replica-resources apply with --replicas" in capsys.readouterr().err
    assert main(["serve", "--replicas", "2", "--replica-resources", "[1]"]) == 2
    assert "--replica-resources must be a JSON object" in capsys.readouterr().err
    assert main(["serve", "--replicas", "2", "--port", "0"]) == 2
    assert "--replicas needs a --port" in capsys.readouterr().err
