"""The engine's worker: at most ``max_queue`` jobs wait; 0 means a job is taken only when the engine is free."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from rapidspec.server.worker import QueueFull, Worker


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


def _beside_a_long_job(batched: bool, max_pause_s: float, short_steps: int) -> list[str]:
    """A long job (steps of 20 ms, "L" each) runs alone for 1 s of steps; then a short one arrives ("S" a step,
    20 ms each); the log of their steps once both have ended."""
    log: list[str] = []
    ahead = threading.Event()

    def long(emit, cancelled):
        for step in range(120):
            time.sleep(0.02)
            log.append("L")
            if step == 50:
                ahead.set()
            yield

    def short(emit, cancelled):
        for _ in range(short_steps):
            time.sleep(0.02)
            log.append("S")
            yield

    async def scenario():
        worker = Worker(8, 2, batched=batched, max_pause_s=max_pause_s)
        try:
            jobs = [worker.submit(long)]
            await asyncio.to_thread(ahead.wait, 30)
            jobs.append(worker.submit(short))
            for job in jobs:
                while (await asyncio.wait_for(job.events.get(), 30))[0] != "end":
                    pass
        finally:
            worker.stop(10)

    asyncio.run(scenario())
    return log


@pytest.mark.parametrize("batched", [False, True])
def test_a_job_that_arrives_beside_a_long_one_takes_its_steps_first(batched):
    """The long job is a second ahead in served time: the short one's 10 steps (0.2 s) all come before the long
    one's next step (it would wait up to 30 s)."""
    log = _beside_a_long_job(batched, max_pause_s=30.0, short_steps=10)
    first, last = log.index("S"), len(log) - 1 - log[::-1].index("S")
    assert log[first : last + 1] == ["S"] * 10 and log.count("L") == 120


def test_a_job_ahead_waits_at_most_max_pause_s():
    """With a 0.1 s bound the long job steps between the short one's 30 steps (0.6 s, all of them more than
    TURN_TOLERANCE_S behind it in served time); with the 30 s bound above it would not."""
    log = _beside_a_long_job(False, max_pause_s=0.1, short_steps=30)
    first, last = log.index("S"), len(log) - 1 - log[::-1].index("S")
    assert "L" in log[first : last + 1] and log.count("S") == 30


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
