"""rapidspec: long-context inference with retrieval-augmented speculative decoding (RAPID).

    from rapidspec import EngineSpec, ModelSpec, Rapid
    engine = Rapid(EngineSpec(ModelSpec(target="builtin")))   # or Rapid(target=load_model(...))
    out = engine.generate(document, question)   # mode rapid, its defaults

Heavy modules (torch, transformers) load on first use of these names.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Rapid": "rapidspec.engine",
    "EngineSpec": "rapidspec.engine",
    "ModelSpec": "rapidspec.models.spec",
    "GenerationOutput": "rapidspec.outputs",
    "StreamChunk": "rapidspec.outputs",
    "PrefixCache": "rapidspec.runtime.prefix_cache",
    "DecodeConfig": "rapidspec.config",
    "GenerationStats": "rapidspec.stats",
    "PromptTemplate": "rapidspec.prompting.prompts",
    "demo_document": "rapidspec.prompting.demo_document",
    "load_model": "rapidspec.models",
    "LoadedModel": "rapidspec.models",
    "low_bit_copy": "rapidspec.models",
    "RapidspecError": "rapidspec.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rapidspec' has no attribute {name!r}")
