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
* ``speculation`` (``--peer-speculation``): ``none``, llama-server's own
  speculative decoding by n-gram lookup in the context (``ngram``:
  ``--spec-type ngram-mod``) or with a draft model (``draft``:
  ``--spec-type draft-simple -md DRAFT_GGUF``), each a server of its own.
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
#: llama-server's speculation per --peer-speculation name, and each server's name in the report.
SPECULATIONS = {"none": (), "ngram": ("--spec-type", "ngram-mod"), "draft": ("--spec-type", "draft-simple")}
SERVER_NAMES = {"none": "llama.cpp", "ngram": "llama.cpp-ngram", "draft": "llama.cpp-draft"}


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
    speculation: str = "none"  # a key of SPECULATIONS
    draft_gguf: Path | None = None  # the draft model of speculation "draft"

    def __post_init__(self) -> None:
        if not self.gguf.is_file():
            raise RapidspecError(f"the peer's GGUF file {self.gguf} does not exist")
        if self.speculation not in SPECULATIONS:
            raise RapidspecError(f"unknown llama-server speculation {self.speculation!r}: one of {', '.join(SPECULATIONS)}")
        if (self.speculation == "draft") != (self.draft_gguf is not None):
            raise RapidspecError("llama-server's draft speculation needs --peer-draft-gguf FILE, and only it takes one")
        if self.draft_gguf is not None and not self.draft_gguf.is_file():
            raise RapidspecError(f"the peer's draft GGUF file {self.draft_gguf} does not exist")
        if self.threads < 1 or self.parallel < 1 or self.slot_context < 1:
            raise RapidspecError("the peer needs threads, slots and a context of at least 1")
        if any(arg.split("=")[0] in ("--host", "--port", "-m", "--model") for arg in self.extra_args):
            raise RapidspecError("--peer-args may not set the host, port or model: bench serve chooses them")

    @property
    def context(self) -> int:
        return self.parallel * self.slot_context

    @property
    def name(self) -> str:
        return SERVER_NAMES[self.speculation]

    def args(self) -> list[str]:
        draft = ["-md", str(self.draft_gguf)] if self.draft_gguf is not None else []
        return ["-m", str(self.gguf), "-t", str(self.threads), "-tb", str(self.threads),
                "--parallel", str(self.parallel), "--kv-unified", "-c", str(self.context),
                "--cache-reuse", "256", "-b", "2048", "-ub", "512", "-fa", "off",
                "--no-webui", "--jinja", *SPECULATIONS[self.speculation], *draft, *self.extra_args]


def parse_speculations(text: str) -> tuple[str, ...]:
    """``--peer-speculation`` for llama.cpp: a comma-separated subset of :data:`SPECULATIONS`, in the order given."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names or any(n not in SPECULATIONS for n in names) or len(set(names)) != len(names):
        raise RapidspecError(f"--peer-speculation with --peer llama.cpp takes distinct names among "
                             f"{', '.join(SPECULATIONS)}, got {text!r}")
    return names


class PeerServer(LocalServer):
    """``llama-server`` in a subprocess on 127.0.0.1 (started, waited for and stopped as ``rapidspec serve`` is)."""

    name = "llama-server"

    def command(self, port: int) -> list[str]:
        return [str(self.config.binary), "--host", "127.0.0.1", "--port", str(port), *self.config.args()]


def slot_context(tokenizer, requests: list[BenchRequest], answer_tokens: int) -> int:
    """Tokens one slot needs: the longest prompt (as the peer reads it) + the longest answer + a margin."""
    from rapidspec.prompting.conversation import parse_messages, render

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
