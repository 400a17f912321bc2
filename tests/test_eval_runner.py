"""The evaluation loop on a tiny model: records, summary, and resume without loss or repeats."""

from __future__ import annotations

import json

import pytest

from rapidspec.drafting.eta_default import DEFAULT_ETA
from rapidspec.errors import RapidspecError
from rapidspec.evaluation.datasets import load_items
from rapidspec.evaluation.runner import record_key, retrieval_corpora, run_eval, summarize
from rapidspec.evaluation.variants import parse_eval_sweep
from rapidspec.retrieval import RetrievalConfig
from tests.test_eval_datasets import write_leval, write_longbench2

RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=64, budget_tokens=128)
MODES = ("lc", "rag", "rapid")


class Interrupt(Exception):
    pass


@pytest.fixture()
def items(tmp_path):
    return load_items(write_leval(tmp_path / "quality.jsonl")) + load_items(write_longbench2(tmp_path / "lb.json", n=1))


def run(items, model, results, **options):
    options = {"retrieval": RETRIEVAL, "modes": MODES, "max_new_tokens": 4, "results": results, "progress": False,
               **options}
    return run_eval(items, model, **options)


def read(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def keys(records):
    return [record_key(r["id"], r["mode"], r["eta"], r["gamma"]) for r in records]


def test_records_and_summary(items, tiny_model, tmp_path):
    path = tmp_path / "results.jsonl"
    result = run(items, tiny_model, path)
    records = read(path)
    assert len(records) == len(items) * len(MODES) == result.new_records
    assert [(r["id"], r["mode"]) for r in records] == [(i.id, m) for i in items for m in MODES]  # item, then mode
    first = records[0]
    assert {"prediction", "gold", "score", "metrics", "stats", "config"} <= first.keys()
    assert first["stats"]["new_tokens"] <= 4
    rapid = [r for r in records if r["mode"] == "rapid"]
    assert all(r["eta"] == DEFAULT_ETA["self"] and r["gamma"] == 6 for r in rapid)
    assert all(r["eta"] == 0.0 and r["gamma"] is None for r in records if r["mode"] == "lc")
    rows = {(row.group, row.mode): row for row in result.summary}
    assert set(rows) == {(g, m) for g in ("leval/quality", "longbench2") for m in MODES}
    row = rows[("leval/quality", "rapid")]
    assert row.n == 3 and row.metric == "choice_accuracy" and row.ci_low <= row.mean <= row.ci_high
    assert row.speed["mean_accepted_length"] is not None
    # The second question of a document reuses the first one's target cache.
    lc = [r for r in records if r["mode"] == "lc"]
    assert lc[1]["stats"]["target_prefill_reused_tokens"] > 0


def test_resume_after_interruption_loses_and_repeats_nothing(items, tiny_model, tmp_path):
    path = tmp_path / "results.jsonl"
    seen = []

    def interrupt_after_five(record):
        seen.append(record)
        if len(seen) == 5:
            raise Interrupt

    with pytest.raises(Interrupt):
        run(items, tiny_model, path, on_record=interrupt_after_five)
    assert len(read(path)) == 5
    result = run(items, tiny_model, path)
    records = read(path)
    assert result.skipped == 5 and result.new_records == len(items) * len(MODES) - 5
    assert len(keys(records)) == len(set(keys(records))) == len(items) * len(MODES)
    assert records[:5] == seen  # what was written before the interruption is kept as it was
    # A third run has nothing left to do.
    again = run(items, tiny_model, path)
    assert again.new_records == 0 and len(read(path)) == len(records)
    assert [r.to_dict() for r in again.summary] == [r.to_dict() for r in summarize(records)]


def test_resume_drops_a_partial_last_line(items, tiny_model, tmp_path):
    path = tmp_path / "results.jsonl"
    run(items[:1], tiny_model, path)
    complete = path.read_text(encoding="utf-8")
    lines = complete.splitlines(keepends=True)
    path.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2], encoding="utf-8")  # killed mid-write
    result = run(items[:1], tiny_model, path)
    assert result.skipped == 2 and result.new_records == 1
    assert keys(read(path)) == keys([json.loads(line) for line in lines])


def test_new_eta_or_gamma_adds_rapid_records_only(items, tiny_model, tmp_path):
    path = tmp_path / "results.jsonl"
    run(items[:1], tiny_model, path)
    result = run(items[:1], tiny_model, path, eta=0.5, gamma=3)
    assert result.new_records == 1  # lc and rag do not depend on eta or gamma
    records = read(path)
    assert sorted((r["eta"], r["gamma"]) for r in records if r["mode"] == "rapid") == sorted([(0.5, 3), (DEFAULT_ETA["self"], 6)])


def test_config_mismatch_is_an_error_unless_overwrite(items, tiny_model, tmp_path):
    path = tmp_path / "results.jsonl"
    run(items[:1], tiny_model, path, modes=("lc",))
    with pytest.raises(RapidspecError, match="max_new_tokens"):
        run(items[:1], tiny_model, path, modes=("lc",), max_new_tokens=5)
    result = run(items[:1], tiny_model, path, modes=("lc",), max_new_tokens=5, overwrite=True)
    assert result.new_records == 1 and len(read(path)) == 1
    path.write_text("not json\n", encoding="utf-8")
    with pytest.raises(RapidspecError, match="not JSON"):
        run(items[:1], tiny_model, path, modes=("lc",), max_new_tokens=5)


def test_resume_needs_the_same_models_backend_and_decode_knobs(items, tiny_model, tmp_path):
    from dataclasses import replace

    import torch

    path = tmp_path / "results.jsonl"
    run(items[:1], tiny_model, path, modes=("lc",))
    stored = read(path)[0]["config"]
    assert stored["target"]["dtype"] == "float32" and stored["drafter_backend"] == "torch"
    assert stored["decode"]["top_p"] == 1.0 and stored["decode"]["residual"] == "exact"
    other_dtype = replace(tiny_model, dtype=torch.bfloat16)  # only the description matters before a run
    changes = [
        ({"target": other_dtype}, 'target.dtype: "float32" -> "bfloat16"'),
        ({"target": replace(tiny_model, quantization="int8")}, "target.quantization"),
        ({"drafter": replace(tiny_model, name="other")}, "drafter"),
        ({"decode_options": {"top_p": 0.9}}, "decode.top_p: 1.0 -> 0.9"),
        ({"decode_options": {"draft_gate": 0.0}}, "decode.draft_gate"),
        ({"decode_options": {"gamma_schedule": "heuristic"}}, "decode.gamma_schedule"),
    ]
    for change, named in changes:
        options = {"modes": ("lc",), **change}
        model = options.pop("target", tiny_model)
        with pytest.raises(RapidspecError, match=named.replace(".", r"\.")):
            run(items[:1], model, path, **options)
    assert len(read(path)) == 1  # nothing was merged


def test_bad_arguments(items, tiny_model):
    with pytest.raises(RapidspecError, match="unknown mode"):
        run(items, tiny_model, None, modes=("fast",))
    with pytest.raises(RapidspecError, match="no items"):
        run([], tiny_model, None)
    with pytest.raises(RapidspecError, match="unique"):
        run([items[0], items[0]], tiny_model, None)


def test_a_sweep_multiplies_only_the_modes_that_use_its_knob(items, tiny_model, tmp_path):
    path = tmp_path / "results.jsonl"
    result = run(items[:2], tiny_model, path, sweep=parse_eval_sweep("eta=0,3"))
    records = read(path)
    assert [(r["mode"], r["sweep"]) for r in records[:4]] == [("lc", None), ("rag", None), ("rapid", "eta=0"), ("rapid", "eta=3")]
    assert [r["eta"] for r in records if r["mode"] == "rapid"] == [0.0, 3.0, 0.0, 3.0]
    assert {(row.mode, row.sweep) for row in result.summary} == {("lc", None), ("rag", None), ("rapid", "eta=0"), ("rapid", "eta=3")}
    # more points later: only the new ones run, and the file's configuration still matches
    again = run(items[:2], tiny_model, path, sweep=parse_eval_sweep("eta=0,3,5"))
    assert again.new_records == 2 and again.skipped == 8


def test_a_draft_gate_sweep_runs_rapid_once_per_gate(items, tiny_model, tmp_path, monkeypatch):
    from rapidspec.verification import sampling

    alphas = []
    gate = sampling.draft_gate
    monkeypatch.setattr(sampling, "draft_gate", lambda p, q, alpha: alphas.append(alpha) or gate(p, q, alpha))
    result = run(items[:1], tiny_model, tmp_path / "results.jsonl", modes=("lc", "rapid"), sweep=parse_eval_sweep("draft_gate=0,1"))
    assert [(r["mode"], r["sweep"]) for r in result.records] == [("lc", None), ("rapid", "draft_gate=0"), ("rapid", "draft_gate=1")]
    assert set(alphas) == {0.0, 1.0}  # each point's gate reached the augmented target
    with pytest.raises(RapidspecError, match="draft_gate values must be in"):
        parse_eval_sweep("draft_gate=0.1,2")


def test_a_budget_sweep_gives_the_retrieving_modes_each_budget(items, tiny_model, tmp_path):
    result = run(items[:1], tiny_model, tmp_path / "results.jsonl", sweep=parse_eval_sweep("budget_tokens=64,192"))
    by_run = {(r["mode"], r["sweep"]): r for r in result.records}
    assert set(by_run) == {("lc", None), ("rag", "budget_tokens=64"), ("rag", "budget_tokens=192"),
                           ("rapid", "budget_tokens=64"), ("rapid", "budget_tokens=192")}
    for mode in ("rag", "rapid"):
        small, large = by_run[(mode, "budget_tokens=64")]["stats"], by_run[(mode, "budget_tokens=192")]["stats"]
        assert 0 < small["retrieved_tokens"] <= 64 < large["retrieved_tokens"] <= 192


def test_retrieval_from_another_item_or_a_file(items, tiny_model, tmp_path):
    corpora = retrieval_corpora(items, "other-item")
    for item in items:
        assert corpora[item.id] != item.document and corpora[item.id] in {i.document for i in items}
    other = tmp_path / "other.txt"
    other.write_text("Unrelated: the orchard grew pears and plums.\n\n" * 30, encoding="utf-8")
    assert set(retrieval_corpora(items, str(other)).values()) == {other.read_text(encoding="utf-8")}
    with pytest.raises(RapidspecError, match="two different documents"):
        retrieval_corpora(items[:1], "other-item")
    result = run(items[:1], tiny_model, tmp_path / "results.jsonl", modes=("rapid",), retrieve_from=str(other))
    assert result.records[0]["config"]["retrieve_from"] == str(other)
    assert result.records[0]["retrieved_chunks"] >= 1


def test_chat_form_items_reuse_the_history_across_questions(tiny_model, tmp_path):
    from tests.test_eval_datasets import write_locomo

    items = load_items(write_locomo(tmp_path / "locomo.json"), "locomo-chat")
    result = run(items, tiny_model, tmp_path / "results.jsonl", modes=("lc", "magicdec", "rapid"))
    assert {r["group"] for r in result.records} == {"locomo-chat/cat4", "locomo-chat/cat2", "locomo-chat/cat1"}
    lc = [r for r in result.records if r["mode"] == "lc"]
    assert lc[0]["stats"]["prompt_tokens_target"] > 100
    assert lc[1]["stats"]["target_prefill_reused_tokens"] > 100  # the conversation's cache serves the next question
    rapid = [r for r in result.records if r["mode"] == "rapid"]
    assert all(r["stats"]["rounds"] >= 1 for r in rapid)
    with pytest.raises(RapidspecError, match="chat-form"):
        run(items, tiny_model, None, retrieve_from="other-item")
