"""Chat messages (and documents) -> what the target and the drafter read.

The target always reads the whole conversation through the model's chat
template. Where the long context comes from decides what the drafter reads
(the "short" prompt; the target reads it too in mode ``rag``):

1. ``documents`` given: the target reads them in full in a system message
   before the conversation; the drafter reads what retrieval picks from them
   for the last user message, in the same place.
2. No documents, earlier turns: the conversation is the long context (the
   paper's multi-turn setting). Earlier turns, except the last
   ``recent_messages``, are the retrieval corpus, one segment per turn (long
   turns split further), so chunks never cross a turn and keep its speaker.
   The drafter reads the system message, the retrieved turns in their
   original order and with their roles, the recent turns verbatim, and the
   new user message.
3. A single user message (a document pasted into the chat): its final
   paragraph (the text after the last blank line, else after the last line
   break) is the query, everything before it the corpus; the drafter reads the
   retrieved chunks followed by that final paragraph.

``query`` overrides the retrieval query in every case. Both prompts end with
the same last user message, so their continuations align token for token.

A prompt longer than its window is refused (``truncate="error"``,
:class:`ContextLengthError`) or shortened (``"middle"``, :func:`fit_messages`):
the middle of the documents is cut first, then the oldest turns are dropped,
then the middle of the longest message is cut, each in steps that keep the
prompt's start the same over the next turns (so the prefix cache still hits).

``raw=True`` renders without chat template or role labels (the text
completions route): the messages' contents joined by blank lines.
"""

from __future__ import annotations

import bisect
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from rapidspec.config import MODE_TABLE
from rapidspec.errors import ContextLengthError, RapidspecError
from rapidspec.prompting.prompts import TEMPLATE_TOKENS, DeferredDrafterPrompt, PromptPair, chat_template_ids, cut_middle, text_ids
from rapidspec.retrieval import CHUNK_SEPARATOR

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
#: Roles read as another: ``developer`` is what OpenAI's newer models call the system prompt (as vLLM reads it).
ROLE_ALIASES = {"developer": "system"}
#: Earlier messages the drafter always reads verbatim (the last exchange).
DEFAULT_RECENT_MESSAGES = 2
DOCUMENTS_SYSTEM = "Answer using the following {source}.\n\n<documents>\n{documents}\n</documents>"
FULL_SOURCE = "documents"
RETRIEVED_SOURCE = "passages retrieved from the documents"
# Token counts of a text alone and inside a prompt differ at the seams.
_MARGIN_TOKENS = 8


@dataclass(frozen=True)
class Message:
    """One turn. ``tool_calls``: an assistant's calls (JSON text of OpenAI's list); ``tool_call_id``: the call a
    ``tool`` message answers."""

    role: str
    content: str
    tool_calls: str | None = None
    tool_call_id: str | None = None

    def to_dict(self) -> dict:
        """The dict a chat template reads (calls with their arguments as objects, as templates expect them)."""
        out: dict = {"role": self.role, "content": self.content}
        if self.tool_calls is not None:
            out["tool_calls"] = [_call_for_template(call) for call in json.loads(self.tool_calls)]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _call_for_template(call: dict) -> dict:
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError:
            pass  # the template shows it as the text it is
    return {**call, "function": function}


def parse_messages(raw) -> tuple[Message, ...]:
    """Validated messages from OpenAI-style dicts (string content, or a list of text parts)."""
    if not isinstance(raw, (list, tuple)) or not raw:
        raise RapidspecError("messages must be a non-empty list", param="messages")
    messages = []
    for index, item in enumerate(raw):
        if isinstance(item, Message):
            messages.append(item)
            continue
        where = f"messages[{index}]"
        if not isinstance(item, dict):
            raise RapidspecError(f"{where} must be an object with 'role' and 'content'", param=where)
        role, content = item.get("role"), item.get("content")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise RapidspecError(f"{where}.role must be one of {', '.join([*ROLES, *ROLE_ALIASES])}, got {role!r:.60}",
                                 param=f"{where}.role")
        calls = item.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list)):
            raise RapidspecError(f"{where}.tool_calls must be a list, in an assistant message", param=f"{where}.tool_calls")
        if content is None and calls:  # an assistant message that only calls tools
            content = ""
        call_id = item.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise RapidspecError(f"{where}.tool_call_id must be a string", param=f"{where}.tool_call_id")
        if role == "tool" and not (messages and (messages[-1].tool_calls or messages[-1].role == "tool")):
            raise RapidspecError(f"{where}: a tool message answers the tool_calls of the assistant message before "
                                 "it", param=f"{where}.role")
        messages.append(Message(role, _text_content(content, f"{where}.content"),
                                json.dumps(calls) if calls else None, call_id if role == "tool" else None))
    if messages[-1].role not in ("user", "tool"):
        raise RapidspecError("the last message must be a user message (or a tool's result)", param="messages")
    if not messages[-1].content.strip():
        raise RapidspecError(f"the last {messages[-1].role} message is empty", param="messages")
    return tuple(messages)


def _text_content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RapidspecError(f"{where}: only text content parts are supported", param=where)
            texts.append(part["text"])
        return "".join(texts)
    raise RapidspecError(f"{where} must be a string or a list of text parts", param=where)


def parse_documents(raw) -> tuple[str, ...]:
    """Documents as texts: strings, or ``{"text", "title"?}`` objects (title on its own line first)."""
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)):
        raise RapidspecError("documents must be a list", param="documents")
    texts = []
    for index, item in enumerate(raw):
        where = f"documents[{index}]"
        title = None
        if isinstance(item, dict):
            title, item = item.get("title"), item.get("text")
            if title is not None and not isinstance(title, str):
                raise RapidspecError(f"{where}.title must be a string", param=where)
        if not isinstance(item, str) or not item.strip():
            raise RapidspecError(f"{where} must be a non-empty text (a string or an object with 'text')", param=where)
        texts.append(f"{title}\n{item}" if title else item)
    return tuple(texts)


def render(tokenizer, messages: Sequence[Message], raw: bool = False) -> list[int]:
    """Token ids of ``messages`` ending where the assistant's answer starts."""
    if raw:
        return text_ids(tokenizer, CHUNK_SEPARATOR.join(m.content for m in messages))
    if getattr(tokenizer, "chat_template", None):
        return chat_template_ids(tokenizer, [m.to_dict() for m in messages])
    return text_ids(tokenizer, "".join(f"{m.role.capitalize()}: {m.content}\n\n" for m in messages) + "Assistant:")


def with_documents(messages: Sequence[Message], documents: Sequence[str], source: str = FULL_SOURCE) -> list[Message]:
    """``messages`` with ``documents`` in one system message before the conversation, as the target reads them.

    The request's own system messages come first in that message, then
    :data:`DOCUMENTS_SYSTEM` naming ``source`` (``FULL_SOURCE``, or
    ``RETRIEVED_SOURCE`` for the drafter's retrieved passages). The same
    placement lets another server read exactly what rapidspec's target reads
    (``rapidspec bench serve --peer``).
    """
    n_system = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    system_text = CHUNK_SEPARATOR.join(m.content for m in messages[:n_system])
    extra = DOCUMENTS_SYSTEM.format(source=source, documents=CHUNK_SEPARATOR.join(documents))
    text = CHUNK_SEPARATOR.join(t for t in (system_text, extra) if t)
    return [Message("system", text), *messages[n_system:]]


def chat_prompts(
    tokenizer,
    retriever,
    messages: Sequence[Message],
    documents: Sequence[str] = (),
    *,
    mode: str,
    target_window: int,
    drafter_window: int,
    truncate: str = "middle",
    query: str | None = None,
    recent_messages: int = DEFAULT_RECENT_MESSAGES,
    raw: bool = False,
    defer: bool = False,
) -> PromptPair:
    """The target's and the drafter's prompts of a conversation (see the module docstring); ``defer`` as in
    :func:`rapidspec.prompting.prompts.document_prompts`."""
    if recent_messages < 0:
        raise RapidspecError(f"recent_messages must be >= 0, got {recent_messages}", param="recent_messages")
    if query is not None and not query.strip():
        raise RapidspecError("the query is empty", param="query")
    talk = _Conversation.of(messages, documents, recent_messages)
    spec = MODE_TABLE[mode]
    target_reads_retrieved = spec.target_reads == "retrieved"
    document_at = 0 if documents else None  # the system message that holds them

    def retrieve() -> tuple[object, tuple[int, ...], list[Message]]:
        return talk.retrieve(retriever, query) if spec.uses_retrieval else (None, (), talk.long_messages)

    def drafter_prompt(short_messages, target_messages) -> tuple[int, ...] | None:
        if spec.drafter_reads not in ("full", "retrieved"):  # a streaming view is the engine's
            return None
        drafter_messages = short_messages if spec.drafter_reads == "retrieved" else target_messages
        return tuple(fit_messages(tokenizer, drafter_messages, drafter_window, truncate, raw, document_at)[0])

    if defer and spec.uses_retrieval and not target_reads_retrieved:
        target_ids, truncated = fit_messages(tokenizer, talk.long_messages, target_window, truncate, raw, document_at)
        target_ids = tuple(target_ids)

        def resolve() -> PromptPair:
            found, turns, short_messages = retrieve()
            return PromptPair(target_ids, drafter_prompt(short_messages, talk.long_messages), found, truncated,
                              retrieved_turns=turns)

        embed = 0 if talk.corpus_text is None else retriever.tokens_to_embed(talk.corpus_text, len(target_ids))
        deferred = DeferredDrafterPrompt(resolve, retriever.drafter_budget(len(target_ids)) + TEMPLATE_TOKENS, embed)
        return PromptPair(target_ids, None, None, truncated, deferred=deferred)
    retrieval, turns, short_messages = retrieve()
    target_messages = short_messages if target_reads_retrieved else talk.long_messages
    target_ids, truncated = fit_messages(tokenizer, target_messages, target_window, truncate, raw, document_at)
    drafter_ids = drafter_prompt(short_messages, target_messages)
    return PromptPair(tuple(target_ids), drafter_ids, retrieval, truncated, target_reads_retrieved, turns)


@dataclass(frozen=True)
class _Conversation:
    """A conversation as the prompts read it: the long messages the target reads in full, and what retrieval
    searches (``corpus_text``: the documents or a pasted text; ``corpus_turns``: the earlier turns but the
    ``recent`` ones; both None: nothing to retrieve from)."""

    messages: Sequence[Message]
    documents: Sequence[str]
    n_system: int  # leading system messages
    question: str  # the last user message (after tool results too)
    long_messages: list[Message]
    corpus_text: str | None = None
    corpus_turns: list[Message] | None = None
    recent: list[Message] = field(default_factory=list)
    pasted: tuple[str, str, str] | None = None  # (text, what joins it to the question, the question)

    @classmethod
    def of(cls, messages: Sequence[Message], documents: Sequence[str], recent_messages: int) -> "_Conversation":
        n_system = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
        rest = list(messages[n_system:])
        earlier, last = rest[:-1], rest[-1]
        question = next((m.content for m in reversed(rest) if m.role == "user"), last.content)
        talk = cls(messages, documents, n_system, question, [])
        if documents:
            return replace(talk, long_messages=with_documents(messages, documents),
                           corpus_text=CHUNK_SEPARATOR.join(documents))
        if earlier:
            recent = earlier[len(earlier) - recent_messages :] if recent_messages else []
            turns = earlier[: len(earlier) - len(recent)]
            return replace(talk, long_messages=talk.with_system() + rest, recent=recent,
                           corpus_turns=turns if any(m.content.strip() for m in turns) else None)
        pasted = _split_pasted(last.content)
        return replace(talk, long_messages=talk.with_system() + [last], pasted=pasted,
                       corpus_text=pasted[0] if pasted[0].strip() else None)

    def with_system(self) -> list[Message]:
        """The leading system messages as one (none when they are empty)."""
        text = CHUNK_SEPARATOR.join(m.content for m in self.messages[: self.n_system])
        return [Message("system", text)] if text else []

    def retrieve(self, retriever, query: str | None) -> tuple[object, tuple[int, ...], list[Message]]:
        """(retrieval, the turns it picked, the short messages the drafter reads)."""
        if self.corpus_text is None and self.corpus_turns is None:
            return None, (), self.long_messages
        last = self.messages[-1]
        if self.documents:
            retrieval = retriever.retrieve(self.corpus_text, query or self.question)
            return retrieval, (), with_documents(self.messages, (retrieval.text,), RETRIEVED_SOURCE)
        if self.corpus_turns is not None:
            retrieval = retriever.retrieve_segments([m.content for m in self.corpus_turns], query or self.question)
            kept, picked = _retrieved_turns(self.corpus_turns, retrieval)
            return retrieval, tuple(self.n_system + i for i in picked), self.with_system() + kept + self.recent + [last]
        text, joint, question = self.pasted
        retrieval = retriever.retrieve(self.corpus_text, query or question)
        return retrieval, (), self.with_system() + [Message("user", retrieval.text + joint + question)]


def _retrieved_turns(corpus: Sequence[Message], retrieval) -> tuple[list[Message], list[int]]:
    """The corpus messages retrieval picked (their picked chunks only), in order, and their indices.

    Example: corpus turns of 10, 5 and 8 characters start at offsets 0, 12
    and 19 of the joined text; chunks at offsets 12 and 19 pick turns 1 and 2.
    """
    starts, offset = [], 0
    for message in corpus:
        starts.append(offset)
        offset += len(message.content) + len(CHUNK_SEPARATOR)
    pieces: dict[int, list[str]] = {}
    for chunk in retrieval.chunks:  # in document order
        pieces.setdefault(bisect.bisect_right(starts, chunk.char_start) - 1, []).append(chunk.text)
    picked = sorted(pieces)
    return [Message(corpus[i].role, CHUNK_SEPARATOR.join(pieces[i])) for i in picked], picked


def _split_pasted(text: str) -> tuple[str, str, str]:
    """(corpus, separator, final paragraph) of a pasted message; no corpus when it has one paragraph.

    Example: ``"A long text.\\n\\nWho wrote it?"`` -> ``("A long text.", "\\n\\n", "Who wrote it?")``.
    """
    body = text.rstrip()
    for separator in ("\n\n", "\n"):
        cut = body.rfind(separator)
        if cut > 0 and body[cut:].strip():
            return body[:cut], separator, body[cut + len(separator) :] + text[len(body) :]
    return "", "", text


def fit_messages(tokenizer, messages: Sequence[Message], window: int, truncate: str, raw: bool = False,
                 document_at: int | None = None) -> tuple[list[int], int]:
    """Rendered ``messages`` within ``window`` tokens, and how many tokens were removed to fit.

    In order: 1 cut the middle of the documents (the message at
    ``document_at``, when given); 2 drop the oldest turns (the conversation
    still starts with a user turn); 3 cut the middle of the longest message.
    Cuts and drops remove whole quanta of :func:`cut_quantum` tokens, so the
    next turns of a growing conversation get the very same cut until the
    conversation outgrows it: their prompts keep the same start, and the
    prefix cache serves it. Turns are dropped by their measured token counts,
    so the prompt is rendered a few times, not once per dropped turn.
    """
    messages = list(messages)
    ids = render(tokenizer, messages, raw)
    if len(ids) <= window:
        return ids, 0
    if truncate == "error":
        raise ContextLengthError(
            f"the prompt has {len(ids)} tokens but the model's window leaves {window} for it after the answer's "
            f"max tokens; shorten the input, lower the answer length, or set truncate='middle'"
        )
    original, quantum = len(ids), cut_quantum(window)
    if document_at is not None:  # 1
        ids = _cut_message(tokenizer, messages, document_at, len(ids) - window, quantum, raw, MIN_DOCUMENT_TOKENS)
    if len(ids) > window:  # 2
        ids = _drop_oldest_turns(tokenizer, messages, ids, window, quantum, raw)
    for _ in range(3):  # 3 (seams may leave a few tokens over)
        if len(ids) <= window:
            break
        longest = max(range(len(messages)), key=lambda i: len(messages[i].content))
        ids = _cut_message(tokenizer, messages, longest, len(ids) - window, quantum, raw, 2, strict=True)
    if len(ids) > window:
        raise ContextLengthError(f"the prompt cannot be cut to fit {window} tokens of the window")
    logger.warning("prompt of %d tokens is longer than the window allows; cut to %d tokens", original, len(ids))
    return ids, original - len(ids)


#: Fewest tokens of the documents that a cut keeps before turns are dropped.
MIN_DOCUMENT_TOKENS = 256


def cut_quantum(window: int) -> int:
    """Tokens a cut or a drop removes a multiple of: 1/16 of the window (at least the seam margin)."""
    return max(_MARGIN_TOKENS, window // 16)


def _rounded(excess: int, quantum: int) -> int:
    """``excess`` plus the seam margin, rounded up to a multiple of ``quantum``."""
    return -(-(excess + _MARGIN_TOKENS) // quantum) * quantum


def _cut_message(tokenizer, messages: list[Message], index: int, excess: int, quantum: int, raw: bool,
                 min_keep: int, strict: bool = False) -> list[int]:
    """Cut the middle of ``messages[index]`` (in place) by ``excess`` rounded up to the quantum; new render.

    Keeps at least ``min_keep`` tokens (so it may remove less); ``strict``:
    raise when even that cannot remove ``excess``.
    """
    content_ids = tokenizer(messages[index].content, add_special_tokens=False)["input_ids"]
    keep = max(min_keep, len(content_ids) - _rounded(excess, quantum))
    if strict and len(content_ids) - keep < excess:
        keep = len(content_ids) - excess - _MARGIN_TOKENS
        if keep < min_keep:
            raise ContextLengthError("the prompt cannot be cut to fit the window")
    if keep < len(content_ids):
        messages[index] = replace(messages[index], content=cut_middle(tokenizer, content_ids, keep))
    return render(tokenizer, messages, raw)


def _drop_oldest_turns(tokenizer, messages: list[Message], ids: list[int], window: int, quantum: int,
                       raw: bool) -> list[int]:
    """Drop the oldest non-system turns (in place) until the prompt fits; returns its new render."""
    first = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    turns = messages[first:]
    if len(turns) < 2:
        return ids
    contents = tokenizer([m.content for m in turns], add_special_tokens=False)["input_ids"]
    per_turn = [len(c) for c in contents]
    overhead = max(0, len(ids) - sum(per_turn)) // len(messages)  # role labels, template tokens
    target = _rounded(len(ids) - window, quantum)
    dropped = removed = 0
    while dropped < len(turns) - 1 and (removed < target or turns[dropped].role != "user"):
        removed += per_turn[dropped] + overhead
        dropped += 1
    while True:
        del messages[first:first + dropped]
        ids = render(tokenizer, messages, raw)
        if len(ids) <= window or len(messages) - first < 2:
            return ids
        dropped = 1  # the estimate fell short at the seams: one more turn (and any non-user after it)
        while len(messages) - first - dropped > 1 and messages[first + dropped].role != "user":
            dropped += 1
