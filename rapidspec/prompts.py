"""Target and drafter prompts from one template.

Both prompts are the same template filled with a different text (the whole
document for the target, the retrieved chunks for the drafter) and wrapped in
the model's chat template when it has one. Because the two differ only before
the question, they end at the same point and their continuations align token
for token.

A document longer than the target's window is middle-truncated (head and tail
kept, as LongBench does) with a warning, or refused with ``truncate="error"``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rapidspec.errors import RapidspecError

logger = logging.getLogger(__name__)

DEFAULT_BODY = (
    "Please read the following {source} and answer the question below.\n\n"
    "<text>\n{document}\n</text>\n\n"
    "Question: {question}"
)


@dataclass(frozen=True)
class PromptTemplate:
    """A prompt with ``{document}``, ``{question}`` and optionally ``{source}`` fields.

    ``source`` is filled with ``full_source`` for the whole document and with
    ``retrieved_source`` for retrieved chunks. ``chat`` wraps the text as one
    user turn of the tokenizer's chat template (when the tokenizer has one);
    otherwise ``plain_suffix`` is appended.
    """

    body: str = DEFAULT_BODY
    full_source: str = "text"
    retrieved_source: str = "retrieved text chunks"
    system: str | None = None
    chat: bool = True
    plain_suffix: str = "\nAnswer:"

    def __post_init__(self) -> None:
        for name in ("{document}", "{question}"):
            if name not in self.body:
                raise RapidspecError(f"prompt template must contain {name}")

    def text(self, document: str, question: str, retrieved: bool) -> str:
        source = self.retrieved_source if retrieved else self.full_source
        return self.body.replace("{source}", source).replace("{question}", question).replace(
            "{document}", document
        )


def prompt_ids(tokenizer, template: PromptTemplate, document: str, question: str, retrieved: bool) -> list[int]:
    """Token ids of the prompt, ending where the answer starts."""
    text = template.text(document, question, retrieved)
    if template.chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        if template.system is not None:
            messages.insert(0, {"role": "system", "content": template.system})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    ids = tokenizer(text + template.plain_suffix, add_special_tokens=True)["input_ids"]
    return [int(t) for t in ids]


def fit_document(
    tokenizer,
    template: PromptTemplate,
    document: str,
    question: str,
    max_prompt_tokens: int,
    truncate: str = "middle",
) -> tuple[str, int]:
    """Shorten ``document`` so that the full prompt fits ``max_prompt_tokens``.

    Returns ``(document, removed_tokens)``; ``removed_tokens`` is 0 when it
    already fits. Middle truncation keeps the first and last halves of the
    token budget of the document, as LongBench does.
    """
    overhead = len(prompt_ids(tokenizer, template, "", question, retrieved=False))
    budget = max_prompt_tokens - overhead
    doc_ids = tokenizer(document, add_special_tokens=False)["input_ids"]
    # Token counts of a document alone and inside a prompt differ by a few
    # tokens at the seams; keep a small margin.
    margin = 8
    if len(doc_ids) + margin <= budget:
        return document, 0
    if truncate == "error":
        raise RapidspecError(
            f"the document has {len(doc_ids)} tokens but only {budget} fit the model's window "
            f"with the question and the answer; use truncate='middle' to cut its middle"
        )
    keep = budget - margin
    if keep < 2:
        raise RapidspecError(
            f"the question and answer alone need {overhead} of {max_prompt_tokens} tokens of the window"
        )
    head = keep // 2
    tail = keep - head
    shortened = tokenizer.decode(doc_ids[:head]) + tokenizer.decode(doc_ids[len(doc_ids) - tail :])
    removed = len(doc_ids) - keep
    logger.warning(
        "document of %d tokens is longer than the window allows; cut %d tokens from its middle",
        len(doc_ids),
        removed,
    )
    return shortened, removed
