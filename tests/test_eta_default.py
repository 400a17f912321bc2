"""The default eta by how the drafter relates to the target, and where each output says which eta it used."""

from __future__ import annotations

import logging

import pytest

from rapidspec import Rapid
from rapidspec.config import DecodeConfig
from rapidspec.drafting.eta_default import DEFAULT_ETA, EtaWarnings, drafter_relation, parameter_count, relation
from rapidspec.engine import resolve
from rapidspec.models import low_bit_copy
from tests.conftest import make_tiny_model
from tests.specs import spec_of


@pytest.fixture(scope="module")
def small_and_large(byte_tokenizer):
    return make_tiny_model(2, byte_tokenizer, hidden_size=16), make_tiny_model(3, byte_tokenizer, hidden_size=64)


def test_relation_by_parameter_count():
    assert relation(1000, None) == "self"
    assert relation(1000, 900) == relation(1000, 5000) == "larger"  # at least 90% of the target's size
    assert relation(1000, 899) == "smaller"


def test_drafter_relation_of_models(tiny_model, other_tiny_model, small_and_large):
    small, large = small_and_large
    assert parameter_count(small) < parameter_count(tiny_model) < parameter_count(large)
    assert drafter_relation(tiny_model, None) == drafter_relation(tiny_model, tiny_model) == "self"
    assert drafter_relation(tiny_model, low_bit_copy(tiny_model, "int8", name="self")) == "self"
    assert drafter_relation(tiny_model, other_tiny_model) == "larger"  # the same size, other weights
    assert drafter_relation(tiny_model, large) == "larger"
    assert drafter_relation(tiny_model, small) == "smaller"


def test_resolve_fills_the_default_and_keeps_a_given_eta(caplog):
    rapid = DecodeConfig(mode="rapid", gamma_schedule="constant")
    for kind in ("self", "larger", "smaller"):
        config, why = resolve(rapid, kind)
        assert config.eta == DEFAULT_ETA[kind] and why.startswith("default for")
    config, why = resolve(rapid.with_(eta=0.5), "smaller")
    assert config.eta == 0.5 and why == "given"
    lc = DecodeConfig(mode="lc", gamma_schedule="constant")
    assert resolve(lc, "smaller") == (lc, None)
    # the one step also decides the gamma schedule: auto is cost; the config says what the rounds ran
    assert resolve(DecodeConfig(), "self")[0].gamma_schedule == "cost"
    assert DecodeConfig(mode="lc").eta_value == 0.0 and resolve(DecodeConfig(), "larger")[0].eta_value == DEFAULT_ETA["larger"]
    with pytest.raises(ValueError, match="resolve"):
        DecodeConfig(mode="rapid").eta_value  # an unresolved rapid config has no eta yet
    warnings = EtaWarnings()
    with caplog.at_level(logging.WARNING, logger="rapidspec.drafting.eta_default"):
        for _ in range(3):
            resolve(rapid.with_(eta=DEFAULT_ETA["smaller"] + 3), "smaller", warnings)
        resolve(rapid.with_(eta=DEFAULT_ETA["smaller"]), "smaller", warnings)  # the default itself: no warning
        resolve(rapid.with_(eta=50.0), "self", warnings)  # only a smaller drafter warns
    assert len(caplog.records) == 1 and "smaller than the target" in caplog.records[0].getMessage()


def test_generation_says_which_eta_and_why(tiny_model, small_and_large):
    small, _ = small_and_large
    engine = Rapid(spec_of(drafter_backend="torch"), target=tiny_model, drafter=small)
    assert engine.drafter_relation == "smaller"
    out = engine.generate("The cat sat on the mat. " * 20, "Where did the cat sit?", mode="rapid", max_new_tokens=4)
    assert out.stats.eta == DEFAULT_ETA["smaller"]
    assert out.stats.eta_source == "default for a drafter smaller than the target"
    assert out.to_dict()["stats"]["eta_source"] == out.stats.eta_source
    given = engine.generate("The cat sat on the mat. " * 20, "Where?", mode="rapid", eta=1.0, max_new_tokens=4)
    assert given.stats.eta == 1.0 and given.stats.eta_source == "given"
    plain = engine.generate("The cat sat on the mat. " * 20, "Where?", mode="lc", max_new_tokens=4)
    assert plain.stats.eta == 0.0 and plain.stats.eta_source is None


def test_eval_uses_the_default_of_its_drafter(tiny_model, small_and_large, tmp_path):
    from rapidspec.evaluation.datasets import load_items
    from rapidspec.evaluation.runner import run_eval
    from tests.test_eval_datasets import write_leval
    from tests.test_eval_runner import RETRIEVAL

    items = load_items(write_leval(tmp_path / "quality.jsonl"))[:1]
    result = run_eval(items, tiny_model, drafter=small_and_large[0], retrieval=RETRIEVAL, modes=("lc", "rapid"),
                      max_new_tokens=3, progress=False)
    rapid = [r for r in result.records if r["mode"] == "rapid"]
    assert [r["eta"] for r in rapid] == [DEFAULT_ETA["smaller"]]
    assert rapid[0]["config"]["drafter_relation"] == "smaller"
    assert [r["mode"] for r in result.records] == ["lc", "rapid", "drafter"]


def test_bench_labels_the_eta_its_engine_ran(tiny_model, small_and_large):
    """With a larger drafter and no eta, the rows and the report say 10 (the engine's default), not self's 1."""
    from rapidspec.bench import speed
    from rapidspec.retrieval import RetrievalConfig

    retrieval = RetrievalConfig(method="bm25", chunk_tokens=64, budget_tokens=128)
    engine = Rapid(spec_of(drafter_backend="torch", reuse_document_cache=False, retrieval=retrieval),
                   target=tiny_model, drafter=small_and_large[1])
    assert engine.drafter_relation == "larger" and DEFAULT_ETA["larger"] != DEFAULT_ETA["self"]
    report = speed.run_benchmark(engine, [speed.BenchItem("The cat sat on the mat. " * 20, "Where did the cat sit?")],
                                 ("lc", "rapid"), DecodeConfig(max_new_tokens=3), repeats=1, warmup=False)
    assert report.eta == DEFAULT_ETA["larger"]
    assert [(r.mode, r.eta) for r in report.results] == [("lc", 0.0), ("rapid", DEFAULT_ETA["larger"])]
