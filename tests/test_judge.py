"""The LLM judge of open answers: its prompt, reading its rating, and its place in records and summaries."""

from __future__ import annotations

import json

import pytest

import rapidspec.cli.eval as eval_cli
from rapidspec.cli import main
from rapidspec.evaluation.datasets import load_items
from rapidspec.evaluation.judge import Judge, judge_messages, parse_rating
from rapidspec.evaluation.runner import run_eval
from rapidspec.retrieval import RetrievalConfig
from tests.test_eval_datasets import write_locomo

RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=64, budget_tokens=128)


@pytest.mark.parametrize(
    "text, rating",
    [
        ("The answer matches the reference. Rating: [[9]]", 9),
        ("Rating: [[ 3 ]]", 3),
        ("Wrong name. Rating: [[1]].", 1),
        ("[[7.5]]", 7),
        ("Rating: 6", 6),
        ("I would give it 8/10.", 8),
        ("Rating: [[4]] ... on reflection, Rating: [[5]]", 5),  # the last one counts
        ("Rating: [[11]]", None),  # outside the scale
        ("Rating: [[0]]", None),
        ("A fine answer.", None),
        ("", None),
    ],
)
def test_parse_rating(text, rating):
    assert parse_rating(text) == rating


def test_the_prompt_holds_question_reference_and_answer():
    system, user = judge_messages("Who won?", "Ada did.", "Ada")
    assert system["role"] == "system" and "Rating: [[N]]" in system["content"] and "1" in system["content"]
    assert user["role"] == "user"
    assert user["content"].index("Who won?") < user["content"].index("Ada\n") < user["content"].index("Ada did.")
    assert "(empty)" in judge_messages("Q", "  ", "R")[1]["content"]


class FixedJudge:
    """Rates every answer with the next of ``ratings`` (a stand-in with known ratings for the aggregation)."""

    name = "fixed-judge"

    def __init__(self, ratings):
        self.ratings = list(ratings)
        self.asked = []

    def rate(self, question, answer, references):
        self.asked.append((question, answer, references))
        rating = self.ratings.pop(0)
        return {"judge": self.name, "judge_rating": rating, "judge_output": f"Rating: [[{rating}]]"}


def test_records_and_summary_carry_the_judge(tiny_model, tmp_path):
    items = load_items(write_locomo(tmp_path / "locomo.json"))[:3]
    judge = FixedJudge([8, None, 5])
    result = run_eval(items, tiny_model, retrieval=RETRIEVAL, modes=("lc",), max_new_tokens=3,
                      results=tmp_path / "r.jsonl", progress=False, judge=judge)
    assert [q for q, _, _ in judge.asked] == [item.question for item in items]
    assert [refs for _, _, refs in judge.asked] == [item.answers for item in items]
    ratings = [r["metrics"]["judge_rating"] for r in result.records]
    assert ratings == [8, None, 5] and all(r["config"]["judge"] == "fixed-judge" for r in result.records)
    (row,) = result.summary
    assert (row.extra["judge"], row.extra["judge_rating"], row.extra["judge_unrated"]) == ("fixed-judge", 6.5, 1)
    assert row.metric == "locomo_f1"


def test_a_model_judge_rates_through_the_engine(tiny_model, tmp_path, monkeypatch, capsys):
    judge = Judge(tiny_model, max_new_tokens=8)
    verdict = judge.rate("What is Ann's cat called?", "Biscuit", ("Biscuit",))
    assert verdict["judge"] == tiny_model.name and verdict["judge_rating"] == parse_rating(verdict["judge_output"])
    # From the command line, the judge named in the summary; `auto` takes the largest installed model.
    monkeypatch.setattr(eval_cli, "load_models", lambda args: (tiny_model, None))
    monkeypatch.setattr("rapidspec.models.load_model", lambda name, **options: tiny_model)
    data = write_locomo(tmp_path / "locomo.json")
    assert main(["eval", "--data", str(data), "--modes", "lc", "--limit", "2", "--max-new-tokens", "3",
                 "--retrieval", "bm25", "--chunk-tokens", "64", "--judge", "auto", "--json-only"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["judge"] == tiny_model.name and summary["summary"][0]["judge"] == tiny_model.name
