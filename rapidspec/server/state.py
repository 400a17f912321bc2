"""What every route of one app shares: :class:`ServerState` (the engine, its queue, metrics and limits).

Built once by :func:`rapidspec.server.app.create_app` and kept as
``app.state.server``; routes reach it with the :func:`server_state` dependency.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from fastapi import Request

from rapidspec.errors import RapidspecError
from rapidspec.retrieval import RetrievalConfig, Retriever
from rapidspec.runtime.threads import background_thread, helper_thread
from rapidspec.server.capacity import concurrent_sequences, free_memory_bytes, kv_bytes_per_token
from rapidspec.server.http import Drain
from rapidspec.server.metrics import ServerMetrics
from rapidspec.server.tokens import ServerTokens, TokenPieces
from rapidspec.server.worker import Worker

logger = logging.getLogger(__name__)

#: Retrievers of other retrieval settings kept for requests (least recently used dropped beyond this).
KEPT_RETRIEVERS = 4


class ServerState:
    """The engine behind one app and what surrounds it: window, worker, metrics, tokens, retrievers, fleet, drain."""

    def __init__(self, engine, config, fleet=None) -> None:
        window = config.decode.max_model_len or engine.target.max_context
        if window > engine.target.max_context:
            raise RapidspecError(f"max_model_len={window} exceeds the model's {engine.target.max_context}-token window")
        self.engine, self.config, self.fleet, self.window = engine, config, fleet, window
        slots = concurrent_sequences(config.max_num_seqs, window, kv_bytes_per_token(engine.target),
                                     free_memory_bytes(engine.target.device), engine.prefix_cache.max_bytes)
        self.worker = Worker(config.max_queue, slots, batched=config.batch_steps)
        self.metrics = ServerMetrics(config.model_name, waiting=lambda: self.worker.waiting,
                                     running=lambda: self.worker.running,
                                     prefix_cache_bytes=lambda: engine.prefix_cache.bytes_used)
        self.tokens = ServerTokens(engine.tokenizer, config.max_document_tokens or 4 * window)
        self.pieces = TokenPieces(engine.tokenizer)
        # requests are prepared (sized, retrieved, rendered) here, as many at once as may be admitted; those with
        # large texts at a lower priority than the engine's steps (their embedding would slow every running request)
        slots = config.max_queue + self.worker.max_num_seqs
        self.preparer = ThreadPoolExecutor(slots, "rapidspec-prepare", initializer=helper_thread)
        self.background_preparer = ThreadPoolExecutor(slots, "rapidspec-prepare-large", initializer=background_thread)
        self.started = int(time.time())
        self.drain = Drain()  # begun on SIGTERM (rapidspec.server.http.DrainingServer)
        self._retrievers: OrderedDict[RetrievalConfig, Retriever] = OrderedDict()
        self._retrievers_lock = threading.Lock()
        self.default_eta, self.eta_reason = engine.resolve(config.decode.with_(mode="rapid"))

    def warm_up_retrieval(self) -> Future:
        """Load what the engine's first retrieval would (the embedder: seconds) on a thread of lower priority, so
        that the first request with a long document does not load it beside the others' steps (``rapidspec
        serve`` calls this once it has its app; a failure is logged, and said again by the first request)."""

        def warm_up() -> None:
            try:
                self.engine.retriever.warm_up()
            except Exception as err:  # noqa: BLE001
                logger.warning("retrieval could not warm up: %s: %s", type(err).__name__, err)

        return self.background_preparer.submit(warm_up)

    def check_model(self, name: str | None) -> None:
        """A request naming another model than the one served is a 404 (as OpenAI answers)."""
        if name is not None and name != self.config.model_name:
            raise RapidspecError(f"the model {name!r} is not served here; this server serves "
                                 f"{self.config.model_name!r}", param="model", code="model_not_found")

    def retriever_for(self, wanted: RetrievalConfig) -> Retriever:
        """The engine's retriever, or one of ``wanted``'s settings sharing its embedder (a few kept)."""
        engine = self.engine
        if wanted == engine.retriever.config:
            return engine.retriever
        with self._retrievers_lock:  # the preparing threads share them
            if wanted not in self._retrievers:
                self._retrievers[wanted] = Retriever(wanted, tokenizer=engine.tokenizer,
                                                     embedder=engine.retriever.loaded_embedder)
                while len(self._retrievers) > KEPT_RETRIEVERS:
                    self._retrievers.popitem(last=False)
            self._retrievers.move_to_end(wanted)
            return self._retrievers[wanted]

    def local_health(self) -> dict:
        """This engine's ``/health`` body (a replica's report to the fleet board too)."""
        engine, config, worker = self.engine, self.config, self.worker
        reason = "given by --eta" if self.eta_reason == "given" else self.eta_reason
        return {"status": "draining" if self.drain.draining else "ok", "model": config.model_name, "pid": os.getpid(),
                "running": worker.running,
                "rapid_eta": {"default": self.default_eta.eta, "reason": reason, "drafter": engine.drafter_label,
                              "drafter_relation": engine.drafter_relation},
                "waiting": worker.waiting, "max_num_seqs": worker.max_num_seqs, "max_queue": config.max_queue,
                "batch_steps": worker.batched, "batched_forward_rows_recent": list(worker.batch_rows[-32:]),
                "prefix_cache": {"entries": len(engine.prefix_cache), "bytes": engine.prefix_cache.bytes_used,
                                 "max_bytes": engine.prefix_cache.max_bytes},
                # the step costs its decisions read: figures, when measured, the load then, busy or not
                "calibration": engine.costs.entries()}


def server_state(request: Request) -> ServerState:
    """The FastAPI dependency giving a route its app's :class:`ServerState`."""
    return request.app.state.server
