"""Which option a multiple-choice answer chose, read as people write answers.

:func:`extract_choice` tries these rules in order and returns at the first
that decides (markdown ``*`` and ``_`` emphasis removed first):

1. **LongBench v2's own rule**: "The correct answer is (X)", then "The
   correct answer is X" (upper-case X; unlike LongBench's regular expression,
   X must not start a word, so "The correct answer is Alice" is no answer).
2. **An answer phrase** naming one letter: "answer is: (B)", "Answer: B",
   "the best option is C", "I would choose (D)", "Option C is correct".
3. **A leading letter** that stands as the answer: "B", "(B)", "B.", "B)",
   "B:", "[B]", "(B) some text", "B) some text". A capital followed by a
   space and a word ("A careful reading ...") is the article, not an answer.
4. **The option's text**: when the options are known and exactly one of them
   appears in the answer (after SQuAD normalisation), e.g. an answer that
   copies option D's text without its letter.
5. **One parenthesised letter**: every "(X)" in the text names the same
   letter ("... a matter of taste, but (C)").
6. **A letter ending a sentence**: "A careful reading suggests C." (a
   capital standing alone before ``.``, ``!`` or the end of the text, the
   only such letter in the answer).

Anything else is ``None`` ("no answer"), which every summary counts.
Letters outside the first ``num_choices`` never count. ``multi`` (L-Eval's
Coursera, several gold letters) reads a leading list "A, D", "AD", "A and D"
or "answer is A and C" and returns the sorted letters ("AD").
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from rapidspec.evaluation.normalize import normalize_answer

LETTERS = "ABCDEFGHIJ"

_EMPHASIS = re.compile(r"[*_]")
# A letter standing alone: not inside a word, not a contraction ("A's").
_ALONE = r"(?![A-Za-z0-9'’])"
_LONGBENCH = (
    re.compile(r"The correct answer is \(([A-J])\)"),
    re.compile(r"The correct answer is ([A-J])" + _ALONE),
)
_LETTER = r"[(\[]?([A-J])[)\]]?" + _ALONE
_PHRASES = (
    # "answer is: (B)", "correct answer: B", "the best option would be C", "my choice is (D)"
    re.compile(r"\b(?:answer|option|choice)\s*(?:is|would be|should be|will be|=|:|：)\s*[:：]?\s*"
               r"(?:option\s+|choice\s+)?" + _LETTER, re.IGNORECASE),
    # "I would choose (D)", "I'll go with option B", "select C"
    re.compile(r"\b(?:choose|chose|select|pick|go with)\s+(?:option\s+|choice\s+)?" + _LETTER, re.IGNORECASE),
    # "Option C is correct", "choice (B) is the right one"
    re.compile(r"\b(?:option|choice)\s+" + _LETTER + r"\s+is\s+(?:the\s+)?(?:correct|right|best)", re.IGNORECASE),
)
# The phrases' letter must be a capital unless it is bracketed ("answer is a matter ..." is no answer).
_PHRASE_LOWER_OK = re.compile(r"[(\[][a-j][)\]]")
_LEADING = re.compile(r"^\s*(?:[(\[]([A-J])[)\]]|([A-J])(?:[.):]|\s*$))")
_LEADING_LOWER_ALONE = re.compile(r"^\s*[(\[]?([a-j])[)\]]?\s*[.):]?\s*$")
_PARENTHESISED = re.compile(r"\(([A-J])\)")
_SENTENCE_END = re.compile(r"(?<![A-Za-z0-9'’(\[])([A-J])(?=\s*(?:[.!]|$))")
# Several letters at the start: "AD", "A, D", "A and D", "(A)(D)"
_LEADING_MULTI = re.compile(
    r"^\s*(?:answer\s*(?:is|s\s+are)?\s*[:：]?\s*)?((?:\(?[A-J]\)?(?:\s*(?:,|and|&)?\s*))+)(?:[.:]|\s|$)",
    re.IGNORECASE)
_ANSWERS_ARE = re.compile(r"\banswers?\s+(?:is|are)\s*[:：]?\s*((?:\(?[A-J]\)?" + _ALONE +
                          r"(?:\s*(?:,|and|&)\s*)?)+)")


def _valid(letter: str | None, num_choices: int) -> str | None:
    return letter.upper() if letter and letter.upper() in LETTERS[:num_choices] else None


def _by_phrase(text: str, num_choices: int) -> str | None:
    for pattern in _PHRASES:
        for match in pattern.finditer(text):
            letter = match.group(1)
            if letter.islower() and not _PHRASE_LOWER_OK.search(match.group(0)):
                continue
            if _valid(letter, num_choices):
                return letter.upper()
    return None


def _by_option_text(text: str, options: Sequence[str]) -> str | None:
    said = f" {normalize_answer(text)} "
    found = [i for i, option in enumerate(options)
             if (words := normalize_answer(option)) and f" {words} " in said]
    return LETTERS[found[0]] if len(found) == 1 else None


def _one_letter(letters: list[str], num_choices: int) -> str | None:
    valid = {letter for letter in letters if _valid(letter, num_choices)}
    return valid.pop() if len(valid) == 1 else None


def _multi(text: str, num_choices: int) -> str | None:
    match = _ANSWERS_ARE.search(text) or _LEADING_MULTI.match(text)
    if not match:
        return None
    listed = re.sub(r"and", " ", match.group(1), flags=re.IGNORECASE)
    letters = {ch.upper() for ch in re.findall(r"[A-J]", listed, re.IGNORECASE)}
    valid = [ch for ch in sorted(letters) if ch in LETTERS[:num_choices]]
    return "".join(valid) or None


def extract_choice(text: str, num_choices: int = 4, multi: bool = False,
                   options: Sequence[str] = ()) -> str | None:
    """The option letter(s) an answer chose, or ``None`` (module docstring for the rules).

    ``options``: the options' texts in letter order, for rule 4 (optional).
    """
    text = _EMPHASIS.sub("", text)
    for pattern in _LONGBENCH:
        match = pattern.search(text)
        if match and _valid(match.group(1), num_choices):
            return match.group(1)
    if multi and (letters := _multi(text, num_choices)):
        return letters
    if letter := _by_phrase(text, num_choices):
        return letter
    match = _LEADING.match(text)
    if match and (letter := _valid(match.group(1) or match.group(2), num_choices)):
        return letter
    match = _LEADING_LOWER_ALONE.match(text)
    if match and (letter := _valid(match.group(1), num_choices)):
        return letter
    if options and (letter := _by_option_text(text, options[:num_choices])):
        return letter
    if letter := _one_letter(_PARENTHESISED.findall(text), num_choices):
        return letter
    return _one_letter(_SENTENCE_END.findall(text), num_choices)


def choice_accuracy(prediction: str, gold: str, num_choices: int = 4,
                    options: Sequence[str] = ()) -> tuple[float, str | None]:
    """(1.0 or 0.0, extracted letters): right when the set of letters equals the gold set."""
    chosen = extract_choice(prediction, num_choices, multi=len(gold) > 1, options=options)
    if chosen is None:
        return 0.0, None
    return float(set(chosen) == set(gold.upper())), chosen
