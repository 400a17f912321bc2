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

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from rapidspec.config import MODE_TABLE, DecodeConfig
from rapidspec.drafting.streaming import streaming_view
from rapidspec.errors import ContextLengthError, RapidspecError

logger = logging.getLogger(__name__)

#: What the template adds to the retrieved text in the drafter's prompt, at most (an estimate before retrieval).
TEMPLATE_TOKENS = 128

DEFAULT_BODY = (
    "Please read the following {source} and answer the question below.\n\n"
    "<text>\n{document}\n</text>\n\n"
    "Question: {question}"
)


@dataclass(frozen=True)
class PromptPair:
    """What the target and the drafter read, ready to decode.

    Both token sequences end where the answer starts, at the same text, so
    that their continuations align token for token. ``drafter_ids`` is None
    for modes without a drafter. ``retrieved_turns`` lists the indices of the
    chat messages retrieval picked (conversation mode only).
    """

    target_ids: tuple[int, ...]
    drafter_ids: tuple[int, ...] | None = None
    retrieval: object | None = None  # rapidspec.retrieval.RetrievalResult
    truncated_tokens: int = 0
    target_reads_retrieved: bool = False
    retrieved_turns: tuple[int, ...] = ()
    deferred: DeferredDrafterPrompt | None = None  # retrieval and drafter_ids, built when the drafter is prepared


@dataclass(frozen=True)
class DeferredDrafterPrompt:
    """Retrieval and the drafter's prompt, left until the drafter is prepared (:mod:`rapidspec.drafting.join`).

    ``resolve()`` retrieves and returns the complete :class:`PromptPair` (the same target prompt);
    ``drafter_tokens``: an upper estimate of the drafter's prompt (the retrieval budget and the template);
    ``embed_tokens``: document tokens retrieval embeds first (0: the index is built, or the method embeds nothing).
    """

    resolve: Callable[[], PromptPair]
    drafter_tokens: int
    embed_tokens: int = 0


@dataclass(frozen=True)
class PromptTemplate:
    """A prompt with ``{document}``, ``{question}`` and optionally ``{source}`` fields.

    ``source`` is filled with ``full_source`` for the whole document and with
    ``retrieved_source`` for retrieved chunks. ``chat`` wraps the text as one
    user turn of the tokenizer's chat template (when the tokenizer has one);
    otherwise ``plain_suffix`` is appended. ``answer_prefix`` opens the
    answer (RULER's "The special magic numbers for KEY ... are"): it follows
    the prompt in both views, so the model continues it, and is not part of
    the answer's text.
    """

    body: str = DEFAULT_BODY
    full_source: str = "text"
    retrieved_source: str = "retrieved text chunks"
    system: str | None = None
    chat: bool = True
    plain_suffix: str = "\nAnswer:"
    answer_prefix: str = ""

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
        ids = chat_template_ids(tokenizer, messages)
        if template.answer_prefix:
            ids += [int(t) for t in tokenizer(template.answer_prefix, add_special_tokens=False)["input_ids"]]
        return ids
    suffix = template.plain_suffix + (" " + template.answer_prefix if template.answer_prefix else "")
    return text_ids(tokenizer, text + suffix)


def chat_template_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, ending with the assistant's turn."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of plain ``text`` (with the tokenizer's special tokens, e.g. BOS)."""
    return [int(t) for t in tokenizer(text, add_special_tokens=True)["input_ids"]]


def cut_middle(tokenizer, token_ids: list[int], keep_tokens: int) -> str:
    """The text of ``token_ids`` without its middle: the first and last halves of ``keep_tokens`` tokens."""
    head = keep_tokens // 2
    return tokenizer.decode(token_ids[:head]) + tokenizer.decode(token_ids[len(token_ids) - (keep_tokens - head) :])


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
        raise ContextLengthError(
            f"the document has {len(doc_ids)} tokens but only {budget} fit the model's window "
            f"with the question and the answer; use truncate='middle' to cut its middle",
            param="document",
        )
    keep = budget - margin
    if keep < 2:
        raise ContextLengthError(
            f"the question and answer alone need {overhead} of {max_prompt_tokens} tokens of the window",
            param="question",
        )
    shortened = cut_middle(tokenizer, doc_ids, keep)
    removed = len(doc_ids) - keep
    logger.warning(
        "document of %d tokens is longer than the window allows; cut %d tokens from its middle",
        len(doc_ids),
        removed,
    )
    return shortened, removed


def document_prompts(
    tokenizer,
    template: PromptTemplate,
    retriever,
    document: str,
    question: str,
    config: DecodeConfig,
    target_window: int,
    drafter_window: int,
    query: str | None = None,
    corpus: str | None = None,
    defer: bool = False,
) -> PromptPair:
    """The prompts of a (document, question) pair for ``config.mode``.

    ``corpus``: the text retrieval reads instead of ``document`` (an unrelated
    document, for robustness studies); the target still reads ``document``.
    ``defer``: where the target reads the whole document, leave retrieval and the
    drafter's prompt to :attr:`PromptPair.deferred` (run when the drafter is prepared).
    """
    if not document or not document.strip():
        raise RapidspecError("the document is empty", param="document")
    if not question or not question.strip():
        raise RapidspecError("the question is empty", param="question")
    spec = MODE_TABLE[config.mode]
    if corpus is not None and not corpus.strip():
        raise RapidspecError("the retrieval corpus is empty", param="corpus")
    target_reads_retrieved = spec.target_reads == "retrieved"

    def retrieve():
        return retriever.retrieve(corpus or document, query or question) if spec.uses_retrieval else None

    def drafter_prompt(retrieval, target_doc: str) -> tuple[int, ...] | None:
        if spec.drafter_reads not in ("full", "retrieved"):  # a streaming view is made below
            return None
        drafter_reads_retrieved = spec.drafter_reads == "retrieved"
        drafter_doc = retrieval.text if drafter_reads_retrieved else target_doc
        drafter_doc, _ = fit_document(tokenizer, template, drafter_doc, question, drafter_window, config.truncate)
        return tuple(prompt_ids(tokenizer, template, drafter_doc, question, drafter_reads_retrieved))

    deferring = defer and spec.uses_retrieval and not target_reads_retrieved
    retrieval = None if deferring else retrieve()
    target_doc = retrieval.text if target_reads_retrieved else document
    target_doc, truncated = fit_document(tokenizer, template, target_doc, question, target_window, config.truncate)
    target_ids = tuple(prompt_ids(tokenizer, template, target_doc, question, target_reads_retrieved))
    if deferring:
        @functools.cache  # once per prompts: a request decoded again (a sample of many) retrieves once
        def resolve() -> PromptPair:
            found = retrieve()
            return PromptPair(target_ids, drafter_prompt(found, target_doc), found, truncated)

        deferred = DeferredDrafterPrompt(resolve, retriever.drafter_budget(len(target_ids)) + TEMPLATE_TOKENS,
                                         retriever.tokens_to_embed(corpus or document, len(target_ids)))
        return PromptPair(target_ids, None, None, truncated, deferred=deferred)
    pair = PromptPair(target_ids, drafter_prompt(retrieval, target_doc), retrieval, truncated, target_reads_retrieved)
    return with_streaming_drafter(pair, config, drafter_window)


def with_streaming_drafter(pair: PromptPair, config: DecodeConfig, drafter_window: int) -> PromptPair:
    """``pair`` with the drafter's StreamingLLM view of the target's prompt when ``config.mode`` drafts from one
    (at most ``drafter_window`` tokens)."""
    if MODE_TABLE[config.mode].drafter_reads != "streaming":
        return pair
    budget = min(config.streaming_tokens, drafter_window)
    view = streaming_view(pair.target_ids, min(config.sink_tokens, budget), budget)
    return replace(pair, drafter_ids=view)
