"""One engine, one generation at a time: a bounded FIFO queue and the thread that runs it.

The event loop never touches the engine. A route submits a :class:`Job` (a
function that uses the engine and reports through ``emit``); the worker
thread runs jobs in arrival order and passes their events back to the loop
through an ``asyncio.Queue``. A full queue refuses new jobs at once
(:class:`QueueFull`, the server's 429). Cancelling a job that waits removes
it; cancelling a running one is seen by the job between two rounds.

Events a job receives, in order: its own (``"ready"``, ``"chunk"``, ...),
then ``("error", exception)`` if it raised, then always ``("end", None)``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable

from rapidspec.errors import RapidspecError

logger = logging.getLogger(__name__)

Emit = Callable[[str, object], None]
Work = Callable[[Emit, threading.Event], None]


class QueueFull(Exception):
    """The waiting queue is at its bound."""


class Job:
    """A piece of engine work and the channel its events come back on."""

    def __init__(self, work: Work, loop: asyncio.AbstractEventLoop) -> None:
        self.work = work
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.checked = time.monotonic()  # when the server last asked whether the client is still there
        self._loop = loop
        self._on_cancel: Callable[[Job], None] | None = None  # set by the worker that queued it

    def emit(self, kind: str, payload: object = None) -> None:
        """Post an event to the loop (callable from any thread; dropped once the loop is closed)."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:
            pass

    def cancel(self) -> None:
        """Stop the job: a waiting one leaves the queue at once (its slot is free), a running one after its round."""
        self.cancelled.set()
        if self._on_cancel is not None:
            self._on_cancel(self)


class Worker:
    """Runs jobs one at a time on a thread of its own; at most ``max_queue`` wait."""

    def __init__(self, max_queue: int) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.max_queue = max_queue
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._waiting = 0
        self._queued: set[Job] = set()  # submitted, not yet taken by the thread nor cancelled
        self._running = 0
        self._lock = threading.Lock()
        self._current: Job | None = None
        self._thread = threading.Thread(target=self._loop, name="rapidspec-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return self._running

    def submit(self, work: Work) -> Job:
        """Queue ``work``; raises :class:`QueueFull` when ``max_queue`` jobs already wait.

        A job that finds the engine free never waits, so ``max_queue = 0``
        means no waiting line: a request is taken only when the engine is free.
        """
        job = Job(work, asyncio.get_running_loop())
        with self._lock:
            if self._waiting + self._running > self.max_queue:
                raise QueueFull(f"{self._waiting} requests are waiting (the bound is {self.max_queue})")
            self._waiting += 1
            self._queued.add(job)
        job._on_cancel = self._leave_queue
        self._jobs.put(job)
        return job

    def _leave_queue(self, job: Job) -> None:
        """A job cancelled while it waits gives its slot back at once."""
        with self._lock:
            if job in self._queued:
                self._queued.discard(job)
                self._waiting -= 1

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what waits and what runs, and end the thread (after the running job's current round)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._finish_unstarted(job)
        current = self._current
        if current is not None:
            current.cancel()
        self._jobs.put(None)
        self._thread.join(timeout)

    def _finish_unstarted(self, job: Job) -> None:
        job.cancel()  # frees its slot
        job.emit("end")

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                if job not in self._queued:  # cancelled while it waited: its slot is already free
                    job.emit("end")
                    continue
                self._queued.discard(job)
                self._waiting -= 1
                self._running = 1
                self._current = job
            job.started = time.perf_counter()
            try:
                job.work(job.emit, job.cancelled)
            except Exception as err:  # reported to the client; the worker goes on
                if not isinstance(err, RapidspecError):
                    logger.exception("generation failed")
                job.emit("error", err)
            finally:
                with self._lock:
                    self._running = 0
                    self._current = None
                job.emit("end")
