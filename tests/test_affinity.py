"""The proxy's side of ``serve --replicas``, without a Ray instance: the session key of requests without
``x-session-id``, the router's choice of replica (home, line, overflow), a cut stream's end, the fleet's counters."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from rapidspec.scale.affinity import SessionAffinity, affinity_key
from rapidspec.scale.fleet import ROUTER, FleetBoard
from rapidspec.scale.proxy_errors import OpenAIErrorBodies
from rapidspec.scale.router import SETTLE_S, AffinityRouter, default_max_line, home_of
from rapidspec.server.fleet import fleet_health, merged_metrics

DOCS = ["A long report."]
FIRST = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who signed?"}]


def test_prompt_cache_key_then_user_then_the_leading_messages():
    assert affinity_key({"prompt_cache_key": "k", "user": "u", "messages": FIRST}, True) == "prompt_cache_key:k"
    assert affinity_key({"user": "u", "messages": FIRST}, True) == "user:u"
    turn_one = affinity_key({"messages": FIRST, "documents": DOCS}, True)
    turn_two = affinity_key({"messages": FIRST + [{"role": "assistant", "content": "Ada."},
                                                  {"role": "user", "content": "When?"}], "documents": DOCS}, True)
    assert turn_one == turn_two and turn_one.startswith("prefix:")  # every turn of a conversation meets
    assert affinity_key({"messages": FIRST, "documents": ["Another report."]}, True) != turn_one
    assert affinity_key({"prompt": "x" * 5000 + "a"}, False) == affinity_key({"prompt": ["x" * 5000 + "b"]}, False)
    assert affinity_key({"messages": "nope"}, True) is None and affinity_key({"prompt": 3}, False) is None


def run(scope: dict, body: bytes, pieces: int = 3) -> tuple[dict, bytes]:
    """The scope and body the inner app sees when ``body`` arrives in ``pieces`` messages."""
    seen: dict = {}
    size = max(1, len(body) // pieces + 1)
    messages = [{"type": "http.request", "body": body[i:i + size], "more_body": i + size < len(body)}
                for i in range(0, len(body), size)] or [{"type": "http.request", "body": b""}]

    async def receive():
        return messages.pop(0)

    async def app(scope, receive, send):
        seen["scope"], got, more = scope, b"", True
        while more:
            message = await receive()
            got += message.get("body", b"")
            more = message.get("more_body", False)
        seen["body"] = got

    async def send(message):
        pass

    asyncio.run(SessionAffinity(app)(scope, receive, send))
    return seen["scope"], seen["body"]


def scope(path: str = "/v1/chat/completions", headers=()) -> dict:
    return {"type": "http", "method": "POST", "path": path, "headers": list(headers)}


def session(seen_scope: dict) -> str | None:
    return dict(seen_scope["headers"]).get(b"x-session-id", b"").decode() or None


def test_a_plain_request_gets_its_key_and_its_body_unchanged():
    body = json.dumps({"messages": FIRST, "documents": DOCS}).encode()
    seen, got = run(scope(), body)
    assert got == body and session(seen) == affinity_key({"messages": FIRST, "documents": DOCS}, True)


def test_a_session_header_other_routes_and_bad_json_pass_untouched():
    body = json.dumps({"messages": FIRST}).encode()
    assert session(run(scope(headers=[(b"X-Session-Id", b"mine")]), body)[0]) is None  # its own header stays
    assert dict(run(scope(headers=[(b"X-Session-Id", b"mine")]), body)[0]["headers"])[b"X-Session-Id"] == b"mine"
    assert session(run(scope("/tokenize"), body)[0]) is None
    seen, got = run(scope(), b"{not json")
    assert session(seen) is None and got == b"{not json"


DEPLOYMENT = DeploymentID(name="rapidspec", app_name="rapidspec")


class FakeReplica:
    """What the router reads of a running replica."""

    def __init__(self, name: str) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = 32


class FakeResult:
    """A replica's result as the router sees it: callbacks run when it ends (at once if it has ended)."""

    def __init__(self, ended: bool = False) -> None:
        self.ended, self.callbacks = ended, []

    def add_done_callback(self, callback) -> None:
        if self.ended:
            callback(self)
        else:
            self.callbacks.append(callback)

    def end(self) -> None:
        self.ended = True
        for callback in self.callbacks:
            callback(self)


def pending(request: str, session: str = "", age_s: float = 0.0) -> PendingRequest:
    metadata = RequestMetadata(request_id=request, internal_request_id=request, session_id=session)
    return PendingRequest(args=[], kwargs={}, metadata=metadata, created_at=time.time() - age_s)


def test_a_home_per_session_and_only_a_leaving_replicas_sessions_move():
    a, b, c = (FakeReplica(name) for name in "abc")
    sessions = [f"conversation-{i}" for i in range(300)]
    homes = {s: home_of(s, [a, b, c]) for s in sessions}
    assert {len([s for s in sessions if homes[s] is r]) > 60 for r in (a, b, c)} == {True}  # spread
    after = {s: home_of(s, [a, b]) for s in sessions}
    assert all(after[s] is homes[s] for s in sessions if homes[s] is not c)  # the others stay
    assert default_max_line(4, 16) == 8 and default_max_line(2, 0) == 2 and default_max_line(1, 1) == 2


def _router_of_two() -> tuple[AffinityRouter, list[FakeReplica], FakeReplica, FakeReplica]:
    """A router with a line bound of 2 over two replicas, session "s"'s home and the other one."""
    router = AffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.PROXY)
    router.initialize_state(max_line=2, max_wait_s=30)
    replicas = [FakeReplica("a"), FakeReplica("b")]
    home = home_of("s", replicas)
    return router, replicas, home, next(r for r in replicas if r is not home)


def test_a_session_waits_for_its_home_until_its_line_reaches_the_bound():
    async def scenario():
        router, replicas, home, other = _router_of_two()
        assert await router.choose_replicas(replicas, pending("r1", "s")) == [[home]]  # only home: it waits there
        for request in ("r1", "r2"):
            router.on_request_routed(pending(request, "s"), home.replica_id, FakeResult())
        router.on_request_routed(pending("health"), home.replica_id, FakeResult())  # no session: not in the line
        assert router.line(home.replica_id) == 2
        at_bound = pending("r3", "s", age_s=SETTLE_S)  # past the settling (the next test)
        assert await router.choose_replicas(replicas, at_bound) == [[other], [home]]  # at the bound
        router.on_request_routed(at_bound, other.replica_id, FakeResult())
        assert router.overflows == {"line": 1}
        router.on_request_completed(other.replica_id, "r1")  # not where r1 was: nothing changes
        router.on_request_completed(home.replica_id, "r1")
        assert await router.choose_replicas(replicas, pending("r4", "s")) == [[home]]  # the line is short again
        late = pending("r5", "s", age_s=31)  # its home did not take it for max_wait_s
        assert await router.choose_replicas(replicas, late) == [[other], [home]]
        router.on_request_routed(late, home.replica_id, FakeResult())  # the home took it after all: no overflow
        assert router.overflows == {"line": 1}
        assert await router.choose_replicas(replicas, pending("page")) == [replicas]  # no session: any replica
        assert await router.choose_replicas([home], pending("r6", "s")) == [[home]]  # nowhere else to go
        router.update_replicas([])  # the replicas left: their lines go
        assert router.line(home.replica_id) == 0

    asyncio.run(scenario())


def test_a_request_leaves_the_line_when_its_result_ends_even_if_serve_heard_its_end_before_it_was_routed():
    """Serve registers its completion callback before it awaits the replica's acceptance and calls
    on_request_routed only after: a short answer on a busy proxy ends in between. Counted by its id alone, such a
    request stayed in its home's line for good (a conversation then overflowed at a line it did not have)."""
    async def scenario():
        router, replicas, home, _ = _router_of_two()
        router.on_request_completed(home.replica_id, "quick")  # Serve heard it end first
        router.on_request_routed(pending("quick", "s"), home.replica_id, FakeResult(ended=True))
        slow = FakeResult()
        router.on_request_routed(pending("slow", "s"), home.replica_id, slow)
        await asyncio.sleep(0)  # the result's callback comes through the event loop
        assert router.line(home.replica_id) == 1  # only the one still running
        slow.end()  # from the result alone, before Serve's own call
        await asyncio.sleep(0)
        assert router.line(home.replica_id) == 0
        router.on_request_completed(home.replica_id, "slow")  # Serve's call, after: nothing left to remove
        assert router.line(home.replica_id) == 0

    asyncio.run(scenario())


def test_a_turn_that_finds_its_own_session_in_a_full_line_is_asked_again_before_it_overflows():
    """A client's next turn can come before Serve tells the router the turn before ended: the full line it sees
    may hold that turn. It is asked again (no replica yet) for up to SETTLE_S, then overflows as any other."""
    async def scenario():
        router, replicas, home, other = _router_of_two()
        router.on_request_routed(pending("turn-1", "s"), home.replica_id, FakeResult())
        router.on_request_routed(pending("x1", "x"), home.replica_id, FakeResult())  # another session sharing the home
        assert router.line(home.replica_id) == 2 and router.line(home.replica_id, "s") == 1
        assert await router.choose_replicas(replicas, pending("turn-2", "s")) == []  # not yet: asked again
        router.on_request_completed(home.replica_id, "turn-1")  # Serve hears the turn before ended
        assert await router.choose_replicas(replicas, pending("turn-2", "s")) == [[home]]  # home, with its prefix
        router.on_request_routed(pending("turn-2", "s"), home.replica_id, FakeResult())
        assert await router.choose_replicas(replicas, pending("turn-3", "s", age_s=SETTLE_S)) == [[other], [home]]
        neighbour = next(f"y{i}" for i in range(100) if home_of(f"y{i}", replicas) is home)
        assert await router.choose_replicas(replicas, pending("y1", neighbour)) == [[other], [home]]  # not in it
        assert router.overflows == {}  # nothing routed elsewhere yet

    asyncio.run(scenario())


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("how", ["returns", "raises"])
async def test_a_stream_the_proxy_leaves_open_ends_with_an_error_event(anyio_backend, how):
    async def proxy(scope, receive, send):  # the proxy when the replica dies mid-stream
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})
        if how == "raises":
            raise RuntimeError("the replica died")

    transport = httpx.ASGITransport(app=OpenAIErrorBodies(proxy))
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        response = await client.post("/v1/chat/completions")
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert response.status_code == 200 and events[0] == '{"choices": []}' and events[-1] == "[DONE]"
    assert json.loads(events[1])["error"]["code"] == "replica_unavailable"
    assert set(json.loads(events[1])["error"]) == {"message", "type", "param", "code"}


def test_the_routers_counters_join_the_fleets_metrics_without_a_replica():
    board = FleetBoard()
    board.report("r1", {"running": 1, "waiting": 0}, b"# TYPE x counter\nx_total 2.0\n")
    board.count_overflow("line")
    reports = board.reports()
    assert set(reports) == {"r1", ROUTER}
    health = fleet_health(reports)
    assert [r["replica"] for r in health["replicas"]] == ["r1"] and health["running"] == 1
    text = merged_metrics(reports).decode()
    assert 'x_total{replica="r1"} 2.0' in text
    assert 'rapidspec:affinity_overflow_total{reason="line"} 1.0' in text
    assert 'rapidspec:affinity_overflow_total{reason="wait"} 0.0' in text
