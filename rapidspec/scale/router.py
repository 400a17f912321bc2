"""Which replica answers a request (``serve --replicas``): a conversation waits for the replica holding its prefix.

Ray Serve's ``ConsistentHashRouter`` maps a session to a replica, but hands
the request to the next replica on its ring as soon as that one does not take
it at once: when it does not answer the router's queue-length probe within
the deadline (0.1 s, doubled on each retry up to 1 s; the replica's event loop
answers it) or is at ``max_ongoing_requests``. A replica generating on a
loaded machine misses that deadline, and the next turn of its conversation
went to another replica, without its prefix: on a 2-core machine, 4
conversations x 2 turns at once kept their prefix 4 of 4 times when the
machine was quiet, 2 of 4 while another process held one core.

:class:`AffinityRouter`, a request router of Ray Serve's API:

1. A request with a session id (the ``x-session-id`` header, which
   :mod:`.affinity` sets in the proxy for every generation request) has a
   *home*: the running replica with the highest :func:`score` for it
   (rendezvous hashing: when a replica leaves, only its sessions move; the
   one that replaces it takes over only the sessions it now scores highest).
2. The home's *line*: the requests with a session id this router has sent
   there and that have not ended (a stream counts until its last chunk). A
   request leaves the line on its own result's end, not only on Serve's
   ``on_request_completed``: Serve hears a request end before it tells the
   router the request was routed when the answer is short and the proxy busy,
   and a request counted after its end would stay in the line for good.
3. While the line is shorter than ``max_line``, the request goes home and
   nowhere else: when the home misses a probe, Serve backs off and asks it
   again, and the request waits (in the router, or in the replica's own
   queue once it is taken).
4. When the line is at ``max_line``, or the home has not taken the request
   within ``max_wait_s`` (a replica that stopped answering), the request
   *overflows*: the other replicas are asked first (Serve takes the one with
   the shortest queue), the home last. Each overflow is counted on the fleet
   board and shown in ``/metrics`` as
   ``rapidspec:affinity_overflow_total{reason="line"|"wait"}``. A request
   whose own session is in the line at the bound is asked again for up to
   ``SETTLE_S`` first: a client sends its next turn as soon as the last one
   answers, and Serve tells the router that a request ended only after its
   answer has gone, so the turn before may still count.
5. A request without a session id (``/health``, ``/metrics``, the page)
   goes to the replica with the shortest queue.

The bound (:func:`default_max_line`): twice the requests a replica runs at
once. A turn that waits then has fewer than ``max_num_seqs`` requests ahead
of it in its replica's queue, so it starts within about one answer's time;
sent elsewhere, it would read its whole prefix again (for a long document,
longer than an answer). Each proxy's router counts the requests it sent (one
proxy on one machine sees all of them; on a cluster, each node's proxy counts
its own). A request joins the line once its replica has taken it, so requests
routed at the same instant see the same line: a burst may pass the bound by
its size.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from rapidspec.scale.fleet import FLEET_ACTOR, FLEET_NAMESPACE

logger = logging.getLogger(__name__)

#: Seconds a request tries its home before it overflows, when the home does not take it (does not answer).
DEFAULT_MAX_WAIT_S = 30.0
#: Seconds a request whose own session is in its home's full line waits for the router to hear that it ended.
SETTLE_S = 2.0
#: Overflow decisions kept for requests not yet routed (older ones, of clients that left, are dropped).
KEPT_DECISIONS = 1024


def default_max_line(max_num_seqs: int, max_queue: int) -> int:
    """The line at which a turn overflows: twice the running slots, within what the replica queues (429 beyond)."""
    return max(1, min(2 * max_num_seqs, max_num_seqs + max_queue))


def score(session: str, replica: str) -> int:
    """The rendezvous score of ``replica`` (its unique id) for ``session``: the highest one is the session's home."""
    digest = hashlib.blake2b(f"{session}\0{replica}".encode("utf-8", "replace"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def home_of(session: str, replicas: list[RunningReplica]) -> RunningReplica:
    """The replica of ``replicas`` that holds ``session``'s conversation."""
    return max(replicas, key=lambda r: score(session, r.replica_id.unique_id))


def overflow_reason(line: int, waited_s: float, max_line: int, max_wait_s: float) -> str | None:
    """Why a request leaves its home, or None (``line``: the home's ongoing requests; ``waited_s``: since it came)."""
    if line >= max_line:
        return "line"
    if waited_s >= max_wait_s:
        return "wait"
    return None


class AffinityRouter(RequestRouter):
    """Ray Serve request router: a session waits for its home replica while its line is short (module docstring).

    Options (``RequestRouterConfig.request_router_kwargs``): ``max_line`` and ``max_wait_s``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_line, self.max_wait_s = default_max_line(4, 16), DEFAULT_MAX_WAIT_S
        self._sent: dict[str, tuple[ReplicaID, str]] = {}  # internal request id -> (replica, session), not ended
        self._decisions: dict[str, tuple[str, ReplicaID]] = {}  # internal request id -> (reason, home)
        self.overflows: dict[str, int] = {}  # reason -> requests (this router's; the board sums them for /metrics)
        self._board = None

    def initialize_state(self, max_line: int | None = None, max_wait_s: float = DEFAULT_MAX_WAIT_S, **kwargs) -> None:
        if max_line is not None:
            if not isinstance(max_line, int) or max_line < 1:
                raise ValueError(f"max_line must be an int >= 1, got {max_line!r}")
            self.max_line = max_line
        if not max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {max_wait_s!r}")
        self.max_wait_s = float(max_wait_s)

    def line(self, replica_id: ReplicaID, session: str | None = None) -> int:
        """The requests with a session id (``session``, if given) this router sent to ``replica_id``, not ended."""
        return sum(1 for sent_to, of in self._sent.values() if sent_to == replica_id and session in (None, of))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks of replicas to try, best first: the home alone, or the others then the home when it overflows."""
        if not candidate_replicas:
            return []
        if pending_request is None or not pending_request.metadata.session_id:
            return [candidate_replicas]  # Serve takes the shortest queue
        pending_request.routing_context.should_backoff = True  # between two tries of the home, back off
        session = pending_request.metadata.session_id
        home = home_of(session, candidate_replicas)
        others = [r for r in candidate_replicas if r is not home]
        waited_s = time.time() - pending_request.created_at
        reason = overflow_reason(self.line(home.replica_id), waited_s, self.max_line, self.max_wait_s)
        if reason is None or not others:
            return [[home]]
        if reason == "line" and waited_s < SETTLE_S and self.line(home.replica_id, session):
            return []  # its turn before may have ended unheard (module docstring): Serve backs off and asks again
        self._decide(pending_request.metadata.internal_request_id, reason, home.replica_id)
        return [others, [home]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """A replica took the request: it joins that replica's line until ``result`` ends; an overflow is counted."""
        request_id = pending_request.metadata.internal_request_id
        if pending_request.metadata.session_id:
            self._sent[request_id] = (replica_id, pending_request.metadata.session_id)
            loop = asyncio.get_running_loop()  # Serve calls the router on its event loop; results end on other threads
            result.add_done_callback(
                lambda _: loop.call_soon_threadsafe(self.on_request_completed, replica_id, request_id))
        reason, home = self._decisions.pop(request_id, (None, None))
        if reason is not None and replica_id != home:
            self._count_overflow(reason, home)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request ended (answered, failed or cancelled): it leaves the line of the replica that had it."""
        if self._sent.get(internal_request_id, (None,))[0] == replica_id:
            del self._sent[internal_request_id]
        self._decisions.pop(internal_request_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new set of replicas: the lines of those that left are dropped."""
        super().update_replicas(replicas)
        present = {r.replica_id for r in replicas}
        self._sent = {request: sent for request, sent in self._sent.items() if sent[0] in present}

    def _decide(self, request_id: str, reason: str, home: ReplicaID) -> None:
        self._decisions[request_id] = (reason, home)
        while len(self._decisions) > KEPT_DECISIONS:
            del self._decisions[next(iter(self._decisions))]

    def _count_overflow(self, reason: str, home: ReplicaID) -> None:
        self.overflows[reason] = self.overflows.get(reason, 0) + 1
        logger.info("a request left its home replica %s (%s: line %d of %d)", home.unique_id, reason,
                    self.line(home), self.max_line)
        board = self._fleet_board()
        if board is not None:
            board.count_overflow.remote(reason)

    def _fleet_board(self):
        """The replicas' :class:`~rapidspec.scale.fleet.FleetBoard` (None when there is none: nothing is counted)."""
        import ray

        if self._board is None and ray.is_initialized():
            try:
                self._board = ray.get_actor(FLEET_ACTOR, namespace=FLEET_NAMESPACE)
            except ValueError:
                logger.debug("no fleet board: the overflow is not counted")
        return self._board
