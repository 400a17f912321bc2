"""One computing thread per process (rapidspec.runtime.threads): helpers get no OpenMP team, the engine thread does."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from rapidspec.runtime.threads import compute_threads, computing_thread, helper_thread
from rapidspec.server.worker import Worker

TASKS = Path(f"/proc/{os.getpid()}/task")


def _on_new_thread(setup, probe):
    """Run ``setup`` then ``probe`` on a fresh thread while it is alive; the probe's result."""
    result: list = []
    ready, done = threading.Event(), threading.Event()

    def body():
        if setup is not None:
            setup()
        result.append(probe())
        ready.set()
        done.wait(10)

    thread = threading.Thread(target=body)
    thread.start()
    try:
        assert ready.wait(30)
        return result[0]
    finally:
        done.set()
        thread.join(10)


def _parallel_work() -> None:
    a = torch.randn(512, 512)
    for _ in range(5):
        a = torch.tanh(a @ a)  # a parallel region on any CPU count > 1


def test_a_helper_thread_computes_alone_and_leaves_the_computing_thread_its_threads():
    wanted = compute_threads()
    assert _on_new_thread(helper_thread, torch.get_num_threads) == 1

    def computing_then_helper():
        computing_thread()
        _on_new_thread(helper_thread, _parallel_work)  # a helper started later changes nothing here
        _parallel_work()
        return torch.get_num_threads()

    assert _on_new_thread(None, computing_then_helper) == wanted


def helper_starts_no_openmp_threads() -> None:
    tasks = Path(f"/proc/{os.getpid()}/task")

    def threads_started_by_work():  # the threads that are new after the work (others may end meanwhile)
        before = {task.name for task in tasks.iterdir()}
        _parallel_work()
        return len({task.name for task in tasks.iterdir()} - before)

    assert _on_new_thread(helper_thread, threads_started_by_work) == 0
    # the same work on a thread that is not a helper starts a team of torch's threads (the test's control)
    assert _on_new_thread(None, threads_started_by_work) > 0


@pytest.mark.skipif(not TASKS.is_dir(), reason="needs /proc")
def test_a_helper_thread_starts_no_openmp_threads():
    if compute_threads() >= 2:
        helper_starts_no_openmp_threads()
        return
    # a process computing on one thread (a pytest-xdist worker) checks it in a process of 2 torch threads
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    script = "from tests.test_threads import helper_starts_no_openmp_threads as check; check()"
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_worker_thread_computes_with_torch_threads():
    async def scenario():
        worker = Worker(2)
        seen: list[int] = []
        try:
            job = worker.submit(lambda emit, cancelled: seen.append(torch.get_num_threads()))
            while (await asyncio.wait_for(job.events.get(), 10))[0] != "end":
                pass
        finally:
            worker.stop(10)
        return seen

    assert asyncio.run(scenario()) == [compute_threads()]


def test_the_server_prepares_requests_on_helper_threads(tiny_model):
    """Requests are sized and retrieved (the embedder runs torch) on threads without an OpenMP team; those with
    large texts, on Linux, at a lower priority than the engine's thread, which keeps the process's."""
    from rapidspec import Rapid
    from rapidspec.runtime.threads import BACKGROUND_NICENESS
    from rapidspec.server import ServerConfig, create_app

    app = create_app(Rapid(target=tiny_model), ServerConfig(model_name="tiny"))
    state = app.state.server
    niceness = lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # noqa: E731
    try:
        for pool in (state.preparer, state.background_preparer):
            assert pool.submit(torch.get_num_threads).result(10) == 1
        if sys.platform == "linux":
            assert state.preparer.submit(niceness).result(10) == niceness()
            assert state.background_preparer.submit(niceness).result(10) == min(19, niceness() + BACKGROUND_NICENESS)
            assert niceness() == os.getpriority(os.PRIO_PROCESS, 0)  # the test's own thread is untouched
    finally:
        state.worker.stop(10)
        state.preparer.shutdown()
        state.background_preparer.shutdown()


def test_a_request_with_large_texts_is_prepared_on_the_lower_priority_threads(tiny_model):
    """A request whose texts hold BACKGROUND_PREPARE_CHARACTERS or more is prepared on the background pool, a
    small one on the other: a small request's own preparation never waits behind the engine's steps."""
    from rapidspec import Rapid
    from rapidspec.server.serving import BACKGROUND_PREPARE_CHARACTERS
    from tests.server_harness import HTTP, running_server

    threads: list[str] = []
    apps: list = []
    with running_server(Rapid(target=tiny_model), apps=apps) as url:
        state = apps[0].state.server
        for pool in (state.preparer, state.background_preparer):
            submit = pool.submit
            pool.submit = lambda fn, *a, _submit=submit: _submit(lambda: (threads.append(
                threading.current_thread().name), fn(*a))[1])
        for document, status in (("a short note", 200), ("x " * (BACKGROUND_PREPARE_CHARACTERS // 2), 400)):
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi?"}], "documents": [document],
                    "max_tokens": 1, "mode": "lc", "truncate": "middle"}  # the large one: sized there, too long
            assert HTTP.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == status
    assert [name.rsplit("_", 1)[0] for name in threads] == ["rapidspec-prepare", "rapidspec-prepare-large"]
