"""What is made on first use is made once, whichever threads ask at the same time.

The server prepares requests on its preparing threads while the engine thread
decodes, so a drafter pool, a drafter loaded by name, the lean forward's rope
tables and llguidance's tokenizer view may be asked for by several threads at
once. Each unit is hammered from many threads behind a barrier (bounded
joins); then a live server (127.0.0.1; lean target, drafter given by name)
gets many requests at once, each with a grammar and a length it has not seen:
every one answered, every JSON valid.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
import torch

from rapidspec import ModelSpec, Rapid
from rapidspec.drafting.factory import DrafterFactory
from rapidspec.grammar import Grammar, GrammarTokens
from rapidspec.retrieval import RetrievalConfig
from rapidspec.runtime.lean import LeanModel
from tests.server_harness import HTTP, running_server
from tests.specs import spec_of

THREADS = 16
JOIN_S = 60


def at_once(task, n: int = THREADS) -> list:
    """``task(i)`` on ``n`` threads released together (a barrier); their results in order."""
    barrier = threading.Barrier(n, timeout=JOIN_S)

    def run(i):
        barrier.wait()
        return task(i)

    with ThreadPoolExecutor(n) as pool:
        return [f.result(timeout=JOIN_S) for f in [pool.submit(run, i) for i in range(n)]]


def test_a_drafter_loaded_by_name_and_its_pool_are_made_once(tiny_model, tiny_model_dir, monkeypatch):
    import rapidspec.models as models

    loads = []
    real = models.load_model

    def counted(*args, **kwargs):
        loads.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(models, "load_model", counted)
    factory = DrafterFactory(tiny_model, str(tiny_model_dir), ModelSpec(drafter_backend="torch"))  # loads to size its vocabulary
    factory._pools.clear()  # back to a drafter given by name, nothing made
    factory._source, factory._relation = str(tiny_model_dir), None
    loads.clear()
    got = at_once(lambda i: (factory.pool("torch"), factory.model, factory.relation))
    assert len(loads) == 1
    assert len({id(pool) for pool, _, _ in got}) == 1 and len({id(model) for _, model, _ in got}) == 1
    assert len({relation for _, _, relation in got}) == 1


def test_rope_tables_grown_from_many_threads_equal_one_thread(tiny_model):
    reference = LeanModel(tiny_model.model)
    lean = LeanModel(tiny_model.model)
    lengths = [300 + 97 * i for i in range(THREADS)]  # every thread needs the tables to grow
    got = at_once(lambda i: lean.rope_tables(lengths[i] - 50, 50))
    for (cos, sin), length in zip(got, lengths):
        want_cos, want_sin = reference.rope_tables(length - 50, 50)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_the_tokenizer_view_is_made_once(byte_tokenizer, monkeypatch):
    import llguidance.hf

    made = []
    real = llguidance.hf.from_tokenizer

    def counted(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", counted)
    tokens = GrammarTokens(byte_tokenizer, len(byte_tokenizer), frozenset({byte_tokenizer.eos_token_id}))
    states = at_once(lambda i: tokens.start(Grammar.regex(f"a{{{i + 1}}}")))
    assert len(made) == 1 and len(states) == THREADS


def schema(i: int) -> dict:
    """A different schema for each request (a grammar the server has not compiled)."""
    return {"type": "object", "properties": {f"k{i}": {"enum": [f"v{i}", "w"]}}, "required": [f"k{i}"],
            "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_model, tiny_model_dir):
    """A fresh engine: its target on the lean forward (rope tables grown on demand), its drafter given by name."""
    target = dataclasses.replace(tiny_model, lean=LeanModel(tiny_model.model))
    engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25", chunk_tokens=64, budget_tokens=128)),
                   target=target, drafter=str(tiny_model_dir))
    with running_server(engine, max_num_seqs=4, max_queue=THREADS) as url:
        yield url


def test_many_first_requests_at_once(server):
    """New grammars and new lengths, all at once: every one answered."""

    def ask(i: int) -> httpx.Response:
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"Question {i}?"}], "max_tokens": 40,
                "mode": ["rapid", "sd", "ragsd", "lc"][i % 4], "drafter_start": "first", "temperature": 0,
                "documents": [" ".join(f"Fact {j} of request {i}." for j in range(5 + 8 * i))]}
        if i % 2 == 0:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema(i)}}
        return HTTP.post(f"{server}/v1/chat/completions", json=body, timeout=JOIN_S)

    answers = at_once(ask)
    for i, response in enumerate(answers):
        assert response.status_code == 200, response.text[:500]
        choice = response.json()["choices"][0]
        if i % 2 == 0 and choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema(i))
