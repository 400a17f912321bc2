"""Which drafter the vLLM proposer uses, and the pool its per-request drafters come from.

The drafter is ``ProposerOptions.drafter`` when given, else what
``rapidspec.json`` in vLLM's model folder names (``rapidspec models export``
writes it: the GGUF file the folder was made from, else the model's rapidspec
name), else vLLM's model folder itself. On a CPU a drafter with a GGUF file
drafts on llama.cpp, chosen and made as rapidspec's own engine does
(:func:`rapidspec.drafting.factory.new_pool`); elsewhere torch loads it
on vLLM's device.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import torch

from rapidspec.drafting.factory import new_pool
from rapidspec.errors import RapidspecError
from rapidspec.models.spec import ModelSpec
from rapidspec.runtime.llama_cpp import llama_cpp_available

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
    """The :class:`~rapidspec.drafting.backends.DrafterPool` of the drafter ``options`` and ``folder`` name, made
    where an engine's are (:func:`rapidspec.drafting.factory.new_pool`), for a target on vLLM's ``device``."""
    source = drafter_source(options.drafter, folder)
    if options.drafter_backend == "llama.cpp" and not llama_cpp_available():
        raise RapidspecError("drafter backend 'llama.cpp' needs llama-cpp-python in vLLM's venv (`make vllm`)")

    def torch_model():
        from rapidspec.models import load_model
        from rapidspec.models.vocabulary import check_same_vocabulary

        loaded = load_model(source, device=device)
        check_same_vocabulary(tokenizer, loaded.tokenizer)
        return loaded

    spec = ModelSpec(drafter_backend=options.drafter_backend, drafter_threads=options.drafter_threads)
    return new_pool(options.drafter_backend, SimpleNamespace(device=device), source, tokenizer, spec, torch_model,
                    name="self" if Path(source) == folder else Path(source).name)
