"""The peers of ``rapidspec bench serve --peer``: what to start after rapidspec's run, and the load each one gets.

:func:`plan_peers` checks and prepares everything before anything runs (a
missing llama-server is built, a missing vLLM venv is one line, the target is
exported for vLLM), so a mistake costs no benchmark; it returns one
:class:`Peer` per server, in the order they run.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console

from rapidspec.errors import RapidspecError


@dataclass
class Peer:
    """A server to start (a LocalServer), the load it gets, its arguments for the report and its /metrics counters
    (None: rapidspec's names, which the peer does not have)."""

    name: str
    server: object
    load: object
    args: list[str]
    counters: dict[str, str] | None = field(default=None)


def plan_peers(args: argparse.Namespace, config, requests, stack: contextlib.ExitStack) -> list[Peer]:
    """The peers of ``--peer`` (none without it); ``stack`` owns what they need until the run ends (a folder)."""
    if args.peer != "vllm" and (args.peer_speculative_tokens or args.peer_model):
        raise RapidspecError("--peer-model and --peer-speculative-tokens apply to --peer vllm")
    if args.peer is None and args.peer_speculation:
        raise RapidspecError("--peer-speculation applies to --peer llama.cpp and --peer vllm")
    if args.peer != "llama.cpp" and args.peer_draft_gguf:
        raise RapidspecError("--peer-draft-gguf applies to --peer llama.cpp")
    if args.peer is None:
        return []
    if args.peer == "llama.cpp":
        from rapidspec.bench.serve.peer import PeerServer, parse_speculations, peer_load

        speculations = parse_speculations(args.peer_speculation or "none")
        if args.peer_draft_gguf and "draft" not in speculations:
            raise RapidspecError("--peer-draft-gguf is the draft model of --peer-speculation draft")
        draft = Path(args.peer_draft_gguf).expanduser() if args.peer_draft_gguf else None
        if "draft" in speculations and (draft is None or not draft.is_file()):
            raise RapidspecError(f"--peer-speculation draft needs --peer-draft-gguf FILE (got {draft or 'none'})")
        base = _llama_config(args, config, requests)
        load = peer_load(replace(config, api_key=None))
        peers = [replace(base, speculation=s, draft_gguf=draft if s == "draft" else None) for s in speculations]
        return [Peer(peer.name, PeerServer(peer), load, [str(peer.binary), *peer.args()]) for peer in peers]
    return _vllm_peers(args, config, requests, stack)


def _threads(args: argparse.Namespace) -> int:
    import torch

    threads = args.peer_threads or torch.get_num_threads()
    if threads < 1:
        raise RapidspecError("--peer-threads must be >= 1")
    return threads


def _extra_args(args: argparse.Namespace) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(args.peer_args))
    except ValueError as error:
        raise RapidspecError(f"--peer-args: {error}") from None


def _err() -> Console:
    return Console(stderr=True)


def _llama_config(args: argparse.Namespace, config, requests):
    """llama-server's settings; checked (and the binary built on first use) before anything runs."""
    from rapidspec.bench.llama_server import llama_server_binary
    from rapidspec.bench.serve.peer import PeerConfig, slot_context
    from rapidspec.models.backend import gguf_file

    gguf = Path(args.peer_gguf).expanduser() if args.peer_gguf else gguf_file(args.target or "builtin")
    if gguf is None or not gguf.is_file():
        raise RapidspecError(f"--peer {args.peer} serves a GGUF file: the target {args.target or 'builtin'!r} was not "
                             "read from one; give --peer-gguf FILE")
    if args.peer_parallel < 1:
        raise RapidspecError("--peer-parallel and --peer-threads must be >= 1")
    threads, extra = _threads(args), _extra_args(args)
    # found (or built on first use, with one line saying so) before the tokenizer's load: its errors come first
    err = _err()
    binary = llama_server_binary(progress=lambda line: err.print(line, soft_wrap=True, markup=False, highlight=False))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    context = slot_context(tokenizer, requests, max(config.answer_lengths))
    return PeerConfig(binary=binary, gguf=gguf, threads=threads, parallel=args.peer_parallel, slot_context=context,
                      extra_args=extra, start_timeout_s=args.server_timeout)


def _vllm_peers(args: argparse.Namespace, config, requests, stack: contextlib.ExitStack) -> list[Peer]:
    """One vLLM server per speculation of ``--peer-speculation``, on the target exported to a temporary folder."""
    from rapidspec.bench.serve.vllm_peer import (API_SERVER, METHODS, VLLM_COUNTERS, VllmPeerConfig, VllmServer, max_model_len,
                                                 parse_methods, vllm_load)
    from rapidspec.config import DecodeConfig
    from rapidspec.vllm.environment import require_vllm_python

    if args.peer_gguf is not None or args.peer_parallel != 1:
        raise RapidspecError("--peer-gguf and --peer-parallel apply to --peer llama.cpp")
    python = require_vllm_python()
    methods = parse_methods(args.peer_speculation) if args.peer_speculation else METHODS
    tokens = args.peer_speculative_tokens or DecodeConfig().max_gamma
    if tokens < 1:
        raise RapidspecError("--peer-speculative-tokens must be >= 1")
    threads, extra = _threads(args), _extra_args(args)
    target = args.peer_model or args.target or "builtin"
    served = config.model or config.extra_body.get("model") or args.target or "builtin"
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rapidspec_bench_serve_vllm_"))) / "model"
    from rapidspec.models.export import export_model

    with _err().status(f"exporting {target} for vLLM"):
        model = export_model(target, folder)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    length = max_model_len(tokenizer, requests, max(config.answer_lengths), tokens)
    sequences = min(config.max_concurrency or config.num_prompts, config.num_prompts)
    load = vllm_load(config, served)
    peers = []
    for method in methods:
        peer = VllmPeerConfig(python=python, model=model, served_name=served, max_model_len=length,
                              max_num_seqs=sequences, threads=threads, method=method, speculative_tokens=tokens,
                              extra_args=extra, start_timeout_s=args.server_timeout)
        peers.append(Peer(peer.name, VllmServer(peer), load, [str(python), "-m", API_SERVER, *peer.args()], VLLM_COUNTERS))
    return peers
