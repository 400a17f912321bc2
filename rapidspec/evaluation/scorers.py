"""The benchmarks' own scorers of one answer, each to its published definition.

Every function takes a prediction and the gold answer(s) and returns a float
in [0, 1]; several golds give the best score over them. The name in
:data:`SCORERS` is what a record's ``metrics["metric"]`` says.

* ``squad_f1`` / ``squad_em`` (:func:`token_f1`, :func:`exact_match`): SQuAD's
  bag-of-words F1 and exact match after :func:`normalize_answer`.
  Worked example: "the cat sat" against "a cat sat down" gives tokens
  [cat, sat] and [cat, sat, down]; overlap 2, precision 1, recall 2/3, F1 0.8.
* ``locomo_f1`` (:func:`locomo_f1`): LoCoMo's ``task_eval/evaluation.py``.
  Normalisation drops commas, punctuation, case and the words ``a an the
  and``; every token is Porter-stemmed (NLTK); F1 as SQuAD's. Per question
  category: 1 (multi-hop) splits prediction and gold at commas and averages,
  over the gold parts, the best F1 of any predicted part; 3 keeps the gold up
  to its first ``;``; 2 and 4 score the whole strings; 5 (adversarial) is 1
  when the answer says "no information available" or "not mentioned".
* ``rouge_lsum`` (:func:`rouge_l_sum`): ∞Bench's summary score, ROUGE-L-Sum
  F-measure from Google's ``rouge-score`` (no stemming; sentences are the
  lines of the text).
* ``string_match_all`` (:func:`needle_recall`): RULER's fraction of the gold
  strings contained in the prediction (case-insensitive).
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Sequence

from rapidspec.evaluation.normalize import normalize_answer, strip_punctuation

#: Scorer names, as records and summaries print them.
SCORERS = ("choice_accuracy", "squad_f1", "locomo_f1", "rouge_lsum", "string_match_all")
#: LoCoMo's adversarial category and the phrases that answer it.
LOCOMO_ADVERSARIAL = 5
_LOCOMO_REFUSALS = ("no information available", "not mentioned")
_LOCOMO_DROP = re.compile(r"\b(a|an|the|and)\b")


def _as_list(golds: str | Sequence[str]) -> list[str]:
    return [golds] if isinstance(golds, str) else [str(g) for g in golds]


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    """Bag-of-words F1 of two token lists (SQuAD: two empty lists score 1, one empty list 0)."""
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    overlap = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, golds: str | Sequence[str]) -> float:
    """1.0 if the normalised prediction equals a normalised gold answer."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _as_list(golds)))


def token_f1(prediction: str, golds: str | Sequence[str]) -> float:
    """SQuAD token F1, the best over the gold answers."""
    pred = normalize_answer(prediction).split()
    return max(_f1(pred, normalize_answer(g).split()) for g in _as_list(golds))


@functools.lru_cache(maxsize=1)
def _porter():
    from nltk.stem import PorterStemmer

    return PorterStemmer()


def _locomo_tokens(text: str) -> list[str]:
    """LoCoMo's normalisation (commas, case, punctuation, ``a an the and``), then Porter stems."""
    text = strip_punctuation(text.replace(",", "").lower())
    stem = _porter().stem
    return [stem(word) for word in _LOCOMO_DROP.sub(" ", text).split()]


def _locomo_f1_one(prediction: str, gold: str) -> float:
    pred, ref = _locomo_tokens(prediction), _locomo_tokens(gold)
    return _f1(pred, ref) if pred and ref else 0.0  # LoCoMo scores an empty side 0


def locomo_f1(prediction: str, golds: str | Sequence[str], category: int | None = None) -> float:
    """LoCoMo's F1 for a question of ``category`` (module docstring), the best over the gold answers."""
    if category == LOCOMO_ADVERSARIAL:
        said = prediction.lower()
        return float(any(phrase in said for phrase in _LOCOMO_REFUSALS))
    best = 0.0
    for gold in _as_list(golds):
        if category == 1:
            parts = [p.strip() for p in prediction.split(",")]
            scores = [max(_locomo_f1_one(p, g.strip()) for p in parts) for g in gold.split(",")]
            best = max(best, sum(scores) / len(scores))
        else:
            best = max(best, _locomo_f1_one(prediction, gold.split(";")[0].strip() if category == 3 else gold))
    return best


@functools.lru_cache(maxsize=1)
def _rouge_lsum_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=False)


def rouge_l_sum(prediction: str, golds: str | Sequence[str]) -> float:
    """ROUGE-L-Sum F-measure (``rouge-score``, ∞Bench's summary metric), the best over the gold answers."""
    scorer = _rouge_lsum_scorer()
    return max(scorer.score(gold, prediction)["rougeLsum"].fmeasure for gold in _as_list(golds))


def needle_recall(prediction: str, golds: str | Sequence[str]) -> float:
    """Fraction of the gold strings contained in the prediction (RULER's string_match_all)."""
    golds = _as_list(golds)
    text = prediction.lower()
    return sum(g.lower() in text for g in golds) / len(golds)
