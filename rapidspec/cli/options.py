"""Option groups shared by the subcommands; they map one to one onto the config dataclasses."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

from rapidspec.config import (DEFAULT_KV_CACHE_GIB, DEFAULT_PREFIX_CACHE_GIB, DRAFTER_BACKENDS, DRAFTER_GGUF_CHOICES,
                              DRAFTER_PREFILLS, DRAFTER_STARTS, DTYPE_NAMES, GAMMA_SCHEDULES, MODES, QUANTIZATIONS, RUNTIMES,
                              TARGET_QUANTIZATIONS, DecodeConfig)
from rapidspec.errors import RapidspecError
from rapidspec.grammar import Grammar
from rapidspec.retrieval import METHODS, RetrievalConfig
from rapidspec.retrieval.config import EMBEDDING_DTYPES

_DEFAULT_DECODE = DecodeConfig()
_DEFAULT_RETRIEVAL = RetrievalConfig()


def add_model_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models")
    group.add_argument("--target", default="builtin", help="target model: builtin, an HF id or local dir, a .gguf file (default: builtin)")
    group.add_argument("--drafter", default=None, help="drafter model (default: the target's weights, own cache)")
    group.add_argument("--dtype", default="auto", choices=DTYPE_NAMES, help="weights dtype (default: auto)")
    group.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    group.add_argument("--drafter-device", default=None, help="device of the drafter (default: --device)")
    group.add_argument("--quantize", default="auto", choices=TARGET_QUANTIZATIONS,
                       help="target weights: gguf computes with the GGUF file's own low-bit blocks (4-bit as int4, "
                            "others as int8; CPU), none with a float copy, int8 or int4 round the float copy; auto is "
                            "gguf for a GGUF target on the CPU, else none (default: %(default)s)")
    group.add_argument("--drafter-quantize", default="none", choices=QUANTIZATIONS,
                       help="drafter weights: int8, int4 or gguf make a CPU drafter step cheaper; with no --drafter, "
                            "a low-bit copy of the target drafts (default: %(default)s)")
    group.add_argument("--drafter-backend", default=_DEFAULT_DECODE.drafter_backend, choices=DRAFTER_BACKENDS,
                       help="what runs the drafter: llama.cpp (CPU, reads the drafter's GGUF file as it is) or torch; "
                            "auto picks llama.cpp on CPU when it is installed and the drafter has a GGUF file and no "
                            "--drafter-quantize (default: %(default)s)")
    group.add_argument("--drafter-threads", type=int, default=None,
                       help="threads of the llama.cpp drafter (default: torch's thread count)")
    group.add_argument("--drafter-prefill", default="auto", choices=DRAFTER_PREFILLS,
                       help="when a llama.cpp drafter prefills: beside the target's prefill, after it, or auto "
                            "(beside where the CPU has a core to spare per drafter thread beyond torch's; default: auto)")
    group.add_argument("--drafter-gguf", default="auto", choices=DRAFTER_GGUF_CHOICES,
                       help="what a llama.cpp drafter reads: auto (a Q8_0 copy of a Q4_1 file, made once in the cache: "
                            "it prefills about 2x faster on CPU) or as-is (the file itself; default: auto)")
    group.add_argument("--quiet", action="store_true",
                       help="no progress bar for long prefills on stderr (none is shown when stderr is not a terminal)")
    group.add_argument("--runtime", default="auto", choices=RUNTIMES,
                       help="forward of both models: the lean forward of llama/qwen2 models (auto where it exists, lean "
                            "to require it) or transformers' (default: %(default)s)")


#: The frequency penalty of ``rapidspec chat`` and ``rapidspec demo``: on 40 chat-form LoCoMo questions to the built-in
#: model (benchmarks/loops.py, docs/quality.md "Answers that loop"), 14 greedy answers looped without it and one
#: with it; the other commands, the server and the Python API keep OpenAI's 0.
CHAT_FREQUENCY_PENALTY = 0.5


def add_decode_options(parser: argparse.ArgumentParser, modes: bool = True) -> None:
    group = parser.add_argument_group("decoding")
    if modes:
        group.add_argument("--mode", default=_DEFAULT_DECODE.mode, choices=MODES, help="lc, rag, sd, ragsd, rapid, magicdec or lookup (default: rapid)")
    group.add_argument("--eta", type=float, default=None, help="retrieval-augmented target strength (rapid only; default: by how the drafter relates to the target, 1 for self-speculation)")
    group.add_argument("--gamma", type=int, default=_DEFAULT_DECODE.gamma, help="drafted tokens per round (default: %(default)s)")
    group.add_argument("--gamma-schedule", default=_DEFAULT_DECODE.gamma_schedule, choices=GAMMA_SCHEDULES,
                       help="auto (cost); constant; heuristic (adapt gamma to acceptance); cost (choose each round's "
                            "drafts, 0 = a plain step, from the machine's calibrated step costs and the answer's "
                            "acceptance) (default: %(default)s)")
    group.add_argument("--drafter-start", default=_DEFAULT_DECODE.drafter_start, choices=DRAFTER_STARTS,
                       help="auto: the first token is the target's, retrieval and the drafter's prefill run between "
                            "the next rounds while they pay and the drafter joins when ready; first: both before "
                            "the first round, every round drafts (the paper's setting; default: %(default)s)")
    group.add_argument("--max-gamma", type=int, default=_DEFAULT_DECODE.max_gamma, help="largest gamma of the heuristic and cost schedules")
    group.add_argument("--draft-confidence", type=float, default=_DEFAULT_DECODE.draft_confidence,
                       help="stop a round's drafting after a draft the drafter gave a probability below this; 0 = off (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=_DEFAULT_DECODE.temperature, help="0 = greedy (default: 0)")
    group.add_argument("--top-k", type=int, default=_DEFAULT_DECODE.top_k, help="top-k filter, 0 = off")
    group.add_argument("--top-p", type=float, default=_DEFAULT_DECODE.top_p, help="nucleus filter in (0, 1]")
    group.add_argument("--frequency-penalty", type=float, default=_DEFAULT_DECODE.frequency_penalty,
                       help="OpenAI's: lower a token's logit by this times its count in the answer so far, in [-2, 2] "
                            "(default: %(default)s)")
    group.add_argument("--presence-penalty", type=float, default=_DEFAULT_DECODE.presence_penalty,
                       help="OpenAI's: lower a token's logit by this once it is in the answer, in [-2, 2] (default: %(default)s)")
    group.add_argument("--repetition-penalty", type=float, default=_DEFAULT_DECODE.repetition_penalty,
                       help="transformers' and vLLM's: divide (multiply when negative) the logit of a token of the "
                            "prompt or the answer by this; 1 = off (default: %(default)s)")
    group.add_argument("--draft-gate", type=float, default=_DEFAULT_DECODE.draft_gate, help="alpha of the gate q >= alpha*max(q) (default: %(default)s)")
    group.add_argument("--residual", default=_DEFAULT_DECODE.residual, choices=["exact", "paper"], help="resampling rule after a rejection")
    group.add_argument("--max-new-tokens", type=int, default=_DEFAULT_DECODE.max_new_tokens, help="answer length limit (default: %(default)s)")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--seed", type=int, default=None, help="seed for sampling")
    group.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=_DEFAULT_DECODE.ignore_eos,
                       help="keep generating after the end-of-sequence token, up to --max-new-tokens")
    group.add_argument("--sink-tokens", type=int, default=_DEFAULT_DECODE.sink_tokens,
                       help="magicdec: first prompt tokens the drafter keeps (StreamingLLM sinks; default: %(default)s)")
    group.add_argument("--streaming-tokens", type=int, default=_DEFAULT_DECODE.streaming_tokens,
                       help="magicdec: prompt tokens the drafter reads, sinks + the most recent (default: %(default)s)")
    group.add_argument("--truncate", default=_DEFAULT_DECODE.truncate, choices=["middle", "error"], help="what to do with a document longer than the window")
    shape = group.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", default=None,
                       help="the answer is JSON valid under the JSON schema in FILE (drafts and verification constrained)")
    shape.add_argument("--json-object", action="store_true", help="the answer is a JSON object")


def add_retrieval_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("retrieval (drafter context)")
    group.add_argument("--retrieval", default=_DEFAULT_RETRIEVAL.method, choices=METHODS,
                       help="retrieval method (default: auto, i.e. bm25 over a chat's earlier turns, hybrid over documents)")
    group.add_argument("--budget-tokens", type=int, default=None, help="retrieved tokens (default: clamp(doc_tokens // 16, 256, 4096))")
    group.add_argument("--chunk-tokens", type=int, default=_DEFAULT_RETRIEVAL.chunk_tokens, help="tokens per chunk (default: %(default)s)")
    group.add_argument("--embedding-model", default=_DEFAULT_RETRIEVAL.embedding_model, help="sentence-transformers model for dense retrieval (default: builtin MiniLM)")
    group.add_argument("--embedding-dtype", default=_DEFAULT_RETRIEVAL.embedding_dtype, choices=EMBEDDING_DTYPES,
                       help="the embedder's dtype (default: auto, bfloat16 where the device computes in it natively)")
    group.add_argument("--embedding-store-gib", type=float, default=_DEFAULT_RETRIEVAL.embedding_store_gib,
                       help="disk space for chunk embeddings reused across runs by content, in $RAPIDSPEC_CACHE/embeddings "
                            "(least recently used removed beyond it; 0 = off; default: %(default)s)")


def decode_config(args: argparse.Namespace, **overrides) -> DecodeConfig:
    """The DecodeConfig described by parsed options (field names match)."""
    values = {f.name: getattr(args, f.name) for f in fields(DecodeConfig) if hasattr(args, f.name)}
    values["stop"] = tuple(values.get("stop") or ())
    values["grammar"] = _grammar(args)
    values.update(overrides)
    return DecodeConfig(**values)


def _grammar(args: argparse.Namespace):
    """The grammar of ``--json-schema FILE`` or ``--json-object`` (None without them)."""
    if getattr(args, "json_object", False):
        return Grammar.json_object()
    path = getattr(args, "json_schema", None)
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RapidspecError(f"cannot read the JSON schema {path}: {exc}") from None
    return Grammar.json_schema(text, Path(path).stem)


def retrieval_config(args: argparse.Namespace) -> RetrievalConfig:
    return RetrievalConfig(
        method=args.retrieval,
        budget_tokens=args.budget_tokens,
        chunk_tokens=args.chunk_tokens,
        embedding_model=args.embedding_model,
        embedding_dtype=args.embedding_dtype,
        embedding_store_gib=args.embedding_store_gib,
    )


def model_spec(args: argparse.Namespace):
    """The :class:`~rapidspec.models.spec.ModelSpec` the model options name, one to one."""
    from rapidspec.models.spec import ModelSpec

    return ModelSpec(target=args.target, drafter=args.drafter, dtype=args.dtype, device=args.device,
                     drafter_device=args.drafter_device, quantize=args.quantize, drafter_quantize=args.drafter_quantize,
                     runtime=args.runtime, drafter_backend=args.drafter_backend, drafter_threads=args.drafter_threads,
                     drafter_prefill=args.drafter_prefill, drafter_gguf=args.drafter_gguf)


def load_models(args: argparse.Namespace):
    """(target, drafter or None) named by the model options."""
    return model_spec(args).load()


def add_prefix_cache_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix-cache-gib", type=float, default=DEFAULT_PREFIX_CACHE_GIB,
                        help="memory for stored target caches reused by later turns and requests sharing a prefix; "
                             "least recently used evicted, 0 = off (default: %(default)s)")


def add_kv_cache_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-gib", type=float, default=DEFAULT_KV_CACHE_GIB,
                        help="disk space for the target's keys and values of long prompts and a llama.cpp drafter's "
                             "state, read by later processes (a document is read once); least recently used "
                             "removed, all models together, 0 = off (default: %(default)s)")
    parser.add_argument("--kv-cache-dir", default=None, metavar="DIR",
                        help="where they are kept (default: $RAPIDSPEC_KV_CACHE, else $RAPIDSPEC_CACHE/kv)")


def engine_spec(args: argparse.Namespace, reuse_document_cache: bool = True):
    """The :class:`~rapidspec.engine.spec.EngineSpec` the model, drafter, retrieval and key/value cache options
    name, one to one (a command without ``--kv-cache-gib``, such as ``bench``, keeps nothing on disk)."""
    from rapidspec.engine.spec import EngineSpec

    return EngineSpec(model_spec(args), retrieval_config(args), reuse_document_cache=reuse_document_cache,
                      prefix_cache_gib=getattr(args, "prefix_cache_gib", DEFAULT_PREFIX_CACHE_GIB),
                      kv_cache_gib=getattr(args, "kv_cache_gib", 0.0), kv_cache_dir=getattr(args, "kv_cache_dir", None))


def load_engine(args: argparse.Namespace, reuse_document_cache: bool = True):
    """The engine the options name, loaded (:class:`rapidspec.Rapid` of :func:`engine_spec`)."""
    from rapidspec.engine import Rapid

    return Rapid(engine_spec(args, reuse_document_cache))


def json_object(text: str | None, flag: str, example: str) -> dict | None:
    """The JSON object an option holds (None when not given); a RapidspecError naming ``flag`` otherwise."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise RapidspecError(f"{flag} is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise RapidspecError(f"{flag} must be a JSON object, e.g. '{example}'")
    return value
