"""Batched forwards across requests (rapidspec.runtime.batching) and the server's batched steps.

Rows of one batched forward equal lone forwards; requests served together
answer exactly what each gets alone (greedy, float32) for every drafter kind
that runs on the lean runtime, and the same within float rounding for the
others (their target forwards are batched, their drafters step on their own).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rapidspec import Rapid
from rapidspec.retrieval import RetrievalConfig
from rapidspec.runtime.batching import ForwardBatcher, batching, current_batcher
from rapidspec.runtime.lean import LeanModel, Row
from rapidspec.runtime.lean_cache import LeanKVCache
from rapidspec.server.worker import Worker
from tests.server_harness import HTTP, running_server
from tests.specs import spec_of

RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=200)
DOCUMENT = " ".join(f"Fact {i}: the archive of room {i} opens at {i % 12 + 1} o'clock." for i in range(60))
QUESTIONS = ["When does room 7 open?", "What is in room 12?", "Which room opens at 3?", "Name a room."]


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():  # as the engine and the worker run (the lean model's tables are made in it)
        yield


@pytest.fixture(scope="module")
def lean_target(tiny_model):
    return dataclasses.replace(tiny_model, lean=LeanModel(tiny_model.model))


@pytest.fixture(scope="module")
def lean_drafter(other_tiny_model):
    return dataclasses.replace(other_tiny_model, lean=LeanModel(other_tiny_model.model))


def test_rows_of_one_forward_equal_lone_forwards(lean_target):
    lean = lean_target.lean
    prompts = [torch.randint(0, 250, (n,)) for n in (5, 17, 1)]
    lone, batched = [LeanKVCache(lean) for _ in prompts], [LeanKVCache(lean) for _ in prompts]
    for cache, batch_cache, prompt in zip(lone, batched, prompts):  # different pasts: 9, 3 and 20 tokens
        past = torch.randint(0, 250, (int(prompt.sum()) % 20 + 1,)).tolist()
        cache.prefill(past)
        batch_cache.prefill(past)
    expected = [cache.forward(p.tolist(), num_logits=min(3, len(p))) for cache, p in zip(lone, prompts)]
    rows = []
    for cache, prompt in zip(batched, prompts):
        cache.reserve(cache.length + len(prompt))
        rows.append(Row(prompt, cache._keys, cache._values, cache.length, min(3, len(prompt))))
    got = lean.forward_rows(rows)
    for want, have, row in zip(expected, got, rows):
        assert have.shape == (row.num_logits, want.shape[-1])
        torch.testing.assert_close(have.float(), want, atol=1e-5, rtol=1e-5)
    for cache, batch_cache, prompt in zip(lone, batched, prompts):
        end = cache.length
        torch.testing.assert_close(batch_cache._keys[:, :, :end], cache._keys[:, :, :end], atol=1e-6, rtol=1e-6)


def _threads_forwarding(batcher: ForwardBatcher, lean: LeanModel, prompts: list[list[int]], leave_early: int = 0):
    caches = [LeanKVCache(lean) for _ in prompts]

    def run(index: int):
        with batching(batcher):
            if index < leave_early:
                return None  # a step that ends without a forward
            assert current_batcher() is batcher
            return caches[index].forward(prompts[index])

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(run, range(len(prompts)))), caches


def test_the_batcher_runs_one_forward_for_the_tick(lean_target, lean_drafter):
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5], [1], [2, 2]]
    batcher = ForwardBatcher(len(prompts))
    outputs, caches = _threads_forwarding(batcher, lean_target.lean, prompts)
    assert batcher.batches == [4] and current_batcher() is None
    assert sorted(batcher.tokens.values()) == sorted(map(len, prompts))  # what each step's thread fed (the worker's
    # scheduling charges a tick's seconds by it)
    for prompt, logits, cache in zip(prompts, outputs, caches):
        torch.testing.assert_close(logits, LeanKVCache(lean_target.lean).forward(prompt), atol=1e-5, rtol=1e-5)
        assert cache.token_ids == prompt
    # a step that ends without a forward no longer holds the others back
    batcher = ForwardBatcher(3)
    outputs, _ = _threads_forwarding(batcher, lean_target.lean, prompts[:3], leave_early=1)
    assert outputs[0] is None and batcher.batches == [2]


def test_rows_of_two_models_run_as_two_forwards(lean_target, lean_drafter):
    batcher = ForwardBatcher(2)
    caches = [LeanKVCache(lean_target.lean), LeanKVCache(lean_drafter.lean)]

    def run(index: int):
        with batching(batcher):
            return caches[index].forward([5, 6, 7])

    with ThreadPoolExecutor(2) as pool:
        target_logits, drafter_logits = pool.map(run, range(2))
    assert batcher.batches == [2]  # one tick, its two rows grouped by model
    torch.testing.assert_close(drafter_logits, LeanKVCache(lean_drafter.lean).forward([5, 6, 7]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(target_logits, LeanKVCache(lean_target.lean).forward([5, 6, 7]), atol=1e-5, rtol=1e-5)


def test_a_straggler_does_not_block_the_tick(lean_target):
    """A participant that never forwards nor leaves (blocked elsewhere) is waited for only timeout_s."""
    batcher = ForwardBatcher(2, timeout_s=0.2)
    started = time.perf_counter()
    logits = LeanKVCache(lean_target.lean)
    with batching(batcher):
        out = logits.forward([1, 2, 3])
        batcher.active -= 1  # the other participant is done (with batching() it leaves by itself)
    assert out.shape[-1] > 0 and batcher.batches == [1] and time.perf_counter() - started < 5


def test_a_served_tick_runs_its_batches_on_the_serving_thread(lean_target, monkeypatch):
    """serve(): the steps' threads only queue their forwards; the batch runs on the thread with torch's threads."""
    lean = lean_target.lean
    ran_on: list[str] = []
    forward_rows = LeanModel.forward_rows

    def recording(self, rows):
        ran_on.append(threading.current_thread().name)
        return forward_rows(self, rows)

    monkeypatch.setattr(LeanModel, "forward_rows", recording)
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5], [1]]
    batcher = ForwardBatcher(len(prompts), served=True)

    def run(prompt):
        with torch.inference_mode(), batching(batcher):
            return LeanKVCache(lean).forward(prompt)

    with ThreadPoolExecutor(len(prompts), thread_name_prefix="step") as pool:
        futures = [pool.submit(run, p) for p in prompts]
        for future in futures:
            future.add_done_callback(lambda _: batcher.wake())
        batcher.serve(lambda: all(f.done() for f in futures))
        outputs = [f.result() for f in futures]
    assert batcher.batches == [3] and ran_on == [threading.current_thread().name]
    monkeypatch.undo()
    for prompt, logits in zip(prompts, outputs):
        torch.testing.assert_close(logits, LeanKVCache(lean).forward(prompt), atol=1e-5, rtol=1e-5)


def test_calls_run_on_the_serving_thread_and_their_errors_come_back():
    """call(): a step hands the serving thread work too large for its lone thread (a llama.cpp prefill)."""
    assert ForwardBatcher(1).call(lambda: threading.current_thread().name) == threading.current_thread().name
    batcher = ForwardBatcher(2, served=True)

    def step(fail: bool):
        with batching(batcher):
            if fail:
                return batcher.call(lambda: 1 / 0)
            return batcher.call(lambda: threading.current_thread().name)

    with ThreadPoolExecutor(2, thread_name_prefix="step") as pool:
        futures = [pool.submit(step, fail) for fail in (False, True)]
        for future in futures:
            future.add_done_callback(lambda _: batcher.wake())
        batcher.serve(lambda: all(f.done() for f in futures))
    assert futures[0].result() == threading.current_thread().name
    with pytest.raises(ZeroDivisionError):
        futures[1].result()


def test_the_worker_batches_ticks_only_when_asked_and_with_several_jobs():
    assert Worker(0, 4, batched=True).batched and not Worker(0, 1, batched=True).batched
    assert not Worker(0, 4).batched


def _answers(url: str, questions: list[str], mode: str, concurrently: bool) -> list[str]:
    def ask(question: str) -> str:
        body = {"messages": [{"role": "user", "content": question}], "documents": [DOCUMENT], "max_tokens": 24,
                "mode": mode, "temperature": 0, "ignore_eos": True}
        response = HTTP.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    if not concurrently:
        return [ask(q) for q in questions]
    with ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(ask, questions))


@pytest.mark.parametrize("drafter_kind", ["self", "other model", "lookup", "lc"])
def test_requests_served_together_answer_as_alone(lean_target, lean_drafter, drafter_kind):
    """Four requests at once, steps batched, equal the same requests one at a time (greedy, float32)."""
    drafter = lean_drafter if drafter_kind == "other model" else None
    mode = {"lookup": "lookup", "lc": "lc"}.get(drafter_kind, "rapid")
    # nothing on disk: the requests served together would read what those served alone wrote, prefill sooner and
    # so let the drafter join at another round (the join follows the prefill's time)
    engine = Rapid(spec_of(retrieval=RETRIEVAL, drafter_backend="torch", kv_cache_gib=0),
                   target=lean_target, drafter=drafter)
    with running_server(engine, max_num_seqs=1, batch_steps=False) as url:
        alone = _answers(url, QUESTIONS, mode, concurrently=False)
    apps: list = []
    with running_server(engine, apps, max_num_seqs=4, batch_steps=True) as url:
        together = _answers(url, QUESTIONS, mode, concurrently=True)
        health = HTTP.get(f"{url}/health", timeout=10).json()
    assert together == alone
    assert health["batch_steps"] is True
    assert max(apps[0].state.server.worker.batch_rows or [1]) > 1  # some forwards did run several rows


def test_requests_served_together_answer_as_alone_with_a_llama_cpp_drafter(lean_target, tmp_path):
    """The llama.cpp drafter steps on each request's thread (one llama.cpp thread inside a tick); the answers
    equal those served one at a time (greedy)."""
    from rapidspec.runtime.llama_cpp import llama_cpp_available
    from tests.tiny_gguf import write_tiny_gguf

    if not llama_cpp_available():
        pytest.skip("llama-cpp-python is not installed")
    gguf = str(write_tiny_gguf(lean_target, tmp_path / "self.gguf"))
    engine = Rapid(spec_of(retrieval=RETRIEVAL, drafter_backend="llama.cpp", kv_cache_gib=0),
                   target=lean_target, drafter=gguf)  # as above
    with running_server(engine, max_num_seqs=1, batch_steps=False) as url:
        alone = _answers(url, QUESTIONS, "rapid", concurrently=False)
    apps: list = []
    with running_server(engine, apps, max_num_seqs=4, batch_steps=True) as url:
        together = _answers(url, QUESTIONS, "rapid", concurrently=True)
    assert together == alone
    assert max(apps[0].state.server.worker.batch_rows or [1]) > 1


def test_llama_cpp_contexts_decode_at_once_only_where_cores_allow():
    """Spinning llama.cpp threads must not share cores: contexts beyond the cores take turns."""
    import os

    from rapidspec.runtime.llama_cpp import decode_gate

    cores = os.cpu_count() or 1
    gate = decode_gate(cores)
    assert decode_gate(cores) is gate
    assert gate.acquire(blocking=False) and not gate.acquire(blocking=False)  # one context of all the cores at a time
    gate.release()
    wide = decode_gate(1)
    taken = [wide.acquire(blocking=False) for _ in range(cores)]
    assert all(taken) and not wide.acquire(blocking=False)  # one per core for single-threaded contexts
    for _ in taken:
        wide.release()
