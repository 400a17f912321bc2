"""The engine's worker: at most ``max_queue`` jobs wait; 0 means a job is taken only when the engine is free."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from rapidspec.runtime.batching import current_batcher
from rapidspec.server.worker import HEAD_START_S, LONG_TURN_S, SMALL_JOB_TOKENS, Job, QueueFull, Worker


@pytest.mark.parametrize("max_queue", [0, 2])
def test_max_queue_counts_waiting_jobs_only(max_queue):
    async def scenario():
        worker = Worker(max_queue)
        release = threading.Event()

        def hold(emit, cancelled):
            release.wait(10)

        try:
            first = worker.submit(hold)  # the engine is free: taken at once, whatever the bound
            for _ in range(200):  # bounded: until the worker thread runs it
                if worker.running:
                    break
                await asyncio.sleep(0.01)
            assert worker.running == 1
            for _ in range(max_queue):
                worker.submit(hold)
            with pytest.raises(QueueFull):
                worker.submit(hold)
            assert worker.waiting == max_queue
        finally:
            release.set()
            worker.stop(10)
        return first

    assert asyncio.run(scenario()) is not None


def test_a_cancelled_waiting_job_frees_its_slot_at_once():
    async def scenario():
        worker = Worker(1)
        release = threading.Event()
        ran = []

        def hold(emit, cancelled):
            release.wait(10)

        try:
            worker.submit(hold)
            for _ in range(200):
                if worker.running:
                    break
                await asyncio.sleep(0.01)
            waiting = worker.submit(lambda emit, cancelled: ran.append("cancelled job"))
            with pytest.raises(QueueFull):
                worker.submit(hold)
            waiting.cancel()
            assert worker.waiting == 0  # at once, before the engine is free
            worker.submit(lambda emit, cancelled: ran.append("next job"))
        finally:
            release.set()
        for _ in range(200):
            if ran:
                break
            await asyncio.sleep(0.01)
        worker.stop(10)
        return ran

    assert asyncio.run(scenario()) == ["next job"]


def _run_jobs(max_num_seqs: int, works, max_queue: int = 8) -> list[str]:
    """Submit ``works`` at once on a fresh worker; the order in which they finish (bounded wait)."""
    finished: list[str] = []

    async def scenario():
        worker = Worker(max_queue, max_num_seqs)
        try:
            jobs = [(name, worker.submit(work)) for name, work in works]
            for name, job in jobs:
                while (await asyncio.wait_for(job.events.get(), 10))[0] != "end":
                    pass
                finished.append(name)
        finally:
            worker.stop(10)

    asyncio.run(scenario())
    return finished


def _steps_then(count: int, log: list[str], name: str):
    def work(emit, cancelled):
        for _ in range(count):
            yield
        log.append(name)

    return work


def test_running_jobs_take_turns_so_a_short_one_finishes_first():
    log: list[str] = []
    _run_jobs(2, [("long", _steps_then(50, log, "long")), ("short", _steps_then(2, log, "short"))])
    assert log == ["short", "long"]


def _beside_a_long_job(batched: bool, long_step_s: float, short_steps: int, short_step_s: float,
                       fed: tuple[int, int] = (0, 0), short_tokens: int | None = None) -> list[str]:
    """A long job ("L" a step of ``long_step_s``, 60 of them) runs alone for 0.5 s of steps; then a short one
    arrives ("S" a step of ``short_step_s``). ``fed``: tokens each job's steps report to the tick's batcher (as a
    batched forward of that many rows does). The log of their steps once both have ended; the long job ends at its
    first step after the short one's end (its later steps would only add "L"s after the last "S")."""
    log: list[str] = []
    ahead, short_ended = threading.Event(), threading.Event()

    def job(name: str, steps: int, seconds: float, tokens: int):
        def work(emit, cancelled):
            for step in range(steps):
                if name == "L" and short_ended.is_set():
                    return
                time.sleep(seconds)
                batcher = current_batcher()
                if batcher is not None:
                    thread = threading.get_ident()
                    batcher.tokens[thread] = batcher.tokens.get(thread, 0) + tokens
                log.append(name)
                if name == "L" and step * seconds >= 0.5:
                    ahead.set()
                yield
        return work

    async def scenario():
        worker = Worker(8, 2, batched=batched, max_pause_s=30.0)
        try:
            jobs = [worker.submit(job("L", 60, long_step_s, fed[0]))]
            await asyncio.to_thread(ahead.wait, 30)
            jobs.append(worker.submit(job("S", short_steps, short_step_s, fed[1]), short_tokens))
            for submitted in reversed(jobs):  # the short one first
                while (await asyncio.wait_for(submitted.events.get(), 30))[0] != "end":
                    pass
                short_ended.set()
        finally:
            worker.stop(10)

    asyncio.run(scenario())
    return log


def _long_steps_among_the_short(log: list[str]) -> int:
    first, last = log.index("S"), len(log) - 1 - log[::-1].index("S")
    return log[first : last + 1].count("L")


def test_a_job_of_cheap_steps_beside_one_of_dear_steps_takes_most_turns():
    """Turns in turn, the short job's 10 steps of 5 ms would come one per 100-ms step of the long one (9 long
    steps among them); by served time the long one waits once it is TURN_TOLERANCE_S ahead, after about 3."""
    log = _beside_a_long_job(False, long_step_s=0.1, short_steps=10, short_step_s=0.005)
    assert log.count("S") == 10 and _long_steps_among_the_short(log) <= 4, log


@pytest.mark.parametrize("batched", [False, True])
def test_a_small_job_runs_its_steps_before_the_long_ones_next(batched):
    """A job of SMALL_JOB_TOKENS tokens takes all its 10 steps before the long job's next one (the long one
    would step after max_pause_s, 30 s here); one token more and it shares the turns (the test above)."""
    log = _beside_a_long_job(batched, long_step_s=0.05, short_steps=10, short_step_s=0.02,
                             short_tokens=SMALL_JOB_TOKENS)
    assert log.count("S") == 10 and _long_steps_among_the_short(log) == 0, log


def test_a_batched_tick_is_shared_by_the_tokens_each_step_fed():
    """Batched, the short job (100 steps of 10 ms) shares ticks of 50 ms with the long one (short turns: no head
    start); the long job's steps feed 64 tokens, the short one's 1, so the long one is charged 65/67 of each
    shared tick, leads by TURN_TOLERANCE_S after about 5 and waits while the short one catches up alone (about
    25 steps), and so on: about 17 long steps among the short ones. Had the ticks been charged alike, the two
    would tick together all along (all the long one has left, about 50)."""
    log = _beside_a_long_job(True, long_step_s=0.05, short_steps=100, short_step_s=0.01, fed=(64, 1))
    assert log.count("S") == 100 and _long_steps_among_the_short(log) <= 30, log


def test_turns_go_to_the_least_served_and_to_jobs_that_waited_max_pause_s():
    worker = Worker(8, 4, max_pause_s=1.0)
    try:
        now = time.perf_counter()
        jobs = []
        for served, stepped in ((5.0, now), (4.9, now - 2.0), (1.0, now), (1.2, now)):
            job = Job(None, asyncio.new_event_loop())
            job.served, job.stepped = served, stepped
            jobs.append((job, iter(())))
        worker._running = list(jobs)
        # 1.2 is within 0.25 of the least (1.0); 4.9 has waited 2 s; 5.0 waits
        assert [job.served for job, _ in worker._due()] == [1.0, 1.2, 4.9]
        worker._running = [jobs[0], jobs[3]]
        for last_turn_s, head in ((LONG_TURN_S, HEAD_START_S), (LONG_TURN_S / 2, 0.0)):
            worker._last_turn_s = last_turn_s
            worker._queued.add(new := Job(None, asyncio.new_event_loop()))
            worker._start(new)
            assert new.served == 1.2 - head  # behind the least-served running job after a long turn, else level
            worker._running.remove(worker._running[-1])
    finally:
        worker._running = []
        worker.stop(10)


def test_a_small_job_goes_first_and_the_others_step_once_per_max_pause_s():
    worker = Worker(8, 4, max_pause_s=1.0)
    try:
        now = time.perf_counter()
        jobs = []
        for served, stepped, small in ((1.0, now, False), (4.9, now - 2.0, False), (3.0, now, True), (3.1, now, True),
                                       (3.5, now, True)):
            job = Job(None, asyncio.new_event_loop())
            job.served, job.stepped, job.small = served, stepped, small
            jobs.append((job, iter(())))
        worker._running = list(jobs)
        # the small ones within 0.25 s of the least-served small one (3.0, 3.1), and 4.9, which waited 2 s; the
        # least-served job (1.0) is not small and waits
        assert [job.served for job, _ in worker._due()] == [3.0, 3.1, 4.9]
        worker._running = jobs[:2]  # no small job: served time again
        assert [job.served for job, _ in worker._due()] == [1.0, 4.9]
    finally:
        worker._running = []
        worker.stop(10)


def test_run_marks_a_job_small_by_its_tokens():
    worker = Worker(8, 2)
    try:
        loop = asyncio.new_event_loop()
        for tokens, small in ((None, False), (SMALL_JOB_TOKENS, True), (SMALL_JOB_TOKENS + 1, False)):
            job = Job(None, loop)
            worker._queued.add(job)
            worker._waiting += 1
            worker.run(job, lambda emit, cancelled: None, tokens=tokens)
            assert job.small is small
    finally:
        worker.stop(10)


def test_one_sequence_at_a_time_keeps_arrival_order():
    log: list[str] = []
    _run_jobs(1, [("long", _steps_then(50, log, "long")), ("short", _steps_then(2, log, "short"))])
    assert log == ["long", "short"]


def test_slots_and_queue_bound_the_jobs_taken_together():
    async def scenario():
        worker = Worker(max_queue=1, max_num_seqs=2)
        release = threading.Event()

        def hold(emit, cancelled):
            while not release.is_set() and not cancelled.is_set():
                yield

        try:
            for _ in range(3):  # two run, one waits
                worker.submit(hold)
            for _ in range(200):
                if worker.running == 2:
                    break
                await asyncio.sleep(0.01)
            assert (worker.running, worker.waiting) == (2, 1)
            with pytest.raises(QueueFull):
                worker.submit(hold)
        finally:
            release.set()
            worker.stop(10)

    asyncio.run(scenario())


def test_every_step_runs_in_inference_mode_whatever_other_jobs_entered_and_left():
    modes: list[bool] = []

    def enters_and_leaves(steps: int):
        def work(emit, cancelled):
            with torch.inference_mode():  # like Rapid.decode: the mode is held across yields
                for _ in range(steps):
                    modes.append(torch.is_inference_mode_enabled())
                    yield
            for _ in range(3):
                modes.append(torch.is_inference_mode_enabled())
                yield

        return work

    _run_jobs(2, [("a", enters_and_leaves(1)), ("b", enters_and_leaves(5))])
    assert len(modes) == 12 and all(modes)


def test_a_failing_job_reports_its_error_and_the_others_go_on():
    log: list[str] = []

    def fails(emit, cancelled):
        yield
        raise RuntimeError("boom")

    events: list[str] = []

    async def scenario():
        worker = Worker(4, 2)
        try:
            bad = worker.submit(fails)
            good = worker.submit(_steps_then(5, log, "good"))
            while (event := await asyncio.wait_for(bad.events.get(), 10))[0] != "end":
                events.append(event[0])
            while (await asyncio.wait_for(good.events.get(), 10))[0] != "end":
                pass
        finally:
            worker.stop(10)

    asyncio.run(scenario())
    assert events == ["error"] and log == ["good"]


def test_a_job_prepared_after_the_worker_stopped_ends_at_once():
    """A request still being prepared when the server shuts down gets its end (a 503), not a wait for ever."""
    import asyncio

    async def scenario():
        worker = Worker(max_queue=2, max_num_seqs=1)
        job = worker.admit()
        await asyncio.to_thread(worker.stop)
        worker.run(job, lambda emit, cancelled: pytest.fail("ran after the stop"))
        return await asyncio.wait_for(job.events.get(), 5), worker.waiting

    event, waiting = asyncio.run(scenario())
    assert event == ("end", None) and waiting == 0
