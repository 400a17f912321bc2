"""Evaluation: datasets (local files), metrics, the speed harness and plots.

* :mod:`.datasets`: :class:`EvalItem` and loaders for LongBench v2, L-Eval and
  LoCoMo in their published formats, with each benchmark's own prompt.
* :mod:`.synthetic`: RULER-style needle tasks on real prose.
* :mod:`.answers`: which option a multiple-choice answer chose.
* :mod:`.scorers`: the benchmarks' own scorers (SQuAD F1 / EM, LoCoMo F1, ROUGE-L-Sum, RULER's string match).
* :mod:`.metrics`: one prediction's scores under its benchmark's scorer, bootstrap CIs.
* :mod:`.runner`: the resumable evaluation loop and its summary (``rapidspec eval``).
* :mod:`.speed`, :mod:`.plot`: the speed harness and figures (``rapidspec bench``).
"""

from rapidspec.evaluation.datasets import FORMATS, EvalItem, detect_format, load_items
from rapidspec.evaluation.metrics import (
    bootstrap_ci,
    exact_match,
    extract_choice,
    needle_recall,
    rouge_l_sum,
    score_prediction,
    token_f1,
)
from rapidspec.evaluation.runner import EvalRun, run_eval, summarize
from rapidspec.evaluation.synthetic import needle_item, synthetic_items

__all__ = [
    "FORMATS",
    "EvalItem",
    "EvalRun",
    "bootstrap_ci",
    "detect_format",
    "exact_match",
    "extract_choice",
    "load_items",
    "needle_item",
    "needle_recall",
    "rouge_l_sum",
    "run_eval",
    "score_prediction",
    "summarize",
    "synthetic_items",
    "token_f1",
]
