"""Batched forwards across generations running on threads of their own: one lean forward per model per step.

The server's worker runs the steps of its running requests (a decode round,
a prefill chunk) on threads, one step per request per tick. Each step does
what it does alone (drafting, acceptance, bookkeeping) except that its
forwards on :class:`~rapidspec.runtime.lean_cache.LeanKVCache` caches go
through :class:`ForwardBatcher`: a forward waits until every step of the
tick is either waiting in a forward too or done, and then the waiting
forwards run together, one :meth:`~rapidspec.runtime.lean.LeanModel.forward_rows`
per model (a self-drafter on torch shares the target's weights but is a
cache of its own: a row of the same forward). The weights are read once for
all rows; each row keeps its own cache, number of new tokens and logits, so
a request's tokens are what it gets alone (up to the rounding of products
over more rows).

A thread that waits for something other than a forward (a lock, a llama.cpp
drafter) simply is not waiting in the batcher yet; the batch runs once it
arrives or finishes its step. :data:`STRAGGLER_TIMEOUT_S` bounds the wait
anyway: past it the forwards waiting run without the others (a step that
blocks on another step's result can never deadlock the tick).

:func:`batching` makes a batcher current on the calling thread; caches
consult :func:`current_batcher` (no batcher: the forward runs at once, as
always).

Who runs a batch: by default the step whose arrival completes it; with
:meth:`ForwardBatcher.serve` (a batcher made with ``served=True``), the
thread that serves the tick (the server's engine thread, the one thread with
torch's threads: :mod:`rapidspec.runtime.threads`), while the steps' own
threads compute alone. :meth:`ForwardBatcher.call` hands that thread other
work too large for a lone thread (a llama.cpp drafter's prefill).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from rapidspec.runtime.lean import LeanModel, Row

#: Longest wait, in seconds, of a forward for the other steps of its tick.
STRAGGLER_TIMEOUT_S = 5.0

_local = threading.local()


def current_batcher() -> ForwardBatcher | None:
    """The batcher of the step running on this thread, if any."""
    return getattr(_local, "batcher", None)


@contextlib.contextmanager
def batching(batcher: ForwardBatcher) -> Iterator[None]:
    """Route this thread's lean forwards through ``batcher`` (one participant of its tick) until the block ends."""
    previous = current_batcher()
    _local.batcher = batcher
    try:
        yield
    finally:
        _local.batcher = previous
        batcher.leave()


@contextlib.contextmanager
def unbatched() -> Iterator[None]:
    """This thread's forwards run at once, outside any tick, until the block ends (measuring one request alone)."""
    previous = current_batcher()
    _local.batcher = None
    try:
        yield
    finally:
        _local.batcher = previous


@dataclass(eq=False)
class _Pending:
    lean: LeanModel
    row: Row
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class _Call:
    function: Callable[[], object]
    result: object = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        try:
            self.result = self.function()
        except BaseException as err:  # raised again on the step's thread
            self.error = err
        finally:
            self.done.set()


class ForwardBatcher:
    """The forwards of one tick's ``participants`` steps, run together (see the module docstring)."""

    def __init__(self, participants: int, timeout_s: float = STRAGGLER_TIMEOUT_S, served: bool = False) -> None:
        """``served``: the batches run on the thread calling :meth:`serve`, never on a step's."""
        if participants < 1:
            raise ValueError("a tick has at least one participant")
        self.active = participants  # steps not done yet
        self.timeout_s = timeout_s
        self.batches: list[int] = []  # rows of each batch run (for tests and logs)
        self.tokens: dict[int, int] = {}  # tokens each step's thread fed the batched forwards (by thread ident)
        self._pending: list[_Pending] = []
        self._calls: list[_Call] = []
        self._lock = threading.Condition()
        self._served = served

    def forward(self, lean: LeanModel, row: Row) -> torch.Tensor:
        """Queue ``row`` of ``lean``, run the batch when the tick is ready, return this row's logits."""
        item = _Pending(lean, row)
        with self._lock:
            thread = threading.get_ident()
            self.tokens[thread] = self.tokens.get(thread, 0) + int(row.token_ids.numel())
            self._pending.append(item)
            self._run_if_ready()
        if not item.done.wait(self.timeout_s):
            with self._lock:  # stragglers: run what waits without them (serve() does it on its thread)
                if not item.done.is_set() and not self._served:
                    self._run()
            item.done.wait()
        if item.error is not None:
            raise item.error
        return item.logits

    def call(self, function: Callable[[], object]) -> object:
        """``function()`` on the serving thread (:meth:`serve`, torch's threads) when this batcher is served,
        else here: for work too large for a step's lone thread, such as a llama.cpp drafter's prefill."""
        if not self._served:
            return function()
        item = _Call(function)
        with self._lock:
            self._calls.append(item)
            self._lock.notify_all()
        item.done.wait()  # serve() runs until every step is done, this one included
        if item.error is not None:
            raise item.error
        return item.result

    def leave(self) -> None:
        """A participant's step is done: the others no longer wait for it."""
        with self._lock:
            self.active -= 1
            self._run_if_ready()

    def serve(self, finished: Callable[[], bool]) -> None:
        """Run the tick's batches on this thread until ``finished()`` (every step done); the steps' threads
        only queue their forwards and wait. Stragglers as in :meth:`forward`."""
        if not self._served:
            raise RuntimeError("serve() needs a batcher made with served=True")
        with self._lock:
            waited_since = None
            while not (finished() and not self._pending):
                if self._calls:  # run without the lock: the other steps go on queueing meanwhile
                    item = self._calls.pop(0)
                    self._lock.release()
                    try:
                        item.run()
                    finally:
                        self._lock.acquire()
                    continue
                if self._pending and waited_since is None:
                    waited_since = time.monotonic()
                if self._pending and (len(self._pending) >= self.active
                                      or time.monotonic() - waited_since > self.timeout_s):
                    self._run()
                    waited_since = None
                    continue
                self._lock.wait(0.05)

    def wake(self) -> None:
        """Tell :meth:`serve` to look again (a step ended)."""
        with self._lock:
            self._lock.notify_all()

    def _run_if_ready(self) -> None:
        if self._served:
            self._lock.notify_all()
        elif self._pending and len(self._pending) >= self.active:
            self._run()

    def _run(self) -> None:
        """Run every waiting forward (caller holds the lock), one forward_rows per model."""
        items, self._pending = self._pending, []
        self.batches.append(len(items))
        groups: dict[int, list[_Pending]] = {}
        for item in items:
            groups.setdefault(id(item.lean), []).append(item)
        for group in groups.values():
            try:
                with torch.inference_mode():
                    outputs = group[0].lean.forward_rows([item.row for item in group])
            except BaseException as err:  # every row of the group gets the error
                for item in group:
                    item.error = err
                    item.done.set()
                continue
            for item, logits in zip(group, outputs):
                item.logits = logits
                item.done.set()
