"""An LLM judge for open answers: a local model rates each answer from 1 to 10 against the gold answer.

The paper's multi-turn setting (its Table 2, MT-Bench-101) is scored by
GPT-4-Turbo as a judge on a 1-10 scale. ``rapidspec eval --judge MODEL``
does the same with a local model, through the same engine as every other
generation (mode ``lc``, greedy, a short prompt: no document, so the judge's
cost does not grow with the context). The prompt is single-answer grading
with a reference answer, in the manner of MT-Bench:

* the judge sees the question, the reference (gold) answer and the
  assistant's answer, and is told to judge correctness against the reference
  first, then helpfulness and concision;
* it must end with ``Rating: [[N]]``, N from 1 to 10; the rating is read from
  ``[[N]]``, else from the last "Rating: N" or "N/10"; anything else leaves
  the answer unrated (``judge_rating`` null, counted in the summary).

A small local judge is not GPT-4: its ratings are labelled with the judge's
name in every record and summary and are **not comparable with the paper's
GPT-4 scores**; compare modes under one judge only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rapidspec.config import DecodeConfig

SCALE = (1, 10)
#: Task types with open answers (the ones a judge rates).
JUDGED_TASK_TYPES = ("qa", "summary")
JUDGE_SYSTEM = (
    "You are an impartial judge of answers written by an AI assistant. Compare the assistant's answer "
    "with the reference answer: judge its correctness first, then how helpful, relevant and concise it is. "
    "Write one short sentence of explanation, then your rating on a scale of 1 (wrong or useless) to "
    "10 (correct and complete) in exactly this format: Rating: [[N]]"
)
JUDGE_USER = (
    "[Question]\n{question}\n\n[Reference answer]\n{reference}\n\n[Assistant's answer]\n{answer}\n\n"
    "Rate the assistant's answer."
)
_BRACKETED = re.compile(r"\[\[\s*(\d{1,2})(?:\.\d+)?\s*\]\]")
_RATING = re.compile(r"rating\s*[:=]?\s*(\d{1,2})(?:\.\d+)?\b", re.IGNORECASE)
_OUT_OF_TEN = re.compile(r"\b(\d{1,2})(?:\.\d+)?\s*/\s*10\b")


def largest_installed_model() -> str:
    """``builtin:NAME`` of the largest built-in model installed here (``--judge auto``)."""
    from rapidspec.models.store import list_models

    installed = [row for row in list_models() if row.installed]
    return "builtin:" + max(installed, key=lambda row: row.size_bytes or 0).name if installed else "builtin"


def parse_rating(text: str) -> int | None:
    """The rating a judge wrote (``[[N]]``, else the last "Rating: N" or "N/10"), or None if none in 1-10."""
    for pattern in (_BRACKETED, _RATING, _OUT_OF_TEN):
        found = [int(value) for value in pattern.findall(text)]
        if found:
            rating = found[-1]
            return rating if SCALE[0] <= rating <= SCALE[1] else None
    return None


def judge_messages(question: str, answer: str, reference: str) -> list[dict[str, str]]:
    """The judge's conversation for one answer."""
    user = JUDGE_USER.format(question=question.strip(), reference=reference.strip(), answer=answer.strip() or "(empty)")
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]


@dataclass
class Judge:
    """Rates answers with ``model`` (a :class:`rapidspec.models.LoadedModel`), greedily, in ``max_new_tokens``."""

    model: object
    max_new_tokens: int = 96

    def __post_init__(self) -> None:
        from rapidspec.engine import Rapid

        self.engine = Rapid(target=self.model)
        self.config = DecodeConfig(mode="lc", temperature=0.0, max_new_tokens=self.max_new_tokens)

    @property
    def name(self) -> str:
        return getattr(self.model, "label", getattr(self.model, "name", type(self.model).__name__))

    def rate(self, question: str, answer: str, references: tuple[str, ...]) -> dict:
        """``{"judge", "judge_rating", "judge_output"}`` for one answer (several references joined by " / ")."""
        messages = judge_messages(question, answer, " / ".join(references))
        output = self.engine.chat(messages, config=self.config)
        return {"judge": self.name, "judge_rating": parse_rating(output.text), "judge_output": output.text}
