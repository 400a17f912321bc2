"""Which drafter the vLLM proposer uses, and the pool its per-request drafters come from.

The drafter is ``ProposerOptions.drafter`` when given, else what
``rapidspec.json`` in vLLM's model folder names (``rapidspec models export``
writes it: the GGUF file the folder was made from, else the model's rapidspec
name), else vLLM's model folder itself. On a CPU a drafter with a GGUF file
drafts on llama.cpp, chosen by rapidspec's own engine's rule
(:func:`rapidspec.models.backend.choose_backend`); elsewhere torch loads it
on vLLM's device.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import torch

from rapidspec.config import DEFAULT_PREFILL_CHUNK_TOKENS
from rapidspec.drafting.backends import LlamaCppDrafters, TorchDrafters
from rapidspec.errors import RapidspecError
from rapidspec.models.backend import choose_backend
from rapidspec.models.loading import resolve_source
from rapidspec.runtime.llama_cpp import llama_cpp_available
from rapidspec.runtime.threads import compute_threads

logger = logging.getLogger(__name__)

#: What ``rapidspec models export`` writes beside the weights.
EXPORT_RECORD = "rapidspec.json"


def drafter_source(chosen: str | None, folder: Path) -> str:
    """The drafter's model name or path (module docstring)."""
    if chosen:
        return chosen
    record = folder / EXPORT_RECORD
    if record.is_file():
        try:
            found = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise RapidspecError(f"cannot read {record}: {err}") from None
        gguf = found.get("gguf") if isinstance(found, dict) else None
        if isinstance(gguf, str) and Path(gguf).is_file():
            return gguf
        name = found.get("model") if isinstance(found, dict) else None
        if isinstance(name, str) and name.strip():
            return name
    return str(folder)


def drafter_pool(options, folder: Path, tokenizer, device: torch.device):
    """The :class:`~rapidspec.drafting.backends.DrafterPool` of the drafter ``options`` and ``folder`` name."""
    source = drafter_source(options.drafter, folder)
    name = "self" if Path(source) == folder else Path(source).name
    if options.drafter_backend == "llama.cpp" and not llama_cpp_available():
        raise RapidspecError("drafter backend 'llama.cpp' needs llama-cpp-python in vLLM's venv (`make vllm`)")
    # the engine's choice (rapidspec.models.backend), for a target on vLLM's device and the drafter named
    if choose_backend(options.drafter_backend, SimpleNamespace(device=device), source) == "llama.cpp":
        return LlamaCppDrafters(resolve_source(source)[1], options.drafter_threads or compute_threads(), tokenizer,
                                name)
    from rapidspec.models import load_model
    from rapidspec.models.vocabulary import check_same_vocabulary

    loaded = load_model(source, device=device)
    check_same_vocabulary(tokenizer, loaded.tokenizer)
    return TorchDrafters(loaded, DEFAULT_PREFILL_CHUNK_TOKENS, name)
