"""The peers of ``rapidspec bench serve --peer``: what to start after rapidspec's run, and the load each one gets.

:class:`PeerOptions` holds the ``--peer*`` options one to one, checked on construction; :func:`plan_peers`
prepares everything before anything runs (a missing llama-server is built, a missing vLLM venv is one line,
the target is exported for vLLM), so a mistake costs no benchmark; it returns one :class:`Peer` per server,
in the order they run.
"""

from __future__ import annotations

import contextlib
import shlex
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console

from rapidspec.errors import RapidspecError


@dataclass(frozen=True)
class PeerOptions:
    """``--peer`` (None, ``llama.cpp`` or ``vllm``) and the options of its servers, as the CLI names them;
    ``target``: rapidspec's target (the peer serves its GGUF file or an export of it)."""

    peer: str | None = None
    target: str | None = None
    gguf: str | None = None
    model: str | None = None
    parallel: int = 1
    threads: int | None = None
    args: str = ""
    speculation: str | None = None
    draft_gguf: str | None = None
    speculative_tokens: int | None = None
    server_timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.peer != "vllm" and (self.speculative_tokens or self.model):
            raise RapidspecError("--peer-model and --peer-speculative-tokens apply to --peer vllm")
        if self.peer is None and self.speculation:
            raise RapidspecError("--peer-speculation applies to --peer llama.cpp and --peer vllm")
        if self.peer != "llama.cpp" and self.draft_gguf:
            raise RapidspecError("--peer-draft-gguf applies to --peer llama.cpp")
        if self.parallel < 1 or (self.threads is not None and self.threads < 1):
            raise RapidspecError("--peer-parallel and --peer-threads must be >= 1")
        if self.speculative_tokens is not None and self.speculative_tokens < 1:
            raise RapidspecError("--peer-speculative-tokens must be >= 1")

    def extra_args(self) -> tuple[str, ...]:
        try:
            return tuple(shlex.split(self.args))
        except ValueError as error:
            raise RapidspecError(f"--peer-args: {error}") from None

    def thread_count(self) -> int:
        import torch

        return self.threads or torch.get_num_threads()


@dataclass
class Peer:
    """A server to start (a LocalServer), the load it gets, its arguments for the report and its /metrics counters
    (None: rapidspec's names, which the peer does not have)."""

    name: str
    server: object
    load: object
    args: list[str]
    counters: dict[str, str] | None = field(default=None)


def plan_peers(options: PeerOptions, config, requests, stack: contextlib.ExitStack) -> list[Peer]:
    """The peers of ``options`` (none without ``--peer``); ``stack`` owns what they need until the run ends."""
    if options.peer is None:
        return []
    if options.peer == "vllm":
        return _vllm_peers(options, config, requests, stack)
    from rapidspec.bench.serve.peer import PeerServer, parse_speculations, peer_load

    speculations = parse_speculations(options.speculation or "none")
    if options.draft_gguf and "draft" not in speculations:
        raise RapidspecError("--peer-draft-gguf is the draft model of --peer-speculation draft")
    draft = Path(options.draft_gguf).expanduser() if options.draft_gguf else None
    if "draft" in speculations and (draft is None or not draft.is_file()):
        raise RapidspecError(f"--peer-speculation draft needs --peer-draft-gguf FILE (got {draft or 'none'})")
    base = _llama_config(options, config, requests)
    load = peer_load(replace(config, api_key=None))
    peers = [replace(base, speculation=s, draft_gguf=draft if s == "draft" else None) for s in speculations]
    return [Peer(peer.name, PeerServer(peer), load, [str(peer.binary), *peer.args()]) for peer in peers]


def _llama_config(options: PeerOptions, config, requests):
    """llama-server's settings; checked (and the binary built on first use) before anything runs."""
    from rapidspec.bench.llama_server import llama_server_binary
    from rapidspec.bench.serve.peer import PeerConfig, slot_context
    from rapidspec.models.backend import gguf_file

    target = options.target or "builtin"
    gguf = Path(options.gguf).expanduser() if options.gguf else gguf_file(target)
    if gguf is None or not gguf.is_file():
        raise RapidspecError(f"--peer {options.peer} serves a GGUF file: the target {target!r} was not "
                             "read from one; give --peer-gguf FILE")
    threads, extra = options.thread_count(), options.extra_args()
    # found (or built on first use, with one line saying so) before the tokenizer's load: its errors come first
    err = Console(stderr=True)
    binary = llama_server_binary(progress=lambda line: err.print(line, soft_wrap=True, markup=False, highlight=False))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    context = slot_context(tokenizer, requests, max(config.answer_lengths))
    return PeerConfig(binary=binary, gguf=gguf, threads=threads, parallel=options.parallel, slot_context=context,
                      extra_args=extra, start_timeout_s=options.server_timeout)


def _vllm_peers(options: PeerOptions, config, requests, stack: contextlib.ExitStack) -> list[Peer]:
    """One vLLM server per speculation of ``--peer-speculation``, on the target exported to a temporary folder."""
    from rapidspec.bench.serve.vllm_peer import (API_SERVER, METHODS, VLLM_COUNTERS, VllmPeerConfig, VllmServer,
                                                 max_model_len, parse_methods, vllm_load)
    from rapidspec.config import DecodeConfig
    from rapidspec.models.export import export_model
    from rapidspec.vllm.environment import require_vllm_python

    if options.gguf is not None or options.parallel != 1:
        raise RapidspecError("--peer-gguf and --peer-parallel apply to --peer llama.cpp")
    python = require_vllm_python()
    methods = parse_methods(options.speculation) if options.speculation else METHODS
    tokens = options.speculative_tokens or DecodeConfig().max_gamma
    threads, extra = options.thread_count(), options.extra_args()
    target = options.model or options.target or "builtin"
    served = config.model or config.extra_body.get("model") or options.target or "builtin"
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rapidspec_bench_serve_vllm_"))) / "model"
    with Console(stderr=True).status(f"exporting {target} for vLLM"):
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
                              extra_args=extra, start_timeout_s=options.server_timeout)
        peers.append(Peer(peer.name, VllmServer(peer), load, [str(python), "-m", API_SERVER, *peer.args()],
                          VLLM_COUNTERS))
    return peers
