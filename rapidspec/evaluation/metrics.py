"""Scores of one prediction, and bootstrap confidence intervals of their mean.

* Multiple choice: :func:`extract_choice` reads the option letter(s) the
  model chose ("The correct answer is (B)", LongBench v2's pattern, or a bare
  leading letter such as "B." / "(B)"); :func:`choice_accuracy` is 1 when the
  chosen set equals the gold set (L-Eval's Coursera has several gold letters).
* Short answers: SQuAD-style normalisation (lower case, no punctuation, no
  articles ``a an the``, single spaces), then :func:`exact_match` and
  :func:`token_f1` (harmonic mean of token precision and recall, bag of words),
  the maximum over several gold answers.
* Summaries: :func:`rouge_l` is the ROUGE-L F-measure (beta = 1) of the
  longest common subsequence of normalised tokens.
* Needles: :func:`needle_recall` is RULER's ``string_match_all``: the fraction
  of gold strings found in the prediction (case-insensitive).

Worked example for token F1: prediction "the cat sat", gold "a cat sat down"
→ tokens [cat, sat] vs [cat, sat, down]; overlap 2, precision 2/2, recall 2/3,
F1 = 2·1·(2/3)/(1 + 2/3) = 0.8.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import numpy as np

LETTERS = "ABCDEFGHIJ"

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)
_CORRECT_ANSWER = re.compile(r"The correct answer is\s*\(?\s*([A-J])\s*\)?(?![A-Za-z])", re.IGNORECASE)
# A bare leading answer: "B", "(B)", "B.", "B)", "B:", "Answer: B", "(B) text"
_LEADING = re.compile(r"^\s*(?:answer\s*(?:is)?\s*[:：]?\s*)?\(?([A-J])(?:\)|\.|:|,|\s|$)", re.IGNORECASE)
# Several letters at the start: "AD", "A, D", "A and D", "(A)(D)"
_LEADING_MULTI = re.compile(r"^\s*(?:answer\s*(?:is)?\s*[:：]?\s*)?((?:\(?[A-J]\)?(?:\s*(?:,|and|&)?\s*))+)(?:[.:]|\s|$)", re.IGNORECASE)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, squeeze spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _as_list(golds: str | Sequence[str]) -> list[str]:
    return [golds] if isinstance(golds, str) else [str(g) for g in golds]


def exact_match(prediction: str, golds: str | Sequence[str]) -> float:
    """1.0 if the normalised prediction equals a normalised gold answer."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _as_list(golds)))


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    overlap = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, golds: str | Sequence[str]) -> float:
    """SQuAD token F1, the best over the gold answers."""
    pred = normalize_answer(prediction).split()
    return max(_f1(pred, normalize_answer(g).split()) for g in _as_list(golds))


def _lcs_length(a: list[str], b: list[str]) -> int:
    # One row of the dynamic programme: O(len(a) * len(b)) time, O(len(b)) memory.
    row = [0] * (len(b) + 1)
    for x in a:
        previous = 0  # row[j - 1] of the previous line
        for j, y in enumerate(b, start=1):
            current = row[j]
            row[j] = previous + 1 if x == y else max(row[j], row[j - 1])
            previous = current
    return row[-1]


def rouge_l(prediction: str, golds: str | Sequence[str]) -> float:
    """ROUGE-L F-measure (beta = 1) on normalised tokens, the best over the gold answers."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for gold in _as_list(golds):
        ref = normalize_answer(gold).split()
        if not pred or not ref:
            continue
        lcs = _lcs_length(pred, ref)
        if lcs:
            precision, recall = lcs / len(pred), lcs / len(ref)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def needle_recall(prediction: str, golds: str | Sequence[str]) -> float:
    """Fraction of the gold strings contained in the prediction (RULER's string_match_all)."""
    golds = _as_list(golds)
    text = prediction.lower()
    return sum(g.lower() in text for g in golds) / len(golds)


def extract_choice(text: str, num_choices: int = 4, multi: bool = False) -> str | None:
    """The option letter(s) a model answered, in order, or ``None``.

    Tries LongBench v2's "The correct answer is (X)" (markdown ``*`` removed),
    then a bare leading letter. With ``multi`` it returns every letter of a
    leading list ("A, D" → "AD").
    """
    valid = LETTERS[:num_choices]
    text = text.replace("*", "")
    match = _CORRECT_ANSWER.search(text)
    if match and match.group(1).upper() in valid:
        return match.group(1).upper()
    if multi:
        match = _LEADING_MULTI.match(text)
        if match:
            listed = re.sub(r"and", " ", match.group(1), flags=re.IGNORECASE)
            letters = [ch.upper() for ch in re.findall(r"[A-J]", listed, re.IGNORECASE)]
            letters = [ch for ch in letters if ch in valid]
            if letters:
                return "".join(sorted(set(letters)))
    match = _LEADING.match(text)
    if match:
        letter = match.group(1)
        # A lower-case single letter is only an answer when it stands alone ("b" but not "a cat").
        if letter.upper() in valid and (letter.isupper() or re.match(r"^\s*\(?[a-j]\)?\s*[.):]?\s*$", text)):
            return letter.upper()
    return None


def choice_accuracy(prediction: str, gold: str, num_choices: int = 4) -> tuple[float, str | None]:
    """(1.0 or 0.0, extracted letters): right when the set of letters equals the gold set."""
    multi = len(gold) > 1
    chosen = extract_choice(prediction, num_choices, multi=multi)
    if chosen is None:
        return 0.0, None
    return float(set(chosen) == set(gold.upper())), chosen


def bootstrap_ci(
    values: Sequence[float], resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap interval of the mean, seeded.

    A single value gives a zero-width interval; an empty list gives NaNs.
    """
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return float("nan"), float("nan"), float("nan")
    mean = float(data.mean())
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, data.size, size=(resamples, data.size))  # [resamples, n]
    means = data[picks].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return mean, float(min(low, mean)), float(max(high, mean))


def score_prediction(task_type: str, prediction: str, answers: Sequence[str], num_choices: int = 0) -> dict:
    """All metrics of one prediction; ``score`` is the task type's headline metric.

    * ``mc``: ``accuracy`` (and ``extracted``);
    * ``qa``: ``f1`` (score) and ``em``;
    * ``summary``: ``rouge_l`` (score);
    * ``needle``: ``recall`` (score) and ``em`` (all needles found).
    """
    if task_type == "mc":
        accuracy, extracted = choice_accuracy(prediction, answers[0], num_choices or 4)
        return {"score": accuracy, "accuracy": accuracy, "extracted": extracted}
    if task_type == "qa":
        f1 = token_f1(prediction, answers)
        return {"score": f1, "f1": f1, "em": exact_match(prediction, answers)}
    if task_type == "summary":
        rouge = rouge_l(prediction, answers)
        return {"score": rouge, "rouge_l": rouge}
    if task_type == "needle":
        recall = needle_recall(prediction, answers)
        return {"score": recall, "recall": recall, "em": float(recall == 1.0)}
    raise ValueError(f"unknown task type {task_type!r}")


#: The name of each task type's headline metric, for tables.
HEADLINE = {"mc": "accuracy", "qa": "f1", "summary": "rouge_l", "needle": "recall"}
