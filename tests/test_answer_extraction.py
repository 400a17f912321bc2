"""Reading the option a multiple-choice answer chose: a table of phrasings, real model outputs among them."""

from __future__ import annotations

import pytest

from rapidspec.evaluation.answers import choice_accuracy, extract_choice

# Options of L-Eval QuALITY item quality-0-3 and quality-0-17 (the real outputs below answer them).
ROBOTS = (
    "Yes, because Harper was continuously bothered by complaining patrons.",
    "No, because the robots were the ones causing all the issues and complaints.",
    "No, because humans were not involved in the hotel's main matters.",
    "Yes, because the human desk clerk had given him the wrong room.",
)
COUNTS = ("12", "9", "16", "20")


@pytest.mark.parametrize(
    "text, expected",
    [
        # LongBench v2's own rule
        ("The correct answer is (B)", "B"),
        ("**The correct answer is (C)**.", "C"),
        ("Reasoning first... The correct answer is D", "D"),
        ("The correct answer is Alice, not Bob.", None),  # a name, not option A
        # answer phrases
        ("The correct answer is: (B)", "B"),
        ("The correct answer is a matter of taste, but (C)", "C"),
        ("Answer: D", "D"),
        ("answer: **B**", "B"),
        ("The answer is D) He was tired of working at the hotel.", "D"),  # real output (quality-0-11)
        ("The answer is: C) He had been hired for another job.", "C"),  # real output (quality-0-11)
        ("A) Treating Martian liquids for commercial use.\n\nThe answer is A.", "A"),  # real output
        ("After weighing the passages, the best option is C.", "C"),
        ("I would choose (D) because the letter says so.", "D"),
        ("I'll go with option B", "B"),
        ("Option C is correct: the treaty was signed in Lisbon.", "C"),
        ("My choice is (b)", "B"),
        # a leading letter that stands as the answer
        ("B", "B"),
        ("b", "B"),
        ("(A) because the text says so", "A"),
        ("C. The hotel", "C"),
        ("[D]", "D"),
        ("(C) Scribney had gauged his victim's mental processes accurately.", "C"),  # real output
        ("A) An uncomfortable and unrelaxing hotel meant for short stays.", "A"),  # real output
        ("B. No, because the robots were the ones causing all the issues and complaints", "B"),  # real output
        ("B.", "B"),  # real output
        # the article "A" is not option A
        ("A careful reading suggests C.", "C"),
        ("A hotel is a place to sleep.", None),
        ("A few of them are right, but mostly D.", "D"),
        # nothing to read
        ("The answer is:", None),  # real output (quality-0-11), cut by the token limit
        ("I do not know", None),
        ("Bella convinced him he could benefit from a scientific breakthrough.", None),  # real output, no option's text
        ("The correct answer is (E)", None),  # only four options
        ("Either (A) or (C) could be argued.", None),  # two letters, no choice
    ],
)
def test_extract_choice(text, expected):
    assert extract_choice(text) == expected


def test_an_answer_that_copies_one_option_reads_as_that_option():
    real = "No, because the robots were the ones causing all the issues and complaints."  # quality-0-3
    assert extract_choice(real, options=ROBOTS) == "B"
    assert extract_choice(real) is None  # without the options there is nothing to read
    # two options' texts in one answer decide nothing
    assert extract_choice(f"{ROBOTS[0]} {ROBOTS[2]}", options=ROBOTS) is None
    # real output for quality-0-17: the number is option A's whole text
    assert extract_choice("The longest sentence of this story contains 12 words", options=COUNTS) == "A"


def test_letters_outside_the_options_never_count():
    assert extract_choice("F", num_choices=4) is None
    assert extract_choice("F", num_choices=6) == "F"
    assert extract_choice("The correct answer is (G)", num_choices=10) == "G"


def test_multi_letter_choices():
    assert extract_choice("A, D", multi=True) == "AD"
    assert extract_choice("AD", multi=True) == "AD"
    assert extract_choice("The answers are A and C.", multi=True) == "AC"
    assert choice_accuracy("A and D", "AD") == (1.0, "AD")
    assert choice_accuracy("A", "AD")[0] == 0.0
    assert choice_accuracy("The correct answer is (B)", "B") == (1.0, "B")
    assert choice_accuracy("I do not know", "B") == (0.0, None)
