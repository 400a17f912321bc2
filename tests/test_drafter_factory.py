"""The drafter contract: every kind follows the Drafter protocol, and the factory picks the kind by mode."""

from __future__ import annotations

import pytest
import torch

from rapidspec import ModelSpec, Rapid
from rapidspec.config import DecodeConfig
from rapidspec.drafting import Drafter, ModelDrafter
from rapidspec.drafting.factory import DrafterFactory
from rapidspec.drafting.lookup import LookupDrafter
from rapidspec.errors import RapidspecError
from rapidspec.stats import GenerationStats
from tests.specs import spec_of

DOCUMENT = "The ferry leaves the harbour at nine. " * 40


@pytest.mark.parametrize(("mode", "kind"), [("lc", None), ("rag", None), ("lookup", LookupDrafter),
                                            ("ragsd", ModelDrafter), ("rapid", ModelDrafter)])
def test_the_factory_gives_each_mode_its_drafter_kind(tiny_model, mode, kind):
    engine = Rapid(spec_of(drafter_backend="torch"), target=tiny_model)
    config, _ = engine.resolve(DecodeConfig(mode=mode, max_new_tokens=4, drafter_start="first"))  # with the drafter's prompt
    prompts = engine.document_prompts(DOCUMENT, "When does the ferry leave?", config)
    stats = GenerationStats.starting(config, prompts)
    drafter = engine.drafting.start(prompts, config, stats, torch.device("cpu"))
    if kind is None:
        assert drafter is None
        return
    assert isinstance(drafter, kind) and isinstance(drafter, Drafter)  # the engine needs nothing else
    assert drafter.sequence == list(prompts.drafter_ids)
    proposal = drafter.propose(3, config, torch.Generator(), frozenset())
    assert len(proposal.tokens) <= 3
    drafter.commit(proposal.tokens[:1])
    drafter.close()
    assert stats.drafter == ("lookup" if mode == "lookup" else engine.drafter_label)


def test_the_factory_decides_backend_and_relation_once(tiny_model, other_tiny_model):
    factory = DrafterFactory(tiny_model, other_tiny_model, ModelSpec(drafter_backend="auto"))
    assert factory.backend == "torch"  # the tiny models have no GGUF file
    assert factory.relation == "larger" and factory.model is other_tiny_model
    assert factory.pool("auto") is factory.pool("torch")  # one pool per backend
    assert factory.max_context(DecodeConfig(mode="lc")) is None
    with pytest.raises(RapidspecError, match="drafter_threads"):  # the spec's models section refuses it
        DrafterFactory(tiny_model, None, ModelSpec(drafter_threads=0))
