"""The FastAPI application: OpenAI routes over one engine, no decoding logic of its own.

:func:`create_app` assembles the parts: the shared :class:`~rapidspec.server.state.ServerState`
(engine, queue, metrics, limits), the request guard (API key, body size) and
CORS, the error mapping onto OpenAI's body (:mod:`.errors`) and the routers
(:mod:`.routers`: generation, tokens, admin), the generation routes being
served by :mod:`.serving`; outermost, the drain on SIGTERM (:mod:`.http`).
Limits (API key, body size, window, time per request, CORS) are
:class:`ServerConfig` fields.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from rapidspec import __version__
from rapidspec.config import MAX_TOKENS, SHARED_PREFILL_TOKENS, DecodeConfig
from rapidspec.errors import RapidspecError
from rapidspec.prompting.conversation import DEFAULT_RECENT_MESSAGES
from rapidspec.retrieval import RetrievalConfig
from rapidspec.server.errors import add_error_handlers
from rapidspec.server.http import READ_TIMEOUT_S, DrainGate
from rapidspec.server.limits import RequestGuard
from rapidspec.server.routers import admin, generation, page, tokens
from rapidspec.server.state import ServerState


@dataclass(frozen=True)
class ServerConfig:
    """Server settings; ``decode`` and ``retrieval`` (None: the engine's) are the defaults of every request.

    ``decode.max_model_len`` and ``decode.time_limit_s`` are the window and the
    seconds each request may use (requests cannot change them; the time is
    wall-clock, so the requests running alongside count). ``max_num_seqs``:
    requests running at once, together or in turn (fewer when their
    windows do not fit the free memory, :mod:`rapidspec.server.capacity`);
    ``max_queue``: requests that may wait beyond those. ``batch_steps``
    (default): advance the running requests together, their lean-runtime
    forwards in one batched forward per model (:mod:`rapidspec.runtime.batching`);
    False: in turn. ``api_key``:
    None = open; ``max_request_bytes``: larger bodies get 413;
    ``max_document_tokens``: what a request's texts may hold when it asks for
    truncation (None = 4 windows); ``read_timeout_s``: how long a client may
    take to send a request's head, or pause within its body
    (:mod:`rapidspec.server.http`); ``allowed_origins``: CORS (empty = off,
    ``("*",)`` = any). ``shared_prefill_tokens``: while other requests run or wait, a prefill feeds at most this
    many tokens a step, so theirs come between its chunks; alone, pieces of about a second and at least
    256 tokens (:mod:`rapidspec.server.pieces`); 0 = whole chunks always.
    """

    model_name: str
    decode: DecodeConfig = field(default_factory=lambda: DecodeConfig(truncate="error", time_limit_s=600.0))
    retrieval: RetrievalConfig | None = None
    recent_messages: int = DEFAULT_RECENT_MESSAGES
    max_queue: int = 16
    max_num_seqs: int = 4
    batch_steps: bool = True
    disconnect_poll_seconds: float = 0.5
    api_key: str | None = None
    max_request_bytes: int = 16 * 1024 * 1024
    max_document_tokens: int | None = None
    read_timeout_s: float = READ_TIMEOUT_S
    allowed_origins: tuple[str, ...] = ()
    shared_prefill_tokens: int = SHARED_PREFILL_TOKENS

    def __post_init__(self) -> None:
        if not self.model_name:
            raise RapidspecError("the served model name is empty")
        if self.max_queue < 0:
            raise RapidspecError(f"max_queue must be >= 0, got {self.max_queue}")
        if not 1 <= self.max_num_seqs <= 256:
            raise RapidspecError(f"max_num_seqs must be in [1, 256], got {self.max_num_seqs}")
        if self.recent_messages < 0:
            raise RapidspecError(f"recent_messages must be >= 0, got {self.recent_messages}")
        if self.api_key is not None and not self.api_key.strip():
            raise RapidspecError("the API key is empty (--api-key or RAPIDSPEC_API_KEY): give one, or unset both "
                                 "for a server without a key")
        if not 0.1 <= self.read_timeout_s <= 3600:
            raise RapidspecError(f"read_timeout_s must be in [0.1, 3600] seconds, got {self.read_timeout_s}")
        if not 1024 <= self.max_request_bytes <= 1 << 31:
            raise RapidspecError(f"max_request_bytes must be in [1024, 2**31], got {self.max_request_bytes}")
        if self.max_document_tokens is not None and not 1 <= self.max_document_tokens <= MAX_TOKENS:
            raise RapidspecError(f"max_document_tokens must be in [1, {MAX_TOKENS}], got {self.max_document_tokens}")
        if isinstance(self.shared_prefill_tokens, bool) or not 0 <= self.shared_prefill_tokens <= MAX_TOKENS:
            raise RapidspecError(f"shared_prefill_tokens must be in [0, {MAX_TOKENS}], got {self.shared_prefill_tokens}")
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))


def create_app(engine, config: ServerConfig, fleet=None) -> FastAPI:
    """The app serving ``engine`` (a :class:`rapidspec.Rapid`); see docs/serving.md.

    ``fleet``: a :class:`~rapidspec.scale.fleet.FleetReporter` when the app is one replica of several
    (``/health`` and ``/metrics`` then answer for all of them).
    """
    state = ServerState(engine, config, fleet)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if fleet is not None:
            fleet.stop()  # a replica shutting down stops reporting (the board drops it after STALE_AFTER_S)
        state.preparer.shutdown(wait=False, cancel_futures=True)
        state.background_preparer.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(state.worker.stop)

    app = FastAPI(title="rapidspec", version=__version__, lifespan=lifespan)
    app.state.server = state
    app.state.engine, app.state.worker, app.state.metrics = engine, state.worker, state.metrics
    app.state.health = state.local_health
    app.add_middleware(RequestGuard, api_key=config.api_key, max_request_bytes=config.max_request_bytes,
                       read_timeout_s=config.read_timeout_s, refused=state.metrics.failed)
    if config.allowed_origins:  # outside the guard: CORS preflights need no key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    # outermost: a draining server refuses before reading a body, and counts every request it still answers
    app.add_middleware(DrainGate, drain=state.drain, health=state.local_health, refused=state.metrics.failed)
    add_error_handlers(app, state.metrics)
    for router in (generation.router, tokens.router, admin.router, page.router):
        app.include_router(router)
    return app
