"""Benchmark items from local files in each benchmark's own published format.

Every loader yields :class:`EvalItem` objects, document by document, so that
a runner that loops over items then modes reuses the target's document cache.
Nothing is downloaded.

* LongBench v2 (``longbench2``): a JSON list of ``{_id, domain, sub_domain,
  difficulty, length, question, choice_A..choice_D, answer, context}``. Prompt:
  the official 0-shot template; retrieval query: the question and the four
  choices (as the RAPID reference code does).
* L-Eval (``leval``): JSON lines ``{input, instructions: [...], outputs: [...],
  source, evaluation}``, several questions per document. Multiple-choice tasks
  (QuALITY, Coursera, TPO: options written in the instruction, answers such as
  ``(D) text``, ``D`` or ``AD``) use L-Eval's exam prompt ending in
  "Answer:"; topic retrieval uses its bare "document, then question" prompt;
  other tasks use its open-ended prompt ("Answer this question with N words").
* LoCoMo (``locomo``): a JSON list of conversations with ``qa`` items; the
  conversation becomes a document of sessions, each a ``DATE:`` line and
  ``Speaker: text`` lines. Category 5 (adversarial) is skipped unless asked.
* Synthetic needle tasks (``synthetic``): see :mod:`rapidspec.evaluation.synthetic`.

:func:`load_items` detects the format from the content when not given.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from rapidspec.errors import RapidspecError
from rapidspec.evaluation.items import EvalItem
from rapidspec.evaluation.scorers import LOCOMO_ADVERSARIAL
from rapidspec.evaluation.synthetic import synthetic_items
from rapidspec.prompting.prompts import PromptTemplate

FORMATS = ("longbench2", "leval", "locomo", "locomo-chat", "synthetic")


# ------------------------------------------------------------------ LongBench v2
LONGBENCH2_TEMPLATE = PromptTemplate(
    body=(
        "Please read the following {source} and answer the question below.\n\n"
        "<text>\n{document}\n</text>\n\n"
        "What is the correct answer to this question: {question}\n\n"
        'Format your response as follows: "The correct answer is (insert answer here)".'
    ),
)
_LONGBENCH2_FIELDS = ("_id", "question", "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context")


def load_longbench2(records: list[dict]) -> Iterator[EvalItem]:
    for index, record in enumerate(records):
        missing = [f for f in _LONGBENCH2_FIELDS if f not in record]
        if missing:
            raise RapidspecError(f"LongBench v2 record {index} lacks {', '.join(missing)}")
        choices = tuple(str(record[f"choice_{letter}"]).strip() for letter in "ABCD")
        question = str(record["question"]).strip() + "\nChoices:\n" + "\n".join(
            f"({letter}) {choice}" for letter, choice in zip("ABCD", choices)
        )
        yield EvalItem(
            id=str(record["_id"]),
            document=str(record["context"]),
            question=question,
            query=question,  # the question plus the four choices
            answers=(str(record["answer"]).strip().upper(),),
            task_type="mc",
            template=LONGBENCH2_TEMPLATE,
            group="longbench2",
            choices=choices,
            meta={k: record.get(k) for k in ("domain", "sub_domain", "difficulty", "length")},
        )


# ------------------------------------------------------------------ L-Eval
LEVAL_SYSTEM = (
    "Now you are given a very long document. Please follow the instruction after this document. "
    "These instructions may include summarizing a document, answering questions based on the document, "
    "or writing a required paragraph."
)
LEVAL_EXAM_TEMPLATE = PromptTemplate(
    body=(
        "Document is as follows. {document} \nQuestion: {question}.  "
        "Please directly give the answer without any additional output or explanation \nAnswer:"
    ),
    system=LEVAL_SYSTEM,
)
LEVAL_TOPIC_TEMPLATE = PromptTemplate(body="{document}\n\n{question}", system=LEVAL_SYSTEM)
_OPTION_LINE = re.compile(r"^\s*\(?([A-J])[.)]\s+(.*\S)", re.MULTILINE)
_GOLD_LETTERS = re.compile(r"^\s*\(?([A-J]+)\)?(?:[.)\s]|$)")


def _leval_open_template(words: int) -> PromptTemplate:
    return PromptTemplate(
        body="Document is as follows. {document} Instruction: {question} " + f"\nAnswer this question with {words} words.",
        system=LEVAL_SYSTEM,
    )



def load_leval(lines: list[dict], path: Path) -> Iterator[EvalItem]:
    task = path.stem
    for doc_index, record in enumerate(lines):
        for name in ("input", "instructions", "outputs"):
            if name not in record:
                raise RapidspecError(f"L-Eval line {doc_index + 1} of {path} lacks {name!r}")
        instructions, outputs = record["instructions"], record["outputs"]
        if len(instructions) != len(outputs):
            raise RapidspecError(f"L-Eval line {doc_index + 1} of {path}: {len(instructions)} instructions, {len(outputs)} outputs")
        for q_index, (instruction, output) in enumerate(zip(instructions, outputs)):
            instruction, output = str(instruction).strip(), str(output).strip()
            options = _OPTION_LINE.findall(instruction)
            gold = _GOLD_LETTERS.match(output)
            item_id = f"{task}-{doc_index}-{q_index}"
            common = dict(id=item_id, document=str(record["input"]), question=instruction, query=instruction,
                          group=f"leval/{task}", meta={"source": record.get("source")})
            if len(options) >= 2 and gold and all(ch in "ABCDEFGHIJ"[: len(options)] for ch in gold.group(1)):
                # Retrieval searches for the question and its options without the letters.
                yield EvalItem(
                    **common, answers=(gold.group(1),), task_type="mc", template=LEVAL_EXAM_TEMPLATE,
                    choices=tuple(text for _, text in options),
                )
            elif "topic" in task.lower():
                yield EvalItem(**common, answers=(output,), task_type="qa", template=LEVAL_TOPIC_TEMPLATE)
            else:
                summary = "summ" in task.lower() or "summar" in instruction.lower()
                yield EvalItem(
                    **common, answers=(output,), task_type="summary" if summary else "qa",
                    template=_leval_open_template(len(output.split())),
                )


# ------------------------------------------------------------------ LoCoMo
LOCOMO_TEMPLATE = PromptTemplate(
    body=(
        "{document}\n\n"
        "Based on the above context, write an answer in the form of a short phrase for the following question. "
        "Answer with exact words from the context whenever possible.\n\n"
        "Question: {question} Short answer:"
    ),
)
# Category 2 asks about time; LoCoMo's own prompt then asks for a date.
_LOCOMO_DATE_HINT = " Use DATE of CONVERSATION to answer with an approximate date."


def locomo_document(conversation: dict) -> str:
    """The conversation as text: per session a ``DATE:`` line, then ``Speaker: text`` lines."""
    a, b = conversation.get("speaker_a", "A"), conversation.get("speaker_b", "B")
    sessions = _locomo_session_keys(conversation)
    parts = [
        f"Below is a conversation between two people: {a} and {b}. The conversation takes place over "
        "multiple days and the date of each conversation is written at the beginning of the conversation."
    ]
    for number, key in sessions:
        lines = [f"DATE: {conversation.get(f'session_{number}_date_time', 'unknown')}", "CONVERSATION:"]
        for turn in conversation[key]:
            text = str(turn.get("text", "")).strip()
            if turn.get("blip_caption"):
                text += f" [shares {turn['blip_caption']}]"
            lines.append(f"{turn.get('speaker', '?')}: {text}")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def locomo_sessions(conversation: dict) -> list[list[dict[str, str]]]:
    """The conversation in chat form, session by session: ``speaker_a`` speaks as the user.

    Each message is ``{"role", "content": "Speaker: text"}``; a session's first
    message starts with its date (``[DATE: ...]``), as in :func:`locomo_document`.
    """
    a = conversation.get("speaker_a")
    sessions = []
    for number, key in _locomo_session_keys(conversation):
        messages = []
        for turn in conversation[key]:
            text = str(turn.get("text", "")).strip()
            if turn.get("blip_caption"):
                text += f" [shares {turn['blip_caption']}]"
            content = f"{turn.get('speaker', '?')}: {text}"
            if not messages:
                content = f"[DATE: {conversation.get(f'session_{number}_date_time', 'unknown')}] {content}"
            messages.append({"role": "user" if turn.get("speaker") == a else "assistant", "content": content})
        sessions.append(messages)
    return sessions


def _locomo_session_keys(conversation: dict) -> list[tuple[int, str]]:
    return sorted(
        (int(m.group(1)), key)
        for key in conversation
        if (m := re.fullmatch(r"session_(\d+)", key)) and isinstance(conversation[key], list)
    )


#: The last user turn of a LoCoMo question in chat form.
LOCOMO_CHAT_QUESTION = "{question} Answer in the form of a short phrase, with exact words from our conversation whenever possible."


def load_locomo(samples: list[dict], include_adversarial: bool = False, chat: bool = False) -> Iterator[EvalItem]:
    """LoCoMo questions about a conversation's transcript, or (``chat``) as the conversation's next user turn.

    In chat form the conversation so far is the long context (the target reads
    it, the drafter reads the turns retrieval picks) and the group names the
    question's category (``locomo-chat/cat1`` ...), reported separately.
    """
    for s_index, sample in enumerate(samples):
        if "conversation" not in sample or "qa" not in sample:
            raise RapidspecError(f"LoCoMo sample {s_index} lacks 'conversation' or 'qa'")
        document = locomo_document(sample["conversation"])
        history = tuple(message for session in locomo_sessions(sample["conversation"]) for message in session) if chat else ()
        sample_id = str(sample.get("sample_id", s_index))
        for q_index, qa in enumerate(sample["qa"]):
            category = qa.get("category")
            if category == LOCOMO_ADVERSARIAL and not include_adversarial:
                continue
            answer = qa.get("answer", qa.get("adversarial_answer"))
            if answer is None:
                continue
            question = str(qa["question"]).strip()
            prompt_question = question + (_LOCOMO_DATE_HINT if category == 2 else "")
            messages = ()
            if chat:
                messages = (*history, {"role": "user", "content": LOCOMO_CHAT_QUESTION.format(question=prompt_question)})
            yield EvalItem(
                id=f"{sample_id}-{q_index}", document=document, question=prompt_question, query=question,
                answers=(str(answer),), task_type="qa", template=LOCOMO_TEMPLATE, scorer="locomo_f1",
                group=f"locomo-chat/cat{category}" if chat else "locomo",
                meta={"category": category, "evidence": qa.get("evidence", [])}, messages=messages,
            )


# ------------------------------------------------------------------ detection and entry point
def _read_json_or_lines(path: Path) -> tuple[object, str]:
    """(parsed content, 'json' | 'jsonl')."""
    text = path.read_text(encoding="utf-8")
    try:
        content = json.loads(text)
    except json.JSONDecodeError:
        pass
    else:
        # A JSON-lines file of one record parses as one object.
        if isinstance(content, dict) and not content.get("synthetic"):
            return [content], "jsonl"
        return content, "json"
    lines = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise RapidspecError(f"{path} is neither JSON nor JSON lines (line {number}: {err.msg})") from None
    return lines, "jsonl"


def detect_format(content: object) -> str:
    """The benchmark format of parsed ``content``, from the fields of its first record."""
    if isinstance(content, dict) and content.get("synthetic"):
        return "synthetic"
    if not isinstance(content, list) or not content or not isinstance(content[0], dict):
        raise RapidspecError("cannot detect the format: expected a non-empty list of records")
    first = content[0]
    if {"question", "choice_A", "context"} <= first.keys():
        return "longbench2"
    if {"input", "instructions", "outputs"} <= first.keys():
        return "leval"
    if {"conversation", "qa"} <= first.keys():
        return "locomo"
    raise RapidspecError(f"cannot detect the format from fields {sorted(first)[:8]}; pass --format")


def load_items(
    path: str | Path | None,
    format: str | None = None,
    *,
    include_adversarial: bool = False,
    synthetic_options: dict | None = None,
) -> list[EvalItem]:
    """All items of a benchmark file (or the synthetic tasks), in document order.

    ``format`` is one of :data:`FORMATS` or ``None`` to detect it. The
    synthetic format needs no file; ``synthetic_options`` are passed to
    :func:`rapidspec.evaluation.synthetic.synthetic_items`.
    """
    if format is not None and format not in FORMATS:
        raise RapidspecError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    if format == "synthetic" or (path is None and format is None):
        return synthetic_items(**(synthetic_options or {}))
    if path is None:
        raise RapidspecError(f"--data is required for format {format}")
    path = Path(path)
    if not path.is_file():
        raise RapidspecError(f"no such data file: {path}")
    content, _ = _read_json_or_lines(path)
    detected = format or detect_format(content)
    chat = detected == "locomo-chat"
    if detected == "synthetic":
        return synthetic_items(**{**content.get("options", {}), **(synthetic_options or {})})
    if not isinstance(content, list):
        raise RapidspecError(f"{path}: expected a list of {detected} records")
    if detected == "longbench2":
        items = list(load_longbench2(content))
    elif detected == "leval":
        items = list(load_leval(content, path))
    else:
        items = list(load_locomo(content, include_adversarial, chat=chat))
    if not items:
        raise RapidspecError(f"{path} holds no {detected} items")
    return items
