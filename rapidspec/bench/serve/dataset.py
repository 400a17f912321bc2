"""The chat requests of ``rapidspec bench serve``: what each request asks, in OpenAI's chat shape.

* ``builtin``: the built-in demo document (:mod:`rapidspec.prompting.demo_document`)
  sent as the request's ``documents``, with one of :data:`BUILTIN_QUESTIONS`
  as the user message; every request shares the document, so after the first
  one the server's prefix cache holds it.
* A JSON list or JSONL file of ``{"document", "question"}`` records (the
  format of ``rapidspec bench --data``): the document as ``documents``, the
  question as the user message.
* A LoCoMo file (a JSON list of ``{"conversation", "qa"}`` samples): the first
  sample's first sessions as earlier chat turns (the long context, no
  documents) and one of its questions as the last user message.
* ``--documents FILE.jsonl`` (:func:`documents_requests`): one JSON object per
  line, ``{"document": "...", "questions": ["...", ...]}``; each document's
  questions in turn, so its follow-ups find it in the server's cache
  (``benchmarks/documents_file.py`` writes such a file from any file
  ``rapidspec eval`` reads, or from the built-in document, cut to a length).

Request ``i`` of the load is ``requests[i % len(requests)]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rapidspec.errors import RapidspecError

BUILTIN = "builtin"
MAX_LOCOMO_QUESTIONS = 64

BUILTIN_QUESTIONS = (
    "At what time does the reading room of the Lisbon library close on Thursdays?",
    "According to the text, what three things does every object have?",
    "What is the difference between mutable and immutable objects?",
    "When may an object be garbage-collected?",
    "What is a code block in Python's execution model?",
    "What happens when an exception is raised and not handled?",
    "Which values are considered false when their truth value is tested?",
    "How does Python decide whether two objects compare equal?",
)


@dataclass(frozen=True)
class BenchRequest:
    """One request's conversation (``messages``) and ``documents`` (none: the conversation is the context)."""

    messages: tuple[dict, ...]
    documents: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.messages:
            raise RapidspecError("a request needs at least one message")

    def inlined_messages(self) -> list[dict]:
        """The conversation with the documents placed in it as rapidspec's target reads them (for a peer server)."""
        if not self.documents:
            return list(self.messages)
        from rapidspec.prompting.conversation import parse_messages, with_documents

        return [m.to_dict() for m in with_documents(parse_messages(list(self.messages)), self.documents)]


def builtin_requests(document_tokens: int | None = None) -> list[BenchRequest]:
    """One request per built-in question, all about the same demo document (about ``document_tokens`` tokens)."""
    from rapidspec.prompting.demo_document import DEFAULT_TARGET_TOKENS, demo_document

    document = demo_document(target_tokens=document_tokens or DEFAULT_TARGET_TOKENS).document
    return [BenchRequest(({"role": "user", "content": q},), (document,)) for q in BUILTIN_QUESTIONS]


def file_requests(path: str | Path, locomo_sessions: int = 2) -> list[BenchRequest]:
    """The requests of a ``{document, question}`` records file or of a LoCoMo file (detected from its content)."""
    from rapidspec.bench.inputs import load_items

    path = Path(path)
    if not path.is_file():
        raise RapidspecError(f"dataset file not found: {path} (use --dataset builtin or a JSON/JSONL file)")
    records = _json_list(path)
    if records and isinstance(records[0], dict) and "conversation" in records[0] and "qa" in records[0]:
        return _locomo_requests(path, records[0], locomo_sessions)
    return [BenchRequest(({"role": "user", "content": item.question},), (item.document,)) for item in load_items(path)]


DOCUMENT_FIELDS = ("document", "questions")


def documents_requests(path: str | Path) -> list[BenchRequest]:
    """The requests of a ``--documents`` file: every document's questions, in turn, document after document."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise RapidspecError(f"cannot read the documents file {path}: {err}") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            document, questions = _document_record(line, f"{path}:{number}")
            requests += [BenchRequest(({"role": "user", "content": q},), (document,)) for q in questions]
    if not requests:
        raise RapidspecError(f"{path}: no documents (one JSON object per line: "
                             '{"document": "...", "questions": ["...", ...]})')
    return requests


def _document_record(line: str, where: str) -> tuple[str, list[str]]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise RapidspecError(f"{where}: not a JSON object ({err})") from None
    if not isinstance(record, dict) or set(record) != set(DOCUMENT_FIELDS):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise RapidspecError(f"{where}: each line is one object with exactly the keys document and questions, got {keys}")
    document, questions = record["document"], record["questions"]
    if not isinstance(document, str) or not document.strip():
        raise RapidspecError(f"{where}: document must be a non-empty string")
    if not isinstance(questions, list) or not questions or not all(isinstance(q, str) and q.strip() for q in questions):
        raise RapidspecError(f"{where}: questions must be a non-empty list of non-empty strings")
    return document, questions


def load_requests(dataset: str, document_tokens: int | None = None, locomo_sessions: int = 2) -> list[BenchRequest]:
    """The requests of ``--dataset`` (``builtin`` or a file path)."""
    if dataset == BUILTIN:
        return builtin_requests(document_tokens)
    if document_tokens is not None:
        raise RapidspecError("--document-tokens sizes the built-in document; a dataset file is used as it is")
    return file_requests(dataset, locomo_sessions)


def _json_list(path: Path) -> list | None:
    """The file's content when it is one JSON list (None for JSONL and anything else)."""
    try:
        with path.open(encoding="utf-8") as f:
            if f.read(4096).lstrip()[:1] != "[":
                return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise RapidspecError(f"cannot read the dataset file {path}: {err}") from None
    except json.JSONDecodeError as err:
        raise RapidspecError(f"{path}: not JSON or JSONL ({err})") from None
    return data if isinstance(data, list) else None


def _locomo_requests(path: Path, sample: dict, sessions: int) -> list[BenchRequest]:
    from rapidspec.evaluation.datasets import locomo_sessions

    if sessions < 1:
        raise RapidspecError(f"--locomo-sessions must be >= 1, got {sessions}")
    try:
        history = tuple(m for session in locomo_sessions(sample["conversation"])[:sessions] for m in session)
        questions = [str(q["question"]) for q in sample["qa"] if q.get("question")][:MAX_LOCOMO_QUESTIONS]
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise RapidspecError(f"{path}: not a LoCoMo file ({err!r})") from None
    if not history or not questions:
        raise RapidspecError(f"{path}: the first LoCoMo sample has no sessions or no questions")
    return [BenchRequest((*history, {"role": "user", "content": q})) for q in questions]
