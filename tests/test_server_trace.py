"""The ``trace`` extension of stream chunks (what the page at ``/`` draws) and the page's files, on the tiny model."""

from __future__ import annotations

import json

import pytest

from rapidspec import Rapid
from rapidspec.outputs import StreamChunk, token_kinds
from rapidspec.retrieval import RetrievalConfig
from rapidspec.stats import RoundRecord
from tests.server_harness import HTTP, running_server
from tests.specs import spec_of

ASK = {"model": "tiny", "messages": [{"role": "user", "content": "What colour was the kettle?"}], "max_tokens": 24,
       "documents": ["Day 3: the kettle was blue. " * 30], "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def server(tiny_model):
    with running_server(Rapid(spec_of(retrieval=RetrievalConfig(method="bm25")),
                              target=tiny_model), api_key="k") as url:
        yield url


def events(url: str, body: dict) -> list[dict]:
    response = HTTP.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"}, timeout=60)
    assert response.status_code == 200, response.text
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def test_kinds_follow_the_round():
    def kinds(drafted, accepted, count):
        return token_kinds(StreamChunk("", tuple(range(count)), round=RoundRecord(drafted, accepted, 0, 0, 0, 0, 0)))
    assert kinds(4, 2, 3) == ["accepted", "accepted", "recovered"]
    assert kinds(3, 3, 4) == ["accepted"] * 3 + ["bonus"]
    assert kinds(0, 0, 1) == ["plain"] and kinds(4, 4, 2) == ["accepted", "accepted"]  # cut by a stop
    assert token_kinds(StreamChunk("", (1, 2))) == ["plain", "plain"]


@pytest.mark.parametrize("mode", ["rapid", "lc"])
def test_traced_chunks_tell_each_tokens_round_and_kind(server, mode):
    chunks = events(server, ASK | {"trace": True, "mode": mode, "gamma_schedule": "constant", "logprobs": True,
                                   "drafter_start": "first"})
    traced = [c for c in chunks if "tokens" in c.get("rapidspec", {})]
    assert traced and [c["rapidspec"]["round"]["index"] for c in traced] == list(range(1, len(traced) + 1))
    kinds = {t["kind"] for c in traced for t in c["rapidspec"]["tokens"]}
    assert kinds <= {"accepted", "recovered", "bonus", "plain"}
    if mode == "lc":
        assert kinds == {"plain"}
    else:  # self-speculation with eta = 0 keeps drafts: some tokens are accepted drafts
        assert "accepted" in kinds and any(c["rapidspec"]["round"]["drafted"] > 0 for c in traced)
    for chunk in traced:  # one log-probability per traced token, the same tokens
        assert len(chunk["choices"][0]["logprobs"]["content"]) == len(chunk["rapidspec"]["tokens"])
    final = [c for c in chunks if "stats" in c.get("rapidspec", {})]
    assert len(final) == 1 and final[0]["rapidspec"]["stats"]["new_tokens"] == sum(
        len(c["rapidspec"]["tokens"]) for c in traced)


def test_plain_clients_see_nothing_new(server):
    chunks = events(server, ASK | {"mode": "rapid"})
    assert all("tokens" not in c.get("rapidspec", {}) for c in chunks)
    assert sum("rapidspec" in c for c in chunks) == 1  # the last chunk's statistics, as before


def test_the_page_is_open_and_the_api_is_not(server):
    page = HTTP.get(f"{server}/", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"] and "app.js" in page.text
    for name, kind in (("app.js", "javascript"), ("style.css", "css")):
        response = HTTP.get(f"{server}/static/{name}", timeout=10)
        assert response.status_code == 200 and kind in response.headers["content-type"]
    assert HTTP.get(f"{server}/static/../app.py", timeout=10).status_code in (401, 404)
    assert HTTP.get(f"{server}/static/secret.txt", timeout=10).status_code == 401  # not the page's: the key applies
    assert HTTP.get(f"{server}/v1/models", timeout=10).status_code == 401
