"""The engine's worker: at most ``max_queue`` jobs wait; 0 means a job is taken only when the engine is free."""

from __future__ import annotations

import asyncio
import threading

import pytest

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
