"""The evaluation loop on a tiny model: records, summary, and resume without loss or repeats."""

from __future__ import annotations

import json

import pytest

from rapidspec.errors import RapidspecError
from rapidspec.evaluation.datasets import load_items
from rapidspec.evaluation.runner import record_key, run_eval, summarize
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
    assert all(r["eta"] == 2.0 and r["gamma"] == 6 for r in rapid)
    assert all(r["eta"] == 0.0 and r["gamma"] is None for r in records if r["mode"] == "lc")
    rows = {(row.group, row.mode): row for row in result.summary}
    assert set(rows) == {(g, m) for g in ("leval/quality", "longbench2") for m in MODES}
    row = rows[("leval/quality", "rapid")]
    assert row.n == 3 and row.metric == "accuracy" and row.ci_low <= row.mean <= row.ci_high
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
    assert sorted((r["eta"], r["gamma"]) for r in records if r["mode"] == "rapid") == [(0.5, 3), (2.0, 6)]


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


def test_bad_arguments(items, tiny_model):
    with pytest.raises(RapidspecError, match="unknown mode"):
        run(items, tiny_model, None, modes=("fast",))
    with pytest.raises(RapidspecError, match="no items"):
        run([], tiny_model, None)
    with pytest.raises(RapidspecError, match="unique"):
        run([items[0], items[0]], tiny_model, None)
