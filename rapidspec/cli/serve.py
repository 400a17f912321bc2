"""``rapidspec serve``: the OpenAI-compatible HTTP server (docs/serving.md)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from rapidspec.cli.options import (
    add_decode_options,
    add_model_options,
    add_kv_cache_options,
    add_prefix_cache_option,
    add_retrieval_options,
    decode_config,
    json_object,
    engine_spec,
    load_engine,
    retrieval_config,
)
from rapidspec.config import SHARED_PREFILL_TOKENS
from rapidspec.errors import RapidspecError
from rapidspec.prompting.conversation import DEFAULT_RECENT_MESSAGES


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the models behind an OpenAI-compatible HTTP API",
        description=(
            "POST /v1/chat/completions and /v1/completions (streaming or not), GET /v1/models, /health "
            "and /metrics (Prometheus). Decoding and retrieval options set the defaults of every request; "
            "a request overrides them with fields of the same names (see docs/serving.md)."
        ),
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0 picks a free one)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients use (default: --target)")
    parser.add_argument("--max-num-seqs", type=int, default=4,
                        help="requests running at once (advanced together, or in turn with --no-batch-steps), so a "
                             "short answer is not held behind a long one; fewer when their windows do not fit the free "
                             "memory (default: %(default)s)")
    parser.add_argument("--batch-steps", action=argparse.BooleanOptionalAction, default=True,
                        help="advance the running requests together, their target (and torch drafter) forwards on the "
                             "lean runtime batched into one forward per step (default: on; --no-batch-steps: in turn, "
                             "a round each; docs/scaling.md)")
    parser.add_argument("--shared-prefill-tokens", type=int, default=SHARED_PREFILL_TOKENS,
                        help="while other requests run or wait, a long prefill feeds at most this many tokens a step, "
                             "so their steps come between its chunks; alone, pieces of about a second (0: whole chunks always; "
                             "default: %(default)s)")
    parser.add_argument("--max-queue", type=int, default=16, help="requests that may wait beyond those; more get 429 (default: %(default)s)")
    parser.add_argument("--recent-messages", type=int, default=DEFAULT_RECENT_MESSAGES,
                        help="earlier chat messages the drafter always reads verbatim (default: %(default)s)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM/Ctrl-C, seconds to let running requests finish before cancelling them; new "
                             "ones get 503 meanwhile (a second signal: stop now) (default: %(default)s)")
    limits = parser.add_argument_group("limits (docs/serving.md, 'Limits')")
    limits.add_argument("--api-key", default=None,
                        help="clients must send 'Authorization: Bearer KEY' (401 otherwise; /health stays open); "
                             "default: the RAPIDSPEC_API_KEY environment variable, else none")
    limits.add_argument("--max-request-bytes", type=int, default=16 * 1024 * 1024,
                        help="larger request bodies get 413 (default: %(default)s = 16 MiB)")
    limits.add_argument("--max-model-len", type=int, default=None,
                        help="the window (prompt + answer, tokens) a request may use (default: the model's)")
    limits.add_argument("--max-document-tokens", type=int, default=None,
                        help="tokens a request's documents and messages may hold when it asks for truncation "
                             "(default: 4 x the window)")
    limits.add_argument("--request-time-limit", type=float, default=600.0,
                        help="seconds of engine time per request (the queue not counted); the answer ends there "
                             "with finish_reason length; 0 = no limit (default: %(default)s)")
    limits.add_argument("--read-timeout", type=float, default=None,
                        help="seconds a client may take to send a request's head (else the connection is closed) "
                             "or pause within its body (else 408) (default: 30)")
    limits.add_argument("--allowed-origins", default="",
                        help="CORS: comma-separated origins browsers may call from, '*' for any (default: none, CORS off)")
    scale = parser.add_argument_group("replicas on Ray Serve (docs/scaling.md; the ray extra)")
    scale.add_argument("--replicas", type=int, default=None,
                       help="serve N copies of the app behind one endpoint with Ray Serve; requests with the same "
                            "x-session-id header go to the same replica (default: one engine, no Ray)")
    scale.add_argument("--ray-address", default=None,
                       help="with --replicas: the Ray cluster to deploy on (e.g. auto; default: a local instance)")
    scale.add_argument("--replica-resources", default=None, metavar="JSON",
                       help='with --replicas: Ray resources of each replica, e.g. \'{"num_gpus": 1}\' '
                            '(default: {"num_cpus": 1})')
    add_prefix_cache_option(parser)
    add_kv_cache_options(parser)
    add_model_options(parser)
    add_decode_options(parser)
    add_retrieval_options(parser)
    # A prompt longer than the window is a 400 (context_length_exceeded) unless a request asks to truncate.
    parser.set_defaults(handler=run, truncate="error")


def run(args: argparse.Namespace) -> int:
    try:
        from rapidspec.runtime.threads import helper_thread
        from rapidspec.server import ServerConfig, create_app
        from rapidspec.server.http import DrainingServer, uvicorn_config
    except ImportError as err:
        raise RapidspecError(f"rapidspec serve needs the serve extra ({err.name} is missing): "
                             "pip install 'rapidspec[serve]'") from None
    if not 0 <= args.port <= 65535:
        raise RapidspecError(f"--port must be in [0, 65535], got {args.port}")
    if args.shutdown_timeout < 0:
        raise RapidspecError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.request_time_limit < 0:
        raise RapidspecError(f"--request-time-limit must be >= 0, got {args.request_time_limit}")
    decode = decode_config(args).with_(max_model_len=args.max_model_len, time_limit_s=args.request_time_limit or None)
    config = ServerConfig(
        model_name=args.served_model_name or args.target,
        decode=decode,
        retrieval=retrieval_config(args),
        recent_messages=args.recent_messages,
        max_queue=args.max_queue,
        max_num_seqs=args.max_num_seqs,
        batch_steps=args.batch_steps,
        shared_prefill_tokens=args.shared_prefill_tokens,
        api_key=args.api_key if args.api_key is not None else os.environ.get("RAPIDSPEC_API_KEY"),  # "" is refused
        max_request_bytes=args.max_request_bytes,
        max_document_tokens=args.max_document_tokens,
        **({} if args.read_timeout is None else {"read_timeout_s": args.read_timeout}),
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
    )
    if args.replicas is not None:
        from rapidspec.scale.replicas import serve_replicas

        logging.getLogger("rapidspec").setLevel(logging.INFO)
        resources = json_object(args.replica_resources, "--replica-resources", '{"num_cpus": 1}')
        return serve_replicas(engine_spec(args), config, args.replicas, args.ray_address, resources, args.host, args.port)
    if args.ray_address is not None or args.replica_resources is not None:
        raise RapidspecError("--ray-address and --replica-resources apply with --replicas")
    helper_thread()  # the engine's thread computes; this one only loads and serves HTTP (rapidspec.runtime.threads)
    announce_unfinished()
    engine = load_engine(args)
    app = create_app(engine, config)
    app.state.server.warm_up_retrieval()
    logging.getLogger("rapidspec").setLevel(logging.INFO)
    server = DrainingServer(uvicorn_config(app, args.host, args.port, read_timeout_s=config.read_timeout_s,
                                           log_level="info", timeout_graceful_shutdown=args.shutdown_timeout),
                            app.state.server.drain, args.shutdown_timeout)
    # On SIGTERM the server drains (new requests get 503, running ones finish), uvicorn shuts down, then
    # raises the signal again for the handler that was there before; a handler that does nothing makes that
    # a clean exit with code 0.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def announce_unfinished() -> list:
    """Drop what writers killed mid-write left in the cache (:func:`~rapidspec.runtime.cache_dir.drop_unfinished`)
    and say so on stderr; the removed paths."""
    from rapidspec.runtime.cache_dir import cache_root, drop_unfinished

    root = cache_root()
    dropped = drop_unfinished(root)
    if dropped:
        shown = ", ".join(str(p.relative_to(root)) for p in dropped[:3]) + (", ..." if len(dropped) > 3 else "")
        print(f"removed {len(dropped)} unfinished cache file(s) that processes ended while writing them "
              f"(in {root}): {shown}", file=sys.stderr)
    return dropped
