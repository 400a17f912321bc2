"""eval --logprobs K, the drafter's own row, and benchmarks/offline_eta.py reproducing recorded rapid answers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rapidspec.errors import RapidspecError
from rapidspec.evaluation.datasets import load_items
from rapidspec.evaluation.runner import run_eval
from rapidspec.evaluation.variants import parse_eval_sweep
from tests.test_eval_datasets import write_leval
from tests.test_eval_runner import RETRIEVAL

_SPEC = importlib.util.spec_from_file_location("offline_eta", Path(__file__).parents[1] / "benchmarks" / "offline_eta.py")
offline_eta = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(offline_eta)


@pytest.fixture()
def items(tmp_path):
    return load_items(write_leval(tmp_path / "quality.jsonl"))


def run(items, target, tmp_path, **options):
    options = {"retrieval": RETRIEVAL, "modes": ("lc", "rag", "rapid"), "max_new_tokens": 6,
               "results": tmp_path / "results.jsonl", "progress": False, "logprobs": 20,
               "sweep": parse_eval_sweep("eta=0,50,500"), **options}
    result = run_eval(items, target, **options)
    return result, [json.loads(line) for line in options["results"].read_text(encoding="utf-8").splitlines()]


def top1(rows):
    return [row[0][0] for row in rows]


def test_views_reproduce_each_greedy_answer(items, tiny_model, other_tiny_model, tmp_path):
    # every rapid token from p^ (the walk's assumption): no plain round of the cost schedule
    result, records = run(items, tiny_model, tmp_path, drafter=other_tiny_model,
                          decode_options={"gamma_schedule": "constant"})
    modes = [r["mode"] for r in records[: len(records) // len(items)]]
    assert modes == ["lc", "rag", "rapid", "rapid", "rapid", "drafter"]  # the drafter's own answer, named as such
    assert records[0]["config"]["logprobs"] == 20
    for record in records:
        lp = record["logprobs"]
        assert set(lp["views"]) == {"lc", "rag", "drafter"} and lp["top"] == 20
        positions = len(lp["tokens"])
        assert 1 <= positions <= 4 and all(len(rows) == positions for rows in lp["views"].values())
        for position in range(positions):  # every view holds the union of the views' top-20 ids
            ids = [sorted(i for i, _ in rows[position]) for rows in lp["views"].values()]
            assert all(i == ids[0] for i in ids) and 20 <= len(ids[0]) <= 60
            assert all(rows[position][0][1] >= rows[position][-1][1] for rows in lp["views"].values())
        answer = [t for t in lp["tokens"] if t is not None]
        if record["stats"]["stop_reason"] == "length":
            assert None not in lp["tokens"]
        # Teacher forcing gives back what greedy decoding chose: each view's top token is its own answer's token.
        own = {"lc": "lc", "rag": "rag", "drafter": "drafter"}.get(record["mode"])
        if own is not None:
            chosen = top1(lp["views"][own])
            assert chosen[: len(answer)] == answer
            if None in lp["tokens"]:  # ended: the next top token ends the answer
                assert chosen[len(answer)] in lp["eos"]
        assert all(str(t) in lp["text"] for t in answer)
    # The offline walk reproduces every rapid record at every eta (eta = 0: lc's tokens; 500: the drafter's pull).
    assert any(r["logprobs"]["tokens"] != records[i - 4]["logprobs"]["tokens"]
               for i, r in enumerate(records) if r["mode"] == "rapid" and r["eta"] == 500)
    matched, total = offline_eta.reproduction(records)
    assert total == 3 * len(items) and matched == total
    rows = offline_eta.evaluate(records, [0.0, 500.0], ["paper", "confident", "t0.5"], alpha=0.1)
    assert [(r["rule"], r["eta"]) for r in rows] == [(rule, eta) for rule in ("paper", "confident", "t0.5")
                                                     for eta in (0.0, 500.0)]
    assert all(r["n"] + r["undetermined"] == len(items) for r in rows)


def test_self_speculation_has_no_drafter_row_or_view(items, tiny_model, tmp_path):
    _, records = run(items, tiny_model, tmp_path)
    assert {r["mode"] for r in records} == {"lc", "rag", "rapid"}
    assert all(set(r["logprobs"]["views"]) == {"lc", "rag"} for r in records)


def test_logprobs_bounds_and_off(items, tiny_model, tmp_path):
    with pytest.raises(RapidspecError, match="logprobs"):
        run(items, tiny_model, tmp_path, logprobs=21)
    _, records = run(items[:1], tiny_model, tmp_path, logprobs=0, results=tmp_path / "off.jsonl")
    assert records and not any("logprobs" in r for r in records) and "logprobs" not in records[0]["config"]
