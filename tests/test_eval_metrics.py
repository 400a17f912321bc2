"""Metric functions of `rapidspec eval` against hand-computed values."""

from __future__ import annotations

import math

import pytest

from rapidspec.evaluation.metrics import (
    bootstrap_ci,
    choice_accuracy,
    exact_match,
    extract_choice,
    needle_recall,
    normalize_answer,
    rouge_l,
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


def test_rouge_l_hand_computed():
    # pred [a b c d e], ref [a x c e]: LCS = [a c e] = 3; P = 3/5, R = 3/4, F = 2PR/(P+R) = 2/3
    assert rouge_l("a1 b2 c3 d4 e5", "a1 x9 c3 e5") == pytest.approx(2 * 0.6 * 0.75 / 1.35)
    assert rouge_l("same words here", "same words here") == 1.0
    assert rouge_l("", "anything") == 0.0


def test_needle_recall():
    assert needle_recall("numbers: 123 and 456", ["123", "456", "789", "000"]) == 0.5
    assert needle_recall("The number is 1234567.", "1234567") == 1.0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The correct answer is (B)", "B"),
        ("**The correct answer is (C)**.", "C"),
        ("Reasoning... The correct answer is D", "D"),
        ("B", "B"),
        ("(A) because the text says so", "A"),
        ("C. The hotel", "C"),
        ("Answer: D", "D"),
        ("b", "B"),
        ("A hotel is a place", "A"),  # ambiguous, read as a bare leading letter (as LongBench v2 accepts one)
        ("I do not know", None),
        ("The correct answer is (E)", None),  # only four options
    ],
)
def test_extract_choice(text, expected):
    assert extract_choice(text) == expected


def test_multi_letter_choices():
    assert extract_choice("A, D", multi=True) == "AD"
    assert extract_choice("AD", multi=True) == "AD"
    assert choice_accuracy("A and D", "AD") == (1.0, "AD")
    assert choice_accuracy("A", "AD")[0] == 0.0
    assert choice_accuracy("The correct answer is (B)", "B") == (1.0, "B")


def test_score_prediction_per_task_type():
    assert score_prediction("mc", "(D) upscale", ["D"], 4)["score"] == 1.0
    qa = score_prediction("qa", "the cat sat", ["a cat sat down"])
    assert qa["score"] == pytest.approx(0.8) and qa["em"] == 0.0
    assert score_prediction("needle", "1 and 2", ["1", "2"])["em"] == 1.0
    assert score_prediction("summary", "a b", ["a b"])["rouge_l"] == 1.0


def test_bootstrap_ci_contains_mean_and_is_seeded():
    values = [1, 0, 1, 1, 0, 1, 0, 1, 1, 1]
    mean, low, high = bootstrap_ci(values, seed=3)
    assert mean == pytest.approx(0.7)
    assert low <= mean <= high and 0.3 <= low < 0.7 < high <= 1.0
    assert bootstrap_ci(values, seed=3) == (mean, low, high)
    assert bootstrap_ci([0.5]) == (0.5, 0.5, 0.5)
    assert all(math.isnan(v) for v in bootstrap_ci([]))
