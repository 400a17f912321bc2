"""The peer of ``rapidspec bench serve --peer llama.cpp``: llama.cpp's ``llama-server`` on the target's GGUF.

:class:`PeerConfig` holds what the peer runs with: the same GGUF file the
target was read from, the same threads, slots for the load's concurrency and
a context that holds every request's prompt and answer in each slot.
:func:`peer_load` turns the load into into what ``llama-server`` reads: the
documents placed in the conversation exactly as rapidspec's target reads them
(:meth:`BenchRequest.inlined_messages`), rapidspec's own fields
(``mode``, ``eta``, ...) left out, greedy unless the request says otherwise
(rapidspec's default; llama-server's would sample at 0.8).

The settings, and why (docs/bench_serve.md has the measurements):

* ``--parallel N --kv-unified``: N slots sharing one key/value buffer of
  N x the slot context, continuous batching (llama-server's default): every
  running request is one row of each decode batch.
* ``--cache-reuse 256`` with the prompt cache (on by default): a request whose
  prompt starts like a slot's cached one reuses that prefix.
* ``-b 2048 -ub 512``, flash attention off: llama.cpp's defaults for batch
  sizes; prefill on 2 cores does not gain from larger ones, and flash
  attention decodes 2-3% slower here (docs/speed.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from rapidspec.bench.serve.dataset import BenchRequest
from rapidspec.bench.serve.load import LoadConfig
from rapidspec.bench.serve.process import LocalServer
from rapidspec.errors import RapidspecError

#: Body fields llama-server understands as rapidspec does; the others of --extra-body are rapidspec's own.
SHARED_FIELDS = frozenset({"temperature", "top_p", "seed", "stop", "model", "ignore_eos"})
PENALTIES = frozenset({"frequency_penalty", "presence_penalty", "repetition_penalty"})
CONTEXT_QUANTUM = 256
SLOT_MARGIN_TOKENS = 64


@dataclass(frozen=True)
class PeerConfig:
    """``llama-server`` on ``gguf`` with ``threads`` threads, ``parallel`` slots of ``slot_context`` tokens."""

    binary: Path
    gguf: Path
    threads: int
    parallel: int
    slot_context: int
    extra_args: tuple[str, ...] = ()
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 60.0
    api_key: str | None = field(default=None, repr=False)  # always None: the peer listens on 127.0.0.1 without a key

    def __post_init__(self) -> None:
        if not self.gguf.is_file():
            raise RapidspecError(f"the peer's GGUF file {self.gguf} does not exist")
        if self.threads < 1 or self.parallel < 1 or self.slot_context < 1:
            raise RapidspecError("the peer needs threads, slots and a context of at least 1")
        if any(arg.split("=")[0] in ("--host", "--port", "-m", "--model") for arg in self.extra_args):
            raise RapidspecError("--peer-args may not set the host, port or model: bench serve chooses them")

    @property
    def context(self) -> int:
        return self.parallel * self.slot_context

    def args(self) -> list[str]:
        return ["-m", str(self.gguf), "-t", str(self.threads), "-tb", str(self.threads),
                "--parallel", str(self.parallel), "--kv-unified", "-c", str(self.context),
                "--cache-reuse", "256", "-b", "2048", "-ub", "512", "-fa", "off",
                "--no-webui", "--jinja", *self.extra_args]


class PeerServer(LocalServer):
    """``llama-server`` in a subprocess on 127.0.0.1 (started, waited for and stopped as ``rapidspec serve`` is)."""

    name = "llama-server"

    def command(self, port: int) -> list[str]:
        return [str(self.config.binary), "--host", "127.0.0.1", "--port", str(port), *self.config.args()]


def slot_context(tokenizer, requests: list[BenchRequest], answer_tokens: int) -> int:
    """Tokens one slot needs: the longest prompt (as the peer reads it) + the longest answer + a margin."""
    from rapidspec.conversation import parse_messages, render

    longest = max(len(render(tokenizer, parse_messages(r.inlined_messages()))) for r in requests)
    needed = longest + answer_tokens + SLOT_MARGIN_TOKENS
    return math.ceil(needed / CONTEXT_QUANTUM) * CONTEXT_QUANTUM


def peer_load(config: LoadConfig) -> LoadConfig:
    """The load for the peer: the same requests with the documents in the messages, greedy unless
    --extra-body says otherwise, and only the --extra-body fields llama-server shares."""
    penalties = sorted(PENALTIES & set(config.extra_body))
    if penalties:  # llama-server's count the last repeat_last_n tokens it accepted, not the prompt and answer
        raise RapidspecError(f"{', '.join(penalties)} cannot be compared with llama-server (its penalties count "
                             "another window of tokens); leave them out with --peer")
    shared = {k: v for k, v in config.extra_body.items() if k in SHARED_FIELDS}
    return replace(config, extra_body={"temperature": 0.0} | shared, inline_documents=True)
