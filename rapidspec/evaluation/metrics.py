"""Scores of one prediction, and bootstrap confidence intervals of their mean.

:func:`score_prediction` scores an answer with its benchmark's own scorer
(:mod:`.scorers`) and names it in ``metrics["metric"]``:

* multiple choice: ``choice_accuracy``, 1 when the letters read from the
  answer (:func:`~rapidspec.evaluation.answers.extract_choice`) equal the gold
  set (L-Eval's Coursera has several gold letters); ``extracted`` is None
  when no answer could be read (counted as "no answer" in summaries);
* short answers: ``squad_f1`` (and SQuAD ``em``), or ``locomo_f1`` for
  LoCoMo's questions (its category rules);
* summaries: ``rouge_lsum`` (∞Bench's ROUGE-L-Sum, ``rouge-score``);
* needles: ``string_match_all`` (RULER), and ``em`` when every needle is found.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rapidspec.evaluation.answers import LETTERS, choice_accuracy, extract_choice
from rapidspec.evaluation.normalize import normalize_answer
from rapidspec.evaluation.scorers import (
    exact_match,
    locomo_f1,
    needle_recall,
    rouge_l_sum,
    token_f1,
)

__all__ = [
    "HEADLINE", "LETTERS", "bootstrap_ci", "choice_accuracy", "exact_match", "extract_choice", "locomo_f1",
    "needle_recall", "normalize_answer", "rouge_l_sum", "score_prediction", "token_f1",
]


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


def score_prediction(task_type: str, prediction: str, answers: Sequence[str], num_choices: int = 0, *,
                     choices: Sequence[str] = (), scorer: str = "", category: int | None = None) -> dict:
    """All metrics of one prediction; ``score`` is the headline, ``metric`` names its scorer.

    * ``mc``: ``accuracy`` (and ``extracted``, the letters read; ``choices``
      are the options' texts, for answers that copy one without its letter);
    * ``qa``: ``f1`` (score) and ``em``; ``scorer="locomo_f1"`` scores with
      LoCoMo's F1 for a question of ``category``;
    * ``summary``: ``rouge_lsum`` (score);
    * ``needle``: ``recall`` (score) and ``em`` (all needles found).
    """
    if task_type == "mc":
        accuracy, extracted = choice_accuracy(prediction, answers[0], num_choices or 4, options=choices)
        return {"score": accuracy, "metric": "choice_accuracy", "accuracy": accuracy, "extracted": extracted}
    if task_type == "qa":
        if scorer == "locomo_f1":
            f1 = locomo_f1(prediction, answers, category)
        elif scorer in ("", "squad_f1"):
            f1, scorer = token_f1(prediction, answers), "squad_f1"
        else:
            raise ValueError(f"unknown scorer {scorer!r} for short answers")
        return {"score": f1, "metric": scorer, "f1": f1, "em": exact_match(prediction, answers)}
    if task_type == "summary":
        rouge = rouge_l_sum(prediction, answers)
        return {"score": rouge, "metric": "rouge_lsum", "rouge_lsum": rouge}
    if task_type == "needle":
        recall = needle_recall(prediction, answers)
        return {"score": recall, "metric": "string_match_all", "recall": recall, "em": float(recall == 1.0)}
    raise ValueError(f"unknown task type {task_type!r}")


#: The name of each task type's headline metric key, for tables (records name their scorer in ``metric``).
HEADLINE = {"mc": "accuracy", "qa": "f1", "summary": "rouge_lsum", "needle": "recall"}
