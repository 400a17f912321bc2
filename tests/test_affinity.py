"""The proxy's session key for requests without ``x-session-id`` (``serve --replicas``), without Ray."""

from __future__ import annotations

import asyncio
import json

from rapidspec.scale.affinity import SessionAffinity, affinity_key

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
