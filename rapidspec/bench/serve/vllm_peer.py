"""The peers of ``rapidspec bench serve --peer vllm``: vLLM's own OpenAI server, three times, on the target.

After rapidspec's run the same load goes to three vLLM servers, one after the
other (never two at once: they would share the CPU), each started from vLLM's
venv (:func:`rapidspec.vllm.environment.require_vllm_python`, environment
:func:`~rapidspec.vllm.environment.vllm_env`) on the target exported as a
Hugging Face folder (:func:`rapidspec.models.export.export_model`):

* ``vllm``: no speculation;
* ``vllm-ngram``: vLLM's prompt-lookup drafter, ``{"method": "ngram",
  "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``
  (the lookup lengths of vLLM's speculative decoding guide);
* ``vllm-rapid``: RAPID's drafter as a vLLM proposer,
  ``{"method": "custom_class", "model": "rapidspec.vllm.RapidProposer",
  "num_speculative_tokens": K}`` (its options from ``$RAPIDSPEC_VLLM_OPTIONS``,
  its drafter from the ``rapidspec.json`` the export writes).

K is rapidspec's default ``max_gamma`` unless ``--peer-speculative-tokens``
says otherwise. Each server listens on 127.0.0.1 with ``--max-model-len`` the
longest prompt + the longest answer + K + a margin, ``--max-num-seqs`` the
load's concurrency, ``--enforce-eager`` (no graphs to capture on a CPU) and
the OpenMP threads of rapidspec's run (``VLLM_CPU_OMP_THREADS_BIND`` on the
first cores this process may use, none kept back for its scheduler:
``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), and what ``vllm_env`` sets (the Intel
OpenMP library of vLLM's venv in ``LD_PRELOAD``, among others). Its counters (:data:`VLLM_COUNTERS`) are
read from ``/metrics`` before and after the load: drafted, accepted tokens and
drafting rounds give the acceptance rate and the mean accepted length.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from rapidspec.bench.serve.load import LoadConfig
from rapidspec.bench.serve.process import HOST, LocalServer
from rapidspec.errors import RapidspecError

#: The vLLM servers ``--peer vllm`` runs, by the name of their speculation.
METHODS = ("none", "ngram", "rapid")
#: The name of each one's column and JSON entry.
SERVER_NAMES = {"none": "vllm", "ngram": "vllm-ngram", "rapid": "vllm-rapid"}
#: Prompt lookup lengths of vLLM's ngram drafter (its speculative decoding guide's example).
NGRAM_LOOKUP = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
PROPOSER = "rapidspec.vllm.RapidProposer"
API_SERVER = "vllm.entrypoints.openai.api_server"
#: Counters of vLLM's /metrics read before and after the load (the keys of rapidspec's where they mean the same).
VLLM_COUNTERS = {
    "generation_tokens": "vllm:generation_tokens_total",
    "prefix_cache_hit_tokens": "vllm:prefix_cache_hits_total",
    "prefix_cache_query_tokens": "vllm:prefix_cache_queries_total",
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
#: Body fields vLLM reads as rapidspec does (its penalties count the same tokens: rapidspec.verification.penalties).
SHARED_FIELDS = frozenset({"temperature", "top_p", "top_k", "seed", "stop", "model", "ignore_eos",
                           "frequency_penalty", "presence_penalty", "repetition_penalty"})
#: A line that is an exception's name and message (alone or logged as an ERROR), and vLLM's own wrappers of the
#: cause (not the cause).
_ERROR = re.compile(r"^(?:\(.*?\) ERROR .*?\] )?([A-Z]\w*(?:Error|Exception): .*)")
_GENERIC = re.compile(r"(Engine core|WorkerProc) initialization failed|EngineCore failed to start")
LENGTH_MARGIN_TOKENS = 64
LENGTH_QUANTUM = 256
#: Options bench serve sets itself.
CHOSEN = ("--host", "--port", "--model", "--served-model-name", "--speculative-config", "--speculative_config")


def speculative_config(method: str, tokens: int) -> dict | None:
    """vLLM's ``--speculative-config`` for ``method`` (None: no speculation)."""
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": tokens, **NGRAM_LOOKUP}
    if method == "rapid":
        return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": tokens}
    raise RapidspecError(f"unknown vLLM speculation {method!r}: one of {', '.join(METHODS)}")


def parse_methods(text: str) -> tuple[str, ...]:
    """``--peer-speculation``: a comma-separated subset of :data:`METHODS`, in the order given."""
    methods = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [m for m in methods if m not in METHODS]
    if not methods or unknown or len(set(methods)) != len(methods):
        raise RapidspecError(f"--peer-speculation takes distinct names among {', '.join(METHODS)}, got {text!r}")
    return methods


@dataclass(frozen=True)
class VllmPeerConfig:
    """vLLM's OpenAI server on ``model`` (a Hugging Face folder) with ``python`` (its venv's), one speculation."""

    python: Path
    model: Path
    served_name: str
    max_model_len: int
    max_num_seqs: int
    threads: int
    method: str = "none"
    speculative_tokens: int = 16
    extra_args: tuple[str, ...] = ()
    start_timeout_s: float = 600.0
    stop_timeout_s: float = 60.0
    api_key: str | None = field(default=None, repr=False)  # always None: it listens on 127.0.0.1 without a key

    def __post_init__(self) -> None:
        if min(self.max_model_len, self.max_num_seqs, self.threads, self.speculative_tokens) < 1:
            raise RapidspecError("vLLM needs a length, sequences, threads and speculative tokens of at least 1")
        speculative_config(self.method, self.speculative_tokens)  # checks the name
        if any(arg.split("=")[0] in CHOSEN for arg in self.extra_args):
            raise RapidspecError("--peer-args may not set the host, port, model, served name or speculative "
                                 "config: bench serve chooses them")

    @property
    def name(self) -> str:
        return SERVER_NAMES[self.method]

    def args(self) -> list[str]:
        """The server's arguments after ``python -m vllm.entrypoints.openai.api_server`` (not the host or port)."""
        args = ["--model", str(self.model), "--served-model-name", self.served_name,
                "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
                "--enforce-eager", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
        spec = speculative_config(self.method, self.speculative_tokens)
        if spec is not None:
            args += ["--speculative-config", json.dumps(spec)]
        return [*args, *self.extra_args]

    def command(self, port: int) -> list[str]:
        return [str(self.python), "-m", API_SERVER, "--host", HOST, "--port", str(port), *self.args()]

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """:func:`vllm_env` with rapidspec's threads (unless already set)."""
        from rapidspec.vllm.environment import vllm_env

        return vllm_env(base, threads=self.threads)


class VllmServer(LocalServer):
    """vLLM's OpenAI server in a subprocess on 127.0.0.1, in a process group of its own (its engine core is a
    child process), started, waited for and stopped as ``rapidspec serve`` is."""

    own_group = True

    def __init__(self, config: VllmPeerConfig) -> None:
        super().__init__(config)
        self.name = config.name

    def command(self, port: int) -> list[str]:
        return self.config.command(port)

    def environment(self) -> dict[str, str]:
        return self.config.environment()

    def last_log_line(self) -> str:
        """The first error of the log (vLLM's engine core logs the cause, then the server a generic error), else
        its last line."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                found = [m.group(1) for line in f if (m := _ERROR.search(line)) and not _GENERIC.search(line)]
        except OSError:
            found = []
        return found[0].strip() if found else super().last_log_line()


def max_model_len(tokenizer, requests, answer_tokens: int, speculative_tokens: int) -> int:
    """Tokens a request needs: the longest prompt (as vLLM reads it) + the longest answer + K + a margin."""
    from rapidspec.prompting.conversation import parse_messages, render

    longest = max(len(render(tokenizer, parse_messages(r.inlined_messages()))) for r in requests)
    needed = longest + answer_tokens + speculative_tokens + LENGTH_MARGIN_TOKENS
    return -(-needed // LENGTH_QUANTUM) * LENGTH_QUANTUM


def vllm_load(config: LoadConfig, served_name: str) -> LoadConfig:
    """The load for vLLM: the same requests with the documents in the messages as rapidspec's target reads them,
    the served model's name, greedy unless --extra-body says otherwise, and only the fields vLLM shares."""
    shared = {k: v for k, v in config.extra_body.items() if k in SHARED_FIELDS and k != "model"}
    return replace(config, api_key=None, model=served_name, inline_documents=True,
                   extra_body={"temperature": 0.0} | shared)
