"""One engine, several generations taking turns: a bounded FIFO queue and the thread that runs it.

The event loop never touches the engine. A route submits a :class:`Job` (a
function that uses the engine and reports through ``emit``); the worker
thread admits jobs in arrival order, up to ``max_num_seqs`` at once, and
passes their events back to the loop through an ``asyncio.Queue``. A job is a
generator function: each ``next()`` is one step (a prefill chunk or a decode
round), and the worker advances its running jobs a step each in turn, so a
short answer is not held behind a long one (a plain function is one step).
The turns go to the jobs that have had the least of the thread's time
(:attr:`Job.served`: the seconds of their steps; a batched tick's seconds
shared in proportion to the tokens each step fed its forwards, plus one):
a job more than :data:`TURN_TOLERANCE_S` ahead of the least-served one
waits, for at most ``max_pause_s`` at a time. Where the last turn was long
(:data:`LONG_TURN_S`: a long prefill's piece, a long answer's wide rounds) a
new job starts :data:`HEAD_START_S` behind the least-served running one, so
its first half second of steps comes before the others' next; where turns
are short (alike decode steps in a batch) it starts level with it and joins
the batch. From then on dear steps wait for cheap ones.
A *small* job (its prompt and its longest answer together at most
:data:`SMALL_JOB_TOKENS` tokens, as :meth:`Worker.run` is told) goes first:
while one runs, only small jobs take turns, and the others a step each
``max_pause_s``. Shared turns gave a chat request of 8 tokens beside a
256-token answer 1.4-1.7 s where alone it took 0.41 s (its rounds came
between the other's, or in batched ticks as wide as the other's rounds);
first, it takes about its own time, and the other waits that long.
A full queue refuses new jobs at once (:class:`QueueFull`, the server's 429).
A request takes its place with :meth:`Worker.admit` before its prompts are
built (off this thread) and hands its work over with :meth:`Worker.run`, so
requests being prepared count against the same bound. Cancelling a job that
waits removes it and drops its work (and what the work holds) at once; a
running one sees it between two steps.

Events a job receives, in order: its own (``"ready"``, ``"chunk"``, ...),
then ``("error", exception)`` if it raised, then always ``("end", None)``.

The thread runs every step inside ``torch.inference_mode()``: generators
that enter and leave the mode themselves would otherwise restore it out of
order when their steps interleave.

``batched``: with more than one job running, a tick advances every running
job by one step at once, each on a thread of a pool, and their forwards on
the lean runtime run as one batched forward per model
(:mod:`rapidspec.runtime.batching`): the weights are read once for all
requests instead of once per request. The batched forwards run on this
worker's thread, the only one with torch's threads; the pool's threads
compute alone (:mod:`rapidspec.runtime.threads`).

After a job ends the thread gives the C heap's free memory back to the
system, at most every 10 s (:mod:`rapidspec.runtime.heap`): a day of requests
of every size would otherwise raise the resident set with nothing leaked.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from rapidspec.errors import RapidspecError
from rapidspec.runtime.batching import ForwardBatcher, batching
from rapidspec.runtime.heap import HeapTrimmer
from rapidspec.runtime.threads import computing_thread, helper_thread

logger = logging.getLogger(__name__)

Emit = Callable[[str, object], None]
Work = Callable[[Emit, threading.Event], Iterator[None] | None]
#: Batched forwards whose row counts are kept (``Worker.batch_rows``).
BATCH_HISTORY = 256
#: Running jobs whose served seconds are within this of the least-served job's take their turns together.
TURN_TOLERANCE_S = 0.25
#: A job ahead of the others in served time waits at most this long before its next step (``Worker.max_pause_s``).
MAX_PAUSE_S = 1.0
#: A new job starts this far behind the least-served running one where the worker's last turn (a step, or a
#: batched tick) took :data:`LONG_TURN_S` or more: about half a second of steps to itself.
HEAD_START_S = 0.75
#: A turn at least this long (a long prefill's piece, wide rounds) gives a new job its head start; shorter ones
#: (alike decode steps in a batch) do not, so a new job does not hold up a batch that moves quickly anyway.
LONG_TURN_S = 0.25
#: A job whose prompt and longest answer hold at most this many tokens goes first (module docstring): on 2 cores
#: at most about a second of steps, so the others wait at most ``max_pause_s`` once.
SMALL_JOB_TOKENS = 128


class QueueFull(Exception):
    """The waiting queue is at its bound."""


class Job:
    """A piece of engine work and the channel its events come back on."""

    def __init__(self, work: Work | None, loop: asyncio.AbstractEventLoop) -> None:
        self.work = work  # None until the request's prompts are ready (Worker.run)
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.served = 0.0  # seconds of the worker's time this job's steps took (Worker's docstring)
        self.small = False  # whether it goes first (SMALL_JOB_TOKENS; set by Worker.run)
        self.stepped = 0.0  # perf_counter when its last step ended (when it started, before the first)
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
        """Stop the job: a waiting one leaves the queue at once (its slot is free), a running one after its step."""
        self.cancelled.set()
        if self._on_cancel is not None:
            self._on_cancel(self)


class Worker:
    """Runs up to ``max_num_seqs`` jobs at once, a step each per turn (``batched``: all at once, forwards batched),
    from a thread of its own; ``max_queue`` may wait."""

    def __init__(self, max_queue: int, max_num_seqs: int = 1, batched: bool = False,
                 max_pause_s: float = MAX_PAUSE_S) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if not max_pause_s >= 0:
            raise ValueError("max_pause_s must be >= 0")
        self.max_queue = max_queue
        self.max_num_seqs = max_num_seqs
        self.max_pause_s = max_pause_s
        self.batched = batched and max_num_seqs > 1
        self._pool = ThreadPoolExecutor(max_num_seqs, thread_name_prefix="rapidspec-step",
                                        initializer=helper_thread) if self.batched else None
        self.batch_rows: list[int] = []  # rows of each batched forward (recent ticks; /health, tests)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._waiting = 0
        self._queued: set[Job] = set()  # submitted, not yet taken by the thread nor cancelled
        self._running: list[tuple[Job, Iterator[None]]] = []
        self._last_turn_s = 0.0  # seconds of the last step or batched tick
        self._stopped = False
        self.heap = HeapTrimmer()  # freed memory back to the system as requests end (rapidspec.runtime.heap)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="rapidspec-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return len(self._running)

    def crowded(self) -> bool:
        """Whether more than one request runs or waits (a long step would hold the others up)."""
        return self._waiting + len(self._running) > 1

    def submit(self, work: Work, tokens: int | None = None) -> Job:
        """Queue ``work`` (:meth:`admit` then :meth:`run`)."""
        job = self.admit()
        self.run(job, work, tokens)
        return job

    def admit(self) -> Job:
        """A place in the line for a job whose work comes later; raises :class:`QueueFull` when
        ``max_queue`` jobs already wait.

        A job that finds a free slot never waits, so ``max_queue = 0`` means no
        waiting line: a request is taken only when one of the ``max_num_seqs`` slots is free.
        """
        job = Job(None, asyncio.get_running_loop())
        with self._lock:
            if self._waiting + len(self._running) >= self.max_queue + self.max_num_seqs:
                raise QueueFull(f"{self._waiting} requests are waiting (the bound is {self.max_queue})")
            self._waiting += 1
            self._queued.add(job)
        job._on_cancel = self._leave_queue
        return job

    def run(self, job: Job, work: Work, tokens: int | None = None) -> None:
        """Hand an admitted job its work: it runs once a slot is free (nothing happens if it was cancelled).
        ``tokens``: its prompt's and longest answer's tokens, where known (a small job goes first)."""
        with self._lock:
            if job not in self._queued:
                return
            if self._stopped:  # prepared while the server shut down: it will not run
                self._queued.discard(job)
                self._waiting -= 1
                job.emit("end")
                return
            job.work = work
            job.small = tokens is not None and tokens <= SMALL_JOB_TOKENS
            job.submitted = time.perf_counter()  # the queue's wait starts now (metrics)
        self._jobs.put(job)

    def _leave_queue(self, job: Job) -> None:
        """A job cancelled while it waits gives its slot back and drops its work at once."""
        with self._lock:
            if job in self._queued:
                self._queued.discard(job)
                self._waiting -= 1
                job.work = None  # what the work holds (messages, prompts) is freed now, not when the thread gets to it

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what waits and what runs, and end the thread (after the running jobs' current steps)."""
        with self._lock:
            self._stopped = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()  # frees its slot
                job.emit("end")
        with self._lock:
            running = [job for job, _ in self._running]
        for job in running:
            job.cancel()
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _loop(self) -> None:
        computing_thread()  # the process's one thread with torch's threads (rapidspec.runtime.threads)
        with torch.inference_mode():
            stopping = False
            while not (stopping and not self._running):
                while not stopping and len(self._running) < self.max_num_seqs:
                    try:
                        job = self._jobs.get(block=not self._running)
                    except queue.Empty:
                        break
                    if job is None:
                        stopping = True
                    else:
                        self._start(job)
                due = self._due()
                if self._pool is not None and len(due) > 1:
                    self._tick(due)
                    continue
                for job, steps in due:
                    self._step(job, steps)

    def _due(self) -> list[tuple[Job, Iterator[None]]]:
        """The running jobs whose turn it is, least served first: the small ones while any runs, else those within
        :data:`TURN_TOLERANCE_S` of the least-served job; and those that have waited ``max_pause_s`` since their
        last step."""
        running = sorted(self._running, key=lambda entry: entry[0].served)
        if not running:
            return running
        now, small_first = time.perf_counter(), any(job.small for job, _ in running)
        least = next(job.served for job, _ in running if job.small or not small_first)  # of those contending
        return [(job, steps) for job, steps in running
                if (job.small or not small_first) and job.served <= least + TURN_TOLERANCE_S
                or now - job.stepped >= self.max_pause_s]

    def _tick(self, running: list[tuple[Job, Iterator[None]]]) -> None:
        """One step of each of ``running`` at once, on the pool's threads, their lean forwards batched."""
        started = time.perf_counter()
        batcher = ForwardBatcher(len(running), served=True)

        def step(steps: Iterator[None]) -> tuple[BaseException | None, int]:
            """The step's outcome and the tokens it fed the batched forwards (a pool thread may run two steps)."""
            thread = threading.get_ident()
            before = batcher.tokens.get(thread, 0)
            with torch.inference_mode(), batching(batcher):
                outcome = _advance(steps)
            return outcome, batcher.tokens.get(thread, 0) - before

        futures = [self._pool.submit(step, steps) for _, steps in running]
        for future in futures:
            future.add_done_callback(lambda _: batcher.wake())
        batcher.serve(lambda: all(future.done() for future in futures))  # the batches run on this thread
        results = [future.result() for future in futures]
        self.batch_rows = (self.batch_rows + batcher.batches)[-BATCH_HISTORY:]
        ended = time.perf_counter()
        self._last_turn_s = ended - started
        per_weight = self._last_turn_s / sum(fed + 1 for _, fed in results)  # seconds per token fed (plus one a step)
        for (job, steps), (outcome, fed) in zip(running, results):
            job.served += (fed + 1) * per_weight
            job.stepped = ended
            self._settle(job, steps, outcome)

    def _start(self, job: Job) -> None:
        with self._lock:
            if job not in self._queued:  # cancelled while it waited: its slot is already free
                job.emit("end")
                return
            self._queued.discard(job)
            self._waiting -= 1
            # behind the least-served running job where turns are long: its first steps (its prefill, its first
            # tokens) come before the others' next; level with it where turns are short
            head = HEAD_START_S if self._last_turn_s >= LONG_TURN_S else 0.0
            job.served = min((other.served for other, _ in self._running), default=head) - head
            self._running.append((job, _steps(job)))
        job.started = job.stepped = time.perf_counter()

    def _step(self, job: Job, steps: Iterator[None]) -> None:
        started = time.perf_counter()
        outcome = _advance(steps)
        job.stepped = time.perf_counter()
        self._last_turn_s = job.stepped - started
        job.served += self._last_turn_s
        self._settle(job, steps, outcome)

    def _settle(self, job: Job, steps: Iterator[None], outcome: BaseException | None) -> None:
        """After a step: nothing (it goes on), or the job's end (done, or failed and reported) and its slot freed.
        Anything but an Exception (KeyboardInterrupt, SystemExit) is raised again here."""
        if outcome is None:
            return
        if isinstance(outcome, StopIteration):
            job.emit("end")
        elif isinstance(outcome, Exception):  # reported to the client; the worker goes on
            self._fail(job, outcome)
        else:
            raise outcome
        with self._lock:
            self._running.remove((job, steps))
        self.heap.maybe_trim()

    @staticmethod
    def _fail(job: Job, err: Exception) -> None:
        if not isinstance(err, RapidspecError):
            logger.exception("generation failed", exc_info=err)
        job.emit("error", err)
        job.emit("end")


def _advance(steps: Iterator[None]) -> BaseException | None:
    """One step; what ended it (StopIteration when the job is done, or what it raised), None when it goes on."""
    try:
        next(steps)
    except BaseException as err:  # settled on the worker thread (Worker._settle)
        return err
    return None


def _steps(job: Job) -> Iterator[None]:
    """The job's work as steps (a plain function is one)."""
    steps = job.work(job.emit, job.cancelled)
    if steps is not None:
        yield from steps
