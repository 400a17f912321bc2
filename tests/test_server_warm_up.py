"""``rapidspec serve`` loads the retrieval models at start, on a thread of lower priority: the first request with a
long document does not load the embedder beside the other requests' steps (it took a small request past a second)."""

from __future__ import annotations

import logging
import threading
import time

from rapidspec import Rapid
from rapidspec.errors import RapidspecError
from rapidspec.retrieval import RetrievalConfig
from rapidspec.retrieval import retriever as retriever_module
from rapidspec.server import ServerConfig, create_app
from tests.specs import spec_of

DENSE = RetrievalConfig(method="dense", chunk_tokens=64, budget_tokens=128, embedding_store_gib=0)


def test_the_warm_up_loads_the_embedder_once_whoever_asks_first(tiny_model, monkeypatch):
    loads, embedder, loading = [], object(), threading.Event()

    def load(*args):
        loads.append(threading.current_thread().name)
        loading.set()
        time.sleep(0.2)  # a first request asks meanwhile
        return embedder

    monkeypatch.setattr(retriever_module, "load_embedder", load)
    engine = Rapid(spec_of(retrieval=DENSE), target=tiny_model)
    state = create_app(engine, ServerConfig(model_name="tiny")).state.server
    warming = state.warm_up_retrieval()
    assert loading.wait(30)  # the warm-up's load is under way (its thread runs at a lower priority)
    assert engine.retriever.embedder is embedder  # a request's retrieval waits for the load under way
    warming.result(timeout=30)
    assert engine.retriever.loaded_embedder is embedder
    assert len(loads) == 1 and loads[0].startswith("rapidspec-prepare-large")  # the lower-priority threads


def test_a_warm_up_that_fails_is_logged_and_the_server_goes_on(tiny_model, monkeypatch, caplog):
    def missing(*args):
        raise RapidspecError("the embedding model is not available offline")

    monkeypatch.setattr(retriever_module, "load_embedder", missing)
    state = create_app(Rapid(spec_of(retrieval=DENSE), target=tiny_model), ServerConfig(model_name="tiny")).state.server
    with caplog.at_level(logging.WARNING, logger="rapidspec.server.state"):
        assert state.warm_up_retrieval().result(timeout=30) is None
    assert "retrieval could not warm up: RapidspecError: the embedding model is not available offline" in caplog.text
