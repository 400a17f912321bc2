"""``rapidspec bench serve``: an online serving benchmark of an OpenAI-compatible server (as ``vllm bench serve``).

Sends ``--num-prompts`` chat requests to ``--base-url`` (or to a ``rapidspec
serve`` it starts on 127.0.0.1 and stops afterwards) at ``--request-rate``
per second with at most ``--max-concurrency`` in flight, and reports TTFT,
TPOT, ITL and end-to-end latency, throughputs and how every request ended.
A table on stdout, then one JSON object as the last stdout line; progress on
stderr. Exit code 1 when a request was lost or failed (or the server started
here did not stop cleanly). The load generator is
:mod:`rapidspec.bench.serve.load`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
from pathlib import Path

from rich.console import Console

from rapidspec.bench.serve import PEERS
from rapidspec.bench.serve.peers import PeerOptions, plan_peers
from rapidspec.bench.serve.report import comparison_table, results_tables
from rapidspec.bench.serve.run import failed, measure, measure_peer, measure_started, redacted, terminate_as_interrupt
from rapidspec.cli.options import json_object
from rapidspec.errors import RapidspecError

NAME = "bench-serve"  # `rapidspec bench serve` is dispatched here (rapidspec.cli.main)
PLACEHOLDER_URL = "http://127.0.0.1:8000"
DEFAULT_NUM_PROMPTS = 32
# options passed on to the `rapidspec serve` started here: (flag, dest)
SERVER_OPTIONS = (("--target", "target"), ("--drafter", "drafter"), ("--drafter-backend", "drafter_backend"),
                  ("--quantize", "quantize"), ("--drafter-quantize", "drafter_quantize"), ("--device", "device"),
                  ("--mode", "mode"), ("--retrieval", "retrieval"), ("--prefix-cache-gib", "prefix_cache_gib"),
                  ("--max-num-seqs", "max_num_seqs"))


def register(subparsers) -> None:
    # No help=: not listed as a command of its own; `rapidspec bench --help` points to it.
    parser = subparsers.add_parser(
        NAME, prog="rapidspec bench serve",
        description=(
            "Online serving benchmark, as vllm bench serve: sends --num-prompts chat requests to --base-url (or to "
            "a rapidspec serve started here on 127.0.0.1 and stopped afterwards) at --request-rate per second with "
            "at most --max-concurrency in flight; reports TTFT, TPOT, ITL and end-to-end latency (mean, median, "
            "p90, p95, p99), request and token throughput, and completed, rejected (429), errors and lost requests."
        ),
    )
    where = parser.add_argument_group("server")
    where.add_argument("--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000 (default: start rapidspec serve here)")
    where.add_argument("--api-key", default=os.environ.get("RAPIDSPEC_API_KEY"),
                       help="sent as 'Authorization: Bearer KEY'; the server started here gets it as $RAPIDSPEC_API_KEY "
                            "(default: $RAPIDSPEC_API_KEY)")
    where.add_argument("--model", default=None, help="the model field of each request (default: none, the server's model)")
    local = parser.add_argument_group("server started here (without --base-url)")
    for flag, dest in SERVER_OPTIONS:
        local.add_argument(flag, dest=dest, default=None, help=f"rapidspec serve {flag} (default: serve's)")
    local.add_argument("--max-queue", type=int, default=None, help="rapidspec serve --max-queue (default: --num-prompts, so none is refused)")
    local.add_argument("--kv-cache-gib", type=float, default=None,
                       help="rapidspec serve --kv-cache-gib (default here: 0, so every run reads its documents as a "
                            "freshly started peer does; give it to measure answers from the blocks on disk)")
    local.add_argument("--serve-args", default="", help="more options for rapidspec serve, one string, e.g. '--gamma 6 --eta 2'")
    local.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for it to be ready (default: %(default)s)")
    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=None,
                      help="requests to send (default: every question of --documents, else 32)")
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once (default: no limit)")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests per second, Poisson arrivals; inf sends all at once (default: inf)")
    load.add_argument("--seed", type=int, default=0, help="seed of the arrival times (default: %(default)s)")
    load.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole load; later answers are lost (default: %(default)s)")
    load.add_argument("--test-request", action=argparse.BooleanOptionalAction, default=True,
                      help="send one untimed request first and stop if it fails (default: on)")
    body = parser.add_argument_group("requests")
    body.add_argument("--dataset", default="builtin", help="builtin (the demo document), or a JSON/JSONL file of {document, question} records or a LoCoMo file")
    body.add_argument("--documents", default=None, metavar="FILE.jsonl",
                      help='one JSON object per line, {"document": "...", "questions": ["...", ...]}: each '
                           "document's questions in turn (benchmarks/documents_file.py writes one); instead of --dataset")
    body.add_argument("--document-tokens", type=int, default=None, help="length of the built-in document in tokens (default: about 7K)")
    body.add_argument("--locomo-sessions", type=int, default=2, help="LoCoMo sessions sent as earlier turns (default: %(default)s)")
    body.add_argument("--max-tokens", default="32",
                      help="max_tokens of each request, or several comma-separated that requests take in turn "
                           "(mixed answer lengths, e.g. 8,128) (default: %(default)s)")
    body.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True, help="stream the answers; TTFT, TPOT and ITL need it (default: on)")
    body.add_argument("--sessions", action="store_true",
                      help="send the requests about each dataset entry with their own x-session-id header (a conversation "
                           "key: rapidspec serve --replicas keeps a session on one replica); reports prefix reuse per session")
    body.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: every answer has --max-tokens tokens")
    body.add_argument("--extra-body", default=None, help="a JSON object merged into every request body, e.g. '{\"mode\": \"lc\"}'")
    peer = parser.add_argument_group("peer: the same load on another server, started here after rapidspec's run")
    peer.add_argument("--peer", choices=PEERS, default=None,
                      help="llama.cpp: llama.cpp's own llama-server on the target's GGUF (built from the pinned "
                           "llama-cpp-python's sources on first use, about 4.5 minutes on 2 cores, then cached); "
                           "vllm: vLLM's OpenAI server from .venv-vllm (make vllm) on the target, three times: without "
                           "speculation, with its ngram drafter and with RAPID's proposer")
    peer.add_argument("--peer-gguf", default=None, help="the GGUF file the peer serves (default: the target's)")
    peer.add_argument("--peer-parallel", type=int, default=1,
                      help="the peer's slots (default: %(default)s: llama-server does not share a document's prefix "
                           "between slots, so with more every slot prefills it again; see docs/bench_serve.md)")
    peer.add_argument("--peer-threads", type=int, default=None, help="the peer's threads (default: torch's, as rapidspec's)")
    peer.add_argument("--peer-args", default="", help="more options for the peer's server, one string, e.g. '-fa on'")
    peer.add_argument("--peer-speculation", default=None,
                      help="the peer's servers to run, comma-separated: vllm among none, ngram, rapid (default: all "
                           "three); llama.cpp among none, ngram (llama-server --spec-type ngram-mod), draft "
                           "(--spec-type draft-simple with --peer-draft-gguf) (default: none)")
    peer.add_argument("--peer-draft-gguf", default=None,
                      help="llama.cpp: the draft model of --peer-speculation draft (a smaller GGUF of the target's family)")
    peer.add_argument("--peer-model", default=None,
                      help="vllm: the model vLLM serves, any name rapidspec models export takes (default: --target, "
                           "else the built-in model)")
    peer.add_argument("--peer-speculative-tokens", type=int, default=None,
                      help="vllm: num_speculative_tokens of ngram and rapid (default: rapidspec's max_gamma)")
    parser.add_argument("--result-file", default=None, help="also write the JSON result to this file")
    parser.set_defaults(handler=run, command_name="bench serve")


def run(args: argparse.Namespace) -> int:
    from rapidspec.bench.serve.load import LoadConfig

    requests, dataset = _requests(args)
    if args.num_prompts is None:
        args.num_prompts = len(requests) if args.documents else DEFAULT_NUM_PROMPTS
    config = LoadConfig(
        base_url=args.base_url or PLACEHOLDER_URL, num_prompts=args.num_prompts, max_concurrency=args.max_concurrency,
        request_rate=args.request_rate, seed=args.seed, max_tokens=_max_tokens(args.max_tokens), stream=args.stream,
        ignore_eos=args.ignore_eos, sessions=args.sessions, model=args.model, api_key=args.api_key,
        extra_body=json_object(args.extra_body, "--extra-body", '{"mode": "lc"}') or {},
        timeout_s=args.timeout, test_request=args.test_request,
    )
    launch = _launch_config(args)
    result_file = _result_file(args.result_file)
    options = PeerOptions(peer=args.peer, target=args.target, gguf=args.peer_gguf, model=args.peer_model,
                          parallel=args.peer_parallel, threads=args.peer_threads, args=args.peer_args,
                          speculation=args.peer_speculation, draft_gguf=args.peer_draft_gguf,
                          speculative_tokens=args.peer_speculative_tokens, server_timeout=args.server_timeout)
    with contextlib.ExitStack() as stack:
        stack.enter_context(terminate_as_interrupt())  # servers started here are stopped on SIGTERM too
        peers = plan_peers(options, config, requests, stack)
        err = Console(stderr=True)
        if launch is None:
            summary = measure(config, requests, err) | {"server": {"started_here": False}}
        else:
            from rapidspec.bench.serve.process import LocalServer

            summary = measure_started(LocalServer(launch), config, requests, err, redacted(launch.serve_args))
        summary = {"dataset": dataset} | summary
        summaries = {"rapidspec": summary}
        for peer in peers:
            summaries[peer.name] = {"dataset": dataset} | measure_peer(peer, requests, err)
    result = summary if not peers else {"dataset": dataset, "servers": summaries}
    if result_file is not None:
        result_file.write_text(json.dumps(result, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    out = Console(width=None if Console().is_terminal else 120)
    for table in results_tables(summary):
        out.print(table)
    if peers:
        out.print(comparison_table(summaries))
    print(json.dumps(result, ensure_ascii=False), flush=True)
    return 1 if failed(summaries) else 0


def _requests(args: argparse.Namespace) -> tuple[list, str]:
    """The load's requests and the name the report gives them (``--documents`` or ``--dataset``)."""
    from rapidspec.bench.serve.dataset import BUILTIN, documents_requests, load_requests

    if args.documents is None:
        return load_requests(args.dataset, args.document_tokens, args.locomo_sessions), args.dataset
    if args.dataset != BUILTIN or args.document_tokens is not None:
        raise RapidspecError("--documents replaces --dataset and --document-tokens: give one of them")
    return documents_requests(args.documents), args.documents


def _max_tokens(text: str) -> int | tuple[int, ...]:
    try:
        lengths = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise RapidspecError(f"--max-tokens must be an integer or comma-separated integers, got {text!r}") from None
    return lengths[0] if len(lengths) == 1 else lengths


def _launch_config(args: argparse.Namespace):
    """The server to start here (None with --base-url, where the server options make no sense)."""
    from rapidspec.bench.serve.process import LaunchConfig

    given = [flag for flag, dest in (*SERVER_OPTIONS, ("--max-queue", "max_queue"), ("--kv-cache-gib", "kv_cache_gib"))
             if getattr(args, dest) is not None]
    if args.base_url is not None:
        if given or args.serve_args:
            raise RapidspecError(f"{', '.join(given) or '--serve-args'} apply to the server started here; "
                                 "with --base-url, give them to that server yourself")
        return None
    serve_args = [part for flag, dest in SERVER_OPTIONS if (value := getattr(args, dest)) is not None
                  for part in (flag, str(value))]
    serve_args += ["--max-queue", str(args.max_queue if args.max_queue is not None else args.num_prompts)]
    serve_args += ["--kv-cache-gib", str(args.kv_cache_gib if args.kv_cache_gib is not None else 0)]
    try:
        serve_args += shlex.split(args.serve_args)
    except ValueError as err:
        raise RapidspecError(f"--serve-args: {err}") from None
    return LaunchConfig(tuple(serve_args), api_key=args.api_key, start_timeout_s=args.server_timeout)


def _result_file(path: str | None) -> Path | None:
    if path is None:
        return None
    target = Path(path)
    if not target.parent.is_dir():
        raise RapidspecError(f"--result-file: the directory {target.parent} does not exist")
    return target
