"""Keep a conversation on the replica holding its prefix, for any OpenAI client (``serve --replicas``).

Ray Serve's ``ConsistentHashRouter`` sends requests with the same session id
to the same replica; its proxy takes the session id from the ``x-session-id``
header. Most clients send no such header, so :class:`SessionAffinity`, an
ASGI middleware run in the proxy (beside :mod:`.proxy_errors`), reads the body
of each generation request and, when the header is missing, adds one from
:func:`affinity_key`:

1. OpenAI's ``prompt_cache_key``, when the request has one;
2. else its ``user``;
3. else a hash of the prompt's leading part: the ``documents`` and the
   messages up to the first user message (``/v1/chat/completions``), or the
   first :data:`PROMPT_PREFIX_CHARS` characters of the prompt
   (``/v1/completions``). Every turn of a conversation starts with these, so
   its turns, and other questions about the same documents, meet on one replica.

The body is read whole (up to :data:`MAX_READ_BYTES`; a larger one passes on
without a key) and handed on unchanged; other routes pass untouched.
"""

from __future__ import annotations

import hashlib
import json

from rapidspec.scale import SESSION_HEADER

ROUTES = (b"/v1/chat/completions", b"/v1/completions")
#: Characters of a text completion's prompt that make its key.
PROMPT_PREFIX_CHARS = 4096
#: Largest body read for a key (the replica's own --max-request-bytes still applies).
MAX_READ_BYTES = 64 << 20


def affinity_key(body: dict, chat: bool) -> str | None:
    """The session key of a generation request's body (see the module docstring); None when it has no prompt."""
    for field in ("prompt_cache_key", "user"):
        value = body.get(field)
        if isinstance(value, str) and value:
            return f"{field}:{value}"
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        first_user = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"),
                          len(messages) - 1)
        leading = {"documents": body.get("documents"), "messages": messages[: first_user + 1]}
    else:
        prompt = body.get("prompt")
        prompt = prompt[0] if isinstance(prompt, list) and prompt else prompt
        if not isinstance(prompt, str):
            return None
        leading = {"prompt": prompt[:PROMPT_PREFIX_CHARS]}
    text = json.dumps(leading, sort_keys=True, ensure_ascii=False, default=str)
    return "prefix:" + hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:32]


class SessionAffinity:
    """Pure ASGI middleware: a generation request without ``x-session-id`` gets one from its body."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "").encode() if scope["type"] == "http" else b""
        if scope.get("method") != "POST" or path.rstrip(b"/") not in ROUTES or _has_session(scope):
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more and size <= MAX_READ_BYTES:
            message = await receive()
            if message["type"] != "http.request":  # the client left: hand that on
                chunks.append(message)
                break
            chunks.append(message)
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        key = None
        if not more and all(m["type"] == "http.request" for m in chunks):
            key = _key_of(b"".join(m.get("body", b"") for m in chunks), path.rstrip(b"/") == ROUTES[0])
        if key is not None:
            scope = {**scope, "headers": [*scope.get("headers", []), (SESSION_HEADER.encode(), key.encode())]}

        async def replay():
            return chunks.pop(0) if chunks else await receive()

        await self.app(scope, replay, send)


def _has_session(scope) -> bool:
    wanted = SESSION_HEADER.replace("-", "_")
    return any(name.decode("latin-1").lower().replace("-", "_") == wanted for name, _ in scope.get("headers", []))


def _key_of(raw: bytes, chat: bool) -> str | None:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None  # the replica answers the 400
    return affinity_key(body, chat) if isinstance(body, dict) else None
