"""A request's answer does not depend on timing: alone, in a batch of four, beside a busy thread (float32).

With eta > 0 a plain round takes the target's token and a drafting round p^'s, so the rounds a request gets
(when its drafter joins, which rounds draft) decide its answer. They come from the machine's calibrated costs
and the answer's own acceptance (rapidspec.drafting.join, .gamma_schedule), so they are the same every time.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rapidspec import Rapid
from rapidspec.drafting.calibration import DrafterCosts, TargetCosts
from rapidspec.retrieval import RetrievalConfig
from rapidspec.runtime.lean import LeanModel
from tests.server_harness import HTTP, running_server
from tests.static_costs import StaticCosts
from tests.specs import spec_of

RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=200)
DOCUMENT = " ".join(f"Fact {i}: the archive of room {i} opens at {i % 12 + 1} o'clock." for i in range(60))
QUESTIONS = ["When does room 7 open?", "What is in room 12?", "Which room opens at 3?", "Name a room."]
# Drafting pays when about half the drafts are kept: the schedule switches between plain and drafting rounds.
COSTS = StaticCosts(TargetCosts(0.1, 0.002), DrafterCosts(0.02, 0.1 / 50))


@pytest.fixture(scope="module")
def lean_target(tiny_model):
    return dataclasses.replace(tiny_model, lean=LeanModel(tiny_model.model))


def _ask(url: str, question: str, **options) -> dict:
    body = {"messages": [{"role": "user", "content": question}], "documents": [DOCUMENT], "max_tokens": 60,
            "temperature": 0, "ignore_eos": True, "eta": 1.0, **options}
    response = HTTP.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _busy(stop: threading.Event) -> None:
    """Keeps a core busy with torch work until told to stop (bounded by the test's own requests)."""
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def _engine(lean_target) -> Rapid:
    """A new engine: each case starts from the same engine state (no kept caches, no earlier answers)."""
    engine = Rapid(spec_of(retrieval=RETRIEVAL, drafter_backend="torch"), target=lean_target)
    engine.costs = COSTS
    return engine


def _alone(lean_target, question: str, options: dict) -> tuple:
    out = _engine(lean_target).chat([{"role": "user", "content": question}], documents=[DOCUMENT], max_new_tokens=60,
                                    ignore_eos=True, eta=1.0, **options)
    metrics = out.stats.speculative_decoding()
    return out.text, out.stats.drafter_joined_at, out.stats.plain_rounds, metrics["acceptance_histogram"]


@pytest.mark.parametrize("sampling", [False, True])
def test_the_same_request_gets_the_same_answer_alone_in_a_batch_and_on_a_busy_machine(lean_target, sampling):
    options = {"temperature": 0.8, "seed": 7} if sampling else {}
    alone = [_alone(lean_target, q, options) for q in QUESTIONS]
    stop = threading.Event()
    busy = threading.Thread(target=_busy, args=(stop,), daemon=True)
    busy.start()
    try:
        beside_busy = [_alone(lean_target, q, options) for q in QUESTIONS]
    finally:
        stop.set()
        busy.join(timeout=30)
    apps: list = []
    with running_server(_engine(lean_target), apps, max_num_seqs=4, batch_steps=True) as url:
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            answers = list(pool.map(lambda q: _ask(url, q, **options), QUESTIONS))
    together = [(a["choices"][0]["message"]["content"], a["rapidspec"]["stats"]["drafter_joined_at"],
                 a["rapidspec"]["stats"]["plain_rounds"], a["metrics"]["speculative_decoding"]["acceptance_histogram"])
                for a in answers]
    assert together == alone and beside_busy == alone
    assert all(joined is not None for _, joined, _, _ in alone)  # the drafter did take part
    assert max(apps[0].state.server.worker.batch_rows or [1]) > 1  # some forwards did run several rows
