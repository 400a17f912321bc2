"""One evaluation item: a question about a document (or a conversation), with its gold answers.

Shared by the loaders of :mod:`rapidspec.evaluation.datasets` and the
generator of :mod:`rapidspec.evaluation.synthetic`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rapidspec.errors import RapidspecError
from rapidspec.prompting.prompts import PromptTemplate

TASK_TYPES = ("mc", "qa", "summary", "needle")


@dataclass(frozen=True)
class EvalItem:
    """One question about one document, ready for :meth:`rapidspec.Rapid.generate`.

    ``question`` is what fills the template's ``{question}`` (for LongBench v2
    it includes the choices, as the official prompt does); ``query`` is what
    retrieval searches for; ``answers`` are the gold answers (the option
    letter(s) for ``mc``); ``group`` names the task for the summary
    (``longbench2``, ``leval/quality``, ``synthetic/niah_single@4096``).
    """

    id: str
    document: str
    question: str
    query: str
    answers: tuple[str, ...]
    task_type: str
    template: PromptTemplate
    group: str
    choices: tuple[str, ...] = ()
    #: The scorer of its benchmark where the task type's default is not it (``locomo_f1``, :mod:`.scorers`).
    scorer: str = ""
    meta: dict = field(default_factory=dict, compare=False)
    #: Chat form: the conversation so far, ending with the question as the last user turn
    #: (answered with :meth:`rapidspec.Rapid.chat`; ``document`` is then the transcript, for reference).
    messages: tuple[dict, ...] = ()

    def __post_init__(self) -> None:
        if self.task_type not in TASK_TYPES:
            raise RapidspecError(f"unknown task type {self.task_type!r}")

    @property
    def answer(self) -> str:
        return self.answers[0]
