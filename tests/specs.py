"""Engine specs for tests, from flat options: the models section's drafter options and the spec's own fields."""

from __future__ import annotations

from dataclasses import fields

from rapidspec import EngineSpec, ModelSpec

_MODEL_FIELDS = {f.name for f in fields(ModelSpec)}


def spec_of(**options) -> EngineSpec:
    """``spec_of(retrieval=..., drafter_backend="torch", kv_cache_gib=0)``: ModelSpec's fields go to ``models``."""
    models = {k: options.pop(k) for k in list(options) if k in _MODEL_FIELDS}
    return EngineSpec(ModelSpec(**models), **options)
