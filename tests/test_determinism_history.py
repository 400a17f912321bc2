"""A request's answer does not depend on the requests before or beside it, on one long-lived engine and server.

With eta > 0 the round the drafter joins decides the text, and the join reads what earlier answers taught
(their acceptance, the drafter caches they left). Only the request's own conversation's earlier answers count
(rapidspec.drafting.memory): here one greedy request gets the same answer first, after other questions about
the same document (which leave drafter caches sharing its prompt), after answers whose drafts were mostly
rejected, and in batches whose neighbours finish in different orders; and it drafts (float32, eta 1 and 5).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest

from rapidspec import DecodeConfig, Rapid
from rapidspec.drafting.calibration import DrafterCosts, TargetCosts
from rapidspec.retrieval import RetrievalConfig
from rapidspec.runtime.lean import LeanModel
from tests.server_harness import HTTP, running_server
from tests.static_costs import StaticCosts
from tests.specs import spec_of

RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=200)
DOCUMENT = " ".join(f"Fact {i}: the archive of room {i} opens at {i % 12 + 1} o'clock." for i in range(60))
OTHER_DOCUMENT = " ".join(f"Line {i}: the ferry left pier {i} at noon with {i * 3} crates." for i in range(60))
QUESTION = "When does room 7 open?"
OTHERS = ["What is in room 12?", "Which room opens at 3?", "Name a room."]
# Drafting pays when about half the drafts are kept: the join and the schedule read the acceptance they expect.
COSTS = StaticCosts(TargetCosts(0.1, 0.002), DrafterCosts(0.02, 0.1 / 50))


@pytest.fixture(scope="module")
def engine(tiny_model):
    lean = dataclasses.replace(tiny_model, lean=LeanModel(tiny_model.model))
    engine = Rapid(spec_of(retrieval=RETRIEVAL, drafter_backend="torch"), target=lean)
    engine.costs = COSTS
    return engine


def _body(question: str, document: str = DOCUMENT, **options) -> dict:
    return {"messages": [{"role": "user", "content": question}], "documents": [document], "max_tokens": 60,
            "temperature": 0, "ignore_eos": True, **options}


def _ask(url: str, body: dict) -> tuple:
    response = HTTP.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    stats = answer["rapidspec"]["stats"]
    return (answer["choices"][0]["message"]["content"], stats["drafter_joined_at"], stats["plain_rounds"],
            answer["metrics"]["speculative_decoding"]["num_draft_tokens"])


def _local(engine: Rapid, question: str, document: str = DOCUMENT, **options) -> tuple:
    out = engine.chat([{"role": "user", "content": question}], documents=[document], max_new_tokens=60,
                      ignore_eos=True, **options)
    return out.text, out.stats.drafter_joined_at, out.stats.plain_rounds, out.stats.drafted_tokens


@pytest.mark.parametrize("eta", [1.0, 5.0])
def test_one_request_after_different_histories_and_beside_neighbours(engine, eta):
    first = _local(engine, QUESTION, eta=eta)
    assert first[3] > 0  # it drafted: its join point mattered
    for question in OTHERS:  # the same document: their drafter caches share its prompt's start
        _local(engine, question, eta=eta)
    after_neighbours = _local(engine, QUESTION, eta=eta)
    for question in OTHERS:  # answers whose drafts are mostly rejected (sampled, the drafter's tokens ignored)
        _local(engine, question, OTHER_DOCUMENT, eta=0.0, temperature=1.5, seed=3)
    after_rejections = _local(engine, QUESTION, eta=eta)
    assert after_neighbours == first and after_rejections == first

    apps: list = []
    with running_server(engine, apps, max_num_seqs=4, batch_steps=True) as url:
        alone = _ask(url, _body(QUESTION, eta=eta))
        for lengths in ([4, 30, 90], [90, 30, 4]):  # neighbours ending before and after it, in two orders
            bodies = [_body(QUESTION, eta=eta)] + [_body(q, max_tokens=n, eta=eta) for q, n in zip(OTHERS, lengths)]
            with ThreadPoolExecutor(len(bodies)) as pool:
                batch = list(pool.map(lambda b: _ask(url, b), bodies))
            assert batch[0] == alone
        assert max(apps[0].state.server.worker.batch_rows or [1]) > 1  # some forwards did run several rows
    assert alone == first


def test_a_follow_up_reads_its_own_conversations_answer_whatever_ran_between(engine):
    """Turn 2 of a conversation plans with turn 1's acceptance and the drafter cache turn 1 left; unrelated requests
    between the two turns change neither its plan nor its answer."""
    turn_1 = [{"role": "user", "content": QUESTION}]
    first = engine.chat(turn_1, documents=[DOCUMENT], max_new_tokens=40, ignore_eos=True, eta=1.0)
    turn_2 = turn_1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And room 8?"}]

    def follow_up():
        out = engine.chat(turn_2, documents=[DOCUMENT], max_new_tokens=40, ignore_eos=True, eta=1.0)
        return out.text, out.stats.drafter_joined_at, out.stats.drafted_tokens

    prompt_2 = engine.chat_prompts(turn_2, DecodeConfig(max_new_tokens=40), documents=[DOCUMENT]).target_ids
    remembered = engine.memory.lookup(prompt_2)
    assert remembered is not None and remembered.drafted  # turn 1's answer, with its drafts
    quiet = follow_up()
    for question in OTHERS:
        _local(engine, question, OTHER_DOCUMENT, eta=0.0, temperature=1.5, seed=3)
    assert follow_up() == quiet
