"""What the hostile-request suites share: the capped engine, the answer check and its counters.

Every answer any suite sends is counted in :data:`TRIED` and :data:`STATUSES`;
:func:`check` fails on a 5xx, a traceback in a body, an internal error inside
a stream, or a 4xx without OpenAI's error body. The last test of
``test_server_hostile`` prints the counts.
"""

from __future__ import annotations

import json
from collections import Counter

from tests.server_harness import HTTP

CAP = 4  # tokens the engine generates at most, per request
TRIED = {"bodies": 0, "5xx": 0}
STATUSES: Counter[int] = Counter()
HI = [{"role": "user", "content": "hi"}]
GOOD = {"model": "tiny", "messages": HI, "max_tokens": 3}
REFUSED = {"tools", "tool_choice", "functions", "function_call", "logit_bias", "n", "best_of",
           "echo", "suffix"}  # OpenAI fields rapidspec refuses, tools on a template without them (a 400 naming them)


class CappedEngine:
    """The engine, generating at most CAP tokens (the server still checks the body's own max_tokens)."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def decode(self, prompts, config, **options):
        capped = config.with_(max_new_tokens=min(config.max_new_tokens, CAP))
        return self._engine.decode(prompts, capped, **options)


def check(status: int, content_type: str, content: bytes, sent=None) -> dict | None:
    """Count one answer and check it (``sent``: the body, for the message); returns the error object of a 4xx."""
    TRIED["bodies"] += 1
    TRIED["5xx"] += status >= 500
    STATUSES[status] += 1
    text = content.decode("utf-8", "replace")
    assert status < 500, f"{status}: {text[:500]}\nbody sent: {sent!r}"[:3000]
    assert "Traceback" not in text and 'File "' not in text, text[:500]
    if content_type.startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event or event["error"]["type"] != "internal_error", line
        return None
    if status >= 400:
        body = json.loads(text)
        assert set(body) == {"error"}, text[:500]
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], text[:500]
        assert isinstance(error["type"], str) and (error["param"] is None or isinstance(error["param"], str))
        return error
    return None


def post(server: str, path: str = "/v1/chat/completions", body=None, raw: bytes | None = None, headers=None):
    """POST ``body`` as JSON (or ``raw`` bytes); returns (response, its 4xx error object or None)."""
    headers = {"content-type": "application/json"} | (headers or {})
    content = raw if raw is not None else json.dumps(body).encode()
    response = HTTP.post(f"{server}{path}", content=content, headers=headers, timeout=60)
    return response, check(response.status_code, response.headers.get("content-type", ""), response.content)
