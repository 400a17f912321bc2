"""Metric functions of `rapidspec eval` against hand-computed values."""

from __future__ import annotations

import math

import pytest

from rapidspec.evaluation.metrics import (
    bootstrap_ci,
    exact_match,
    locomo_f1,
    needle_recall,
    normalize_answer,
    rouge_l_sum,
    score_prediction,
    token_f1,
)


def test_normalize_answer_squad_style():
    assert normalize_answer("The  Cat, sat!  on A mat.") == "cat sat on mat"


def test_exact_match():
    assert exact_match("The Eiffel Tower.", "eiffel tower") == 1.0
    assert exact_match("Eiffel Tower in Paris", "eiffel tower") == 0.0
    assert exact_match("Paris", ["London", "paris"]) == 1.0


def test_token_f1_hand_computed():
    # [cat, sat] vs [cat, sat, down]: P = 1, R = 2/3, F1 = 0.8
    assert token_f1("the cat sat", "a cat sat down") == pytest.approx(0.8)
    # [red, red, blue] vs [red, blue, green]: overlap 2 (red once), P = R = 2/3
    assert token_f1("red red blue", "red blue green") == pytest.approx(2 / 3)
    assert token_f1("nothing shared", "all different") == 0.0
    assert token_f1("x", ["y", "x"]) == 1.0  # best gold counts


def test_rouge_l_sum_by_its_definition():
    # Summary-level LCS (ROUGE-L-Sum): per reference line, the union of its LCS hits with every predicted
    # line. Reference lines [the cat sat on mat] [the dog ran], predicted [the cat sat] [the dog ran]:
    # hits 3 + 3 = 6 of 8 reference tokens, 6 of 6 predicted: F = 2 * 0.75 * 1 / 1.75.
    assert rouge_l_sum("the cat sat\nthe dog ran", "the cat sat on mat\nthe dog ran") == pytest.approx(6 / 7)
    # Lines in another order: every reference line is covered (1.0), where one LCS over the whole text
    # ([the cat sat], 3 of 6) would give 0.5.
    assert rouge_l_sum("the dog ran\nthe cat sat", "the cat sat\nthe dog ran") == pytest.approx(1.0)
    assert rouge_l_sum("", "anything") == 0.0
    assert rouge_l_sum("x y", ["nothing", "x y"]) == 1.0  # best gold counts


def test_locomo_f1_by_its_definition():
    # Porter stems, commas and "and" dropped: [tom, jerri] both ways, F1 1 (SQuAD's F1 keeps "and": 0.8).
    assert locomo_f1("Tom and Jerry", "Jerry, Tom", category=4) == 1.0
    assert token_f1("Tom and Jerry", "Jerry, Tom") == pytest.approx(0.8)
    # [she, went, run, on, 7, may, 2023] vs [7, may, 2023]: P 3/7, R 1, F1 0.6
    assert locomo_f1("She went running on 7 May 2023", "7 May 2023", category=2) == pytest.approx(0.6)
    # category 1 (multi-hop): mean over gold parts of the best predicted part: (1 + 1 + 0) / 3
    assert locomo_f1("painting, hiking", "hiking, painting, swimming", category=1) == pytest.approx(2 / 3)
    # category 3: the gold up to its first ";": [ye] vs [like, ye], F1 2/3
    assert locomo_f1("yes", "Likely yes; she mentioned it twice", category=3) == pytest.approx(2 / 3)
    # category 5 (adversarial): the refusal phrases score 1, anything else 0
    assert locomo_f1("No information available about that.", "her sister", category=5) == 1.0
    assert locomo_f1("It was not mentioned.", "her sister", category=5) == 1.0
    assert locomo_f1("Her sister", "her sister", category=5) == 0.0
    assert locomo_f1("", "anything", category=2) == 0.0


def test_needle_recall():
    assert needle_recall("numbers: 123 and 456", ["123", "456", "789", "000"]) == 0.5
    assert needle_recall("The number is 1234567.", "1234567") == 1.0


def test_score_prediction_per_task_type():
    assert score_prediction("mc", "(D) upscale", ["D"], 4)["score"] == 1.0
    qa = score_prediction("qa", "the cat sat", ["a cat sat down"])
    assert qa["score"] == pytest.approx(0.8) and qa["em"] == 0.0
    assert score_prediction("needle", "1 and 2", ["1", "2"])["em"] == 1.0
    assert score_prediction("summary", "a b", ["a b"])["rouge_lsum"] == 1.0


def test_every_record_names_its_scorer():
    assert score_prediction("mc", "(D) upscale", ["D"], 4)["metric"] == "choice_accuracy"
    assert score_prediction("qa", "x", ["x"])["metric"] == "squad_f1"
    locomo = score_prediction("qa", "Tom and Jerry", ["Jerry, Tom"], scorer="locomo_f1", category=4)
    assert (locomo["metric"], locomo["score"]) == ("locomo_f1", 1.0)
    assert score_prediction("summary", "a", ["a"])["metric"] == "rouge_lsum"
    assert score_prediction("needle", "1", ["1"])["metric"] == "string_match_all"
    # an answer that copies an option's text is read as that option
    assert score_prediction("mc", "the second", ["B"], 2, choices=("the first", "the second"))["accuracy"] == 1.0


def test_bootstrap_ci_contains_mean_and_is_seeded():
    values = [1, 0, 1, 1, 0, 1, 0, 1, 1, 1]
    mean, low, high = bootstrap_ci(values, seed=3)
    assert mean == pytest.approx(0.7)
    assert low <= mean <= high and 0.3 <= low < 0.7 < high <= 1.0
    assert bootstrap_ci(values, seed=3) == (mean, low, high)
    assert bootstrap_ci([0.5]) == (0.5, 0.5, 0.5)
    assert all(math.isnan(v) for v in bootstrap_ci([]))
