"""``Rapid(spec, target=..., drafter=..., template=...)``: the one way an engine is made."""

from __future__ import annotations

import pytest

from rapidspec import EngineSpec, ModelSpec, Rapid, RapidspecError
from rapidspec.retrieval import RetrievalConfig


def test_the_spec_builds_the_engine_around_models_passed_in(tiny_model, other_tiny_model):
    spec = EngineSpec(ModelSpec(drafter_backend="torch", drafter_prefill="after", drafter_threads=1),
                      RetrievalConfig(method="bm25", budget_tokens=96), prefill_chunk_tokens=64,
                      reuse_document_cache=False, prefix_cache_gib=0.25, kv_cache_gib=0)
    engine = Rapid(spec, target=tiny_model, drafter=other_tiny_model)
    assert engine.spec is spec and engine.target is tiny_model and engine.drafter is other_tiny_model
    assert engine.drafting.options is spec.models
    assert (engine.drafting.backend, engine.drafting.threads) == ("torch", 1)
    assert engine.retriever.config.budget_tokens == 96 and engine.prefill_chunk_tokens == 64
    assert not engine.reuse_document_cache and engine.disk_store is None
    assert engine.prefix_cache.max_bytes == 2**28


def test_no_spec_loads_the_default_models(tiny_model, monkeypatch):
    from rapidspec.models.spec import ModelSpec as Spec

    asked = []
    monkeypatch.setattr(Spec, "load", lambda self: asked.append(self) or (tiny_model, None))
    engine = Rapid()
    assert asked == [ModelSpec()] and engine.target is tiny_model and engine.drafter is tiny_model


def test_a_loaded_model_in_the_spec_s_place_or_a_drafter_without_its_target_is_refused(tiny_model):
    with pytest.raises(RapidspecError, match="Rapid takes an EngineSpec"):
        Rapid(tiny_model)
    with pytest.raises(RapidspecError, match="needs its target passed in too"):
        Rapid(drafter=tiny_model)
