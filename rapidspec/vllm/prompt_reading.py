"""A vLLM request's prompt (token ids) read back as the chat rapidspec would have built it.

vLLM hands a proposer token ids only. RAPID's drafter needs the long context
and the query apart, so the prompt is read back into chat messages:

1. The chat template's text around each message is learnt once, by rendering
   placeholder messages (system, user, assistant, user, then the generation
   prompt) and splitting the text at them (:class:`ChatLayout`).
2. A prompt's text is split at those seams into messages, and the split is
   kept only when rendering the messages again gives the prompt's tokens
   exactly (tool calls, images or a template that moves text around fail this
   check, and are read as in 3).
3. Otherwise (no chat template, a completions prompt, a failed check) the
   prompt is one raw text: ``rapidspec chat`` reads it as a pasted document,
   its last paragraph the query.

Documents placed as rapidspec places them (:func:`rapidspec.prompting.conversation.with_documents`:
a system message ending in ``<documents>...</documents>``) are taken out of
the system message again, so :func:`rapidspec.prompting.conversation.chat_prompts`
retrieves from them as for a request that sent ``documents``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rapidspec.prompting.conversation import DOCUMENTS_SYSTEM, FULL_SOURCE, Message, render
from rapidspec.retrieval import CHUNK_SEPARATOR

_DOCUMENTS_HEAD, _DOCUMENTS_TAIL = DOCUMENTS_SYSTEM.format(source=FULL_SOURCE, documents="\x00").split("\x00")


@dataclass(frozen=True)
class ChatLayout:
    """The text a chat template puts around messages: before a system message (``head``) or a first user
    message (``user_head``: None where it equals ``head``'s role), between a system and a user message, a user
    and an assistant message, an assistant and a user message, and after the last user message up to where the
    answer starts (``tail``)."""

    head: str
    system_user: str
    user_assistant: str
    assistant_user: str
    tail: str
    user_head: str | None = None

    @classmethod
    def learn(cls, tokenizer) -> ChatLayout | None:
        """The layout of ``tokenizer``'s chat template, or None (no template, or one these seams do not
        describe: it refuses a system message, repeats or drops the placeholders)."""
        pieces = _pieces(tokenizer, ("system", "user", "assistant", "user"))
        if pieces is None or not all(pieces[1:]):
            return None  # a seam that is empty cannot be found again
        without_system = _pieces(tokenizer, ("user", "assistant", "user"))
        return cls(*pieces, user_head=None if without_system is None else without_system[0])

    def messages(self, text: str) -> list[Message] | None:
        """``text`` split at the seams into an optional system message, then alternating user and assistant
        messages ending with a user message; None where it does not split so."""
        if not text.endswith(self.tail):
            return None
        found = self._split(text, self.head, "system")
        if found is None and self.user_head is not None:
            found = self._split(text, self.user_head, "user")
        return found

    def _split(self, text: str, head: str, first_role: str) -> list[Message] | None:
        if not text.startswith(head) or len(text) < len(head) + len(self.tail):
            return None
        body = text[len(head): len(text) - len(self.tail)]
        seams = {"system": self.system_user, "user": self.user_assistant, "assistant": self.assistant_user}
        following = {"system": "user", "user": "assistant", "assistant": "user"}
        messages, position, role = [], 0, first_role
        while True:
            found = body.find(seams[role], position)
            if found < 0:
                break
            messages.append(Message(role, body[position:found]))
            position, role = found + len(seams[role]), following[role]
        if role != "user":
            return None
        messages.append(Message("user", body[position:]))
        return messages


def _pieces(tokenizer, roles: tuple[str, ...]) -> list[str] | None:
    """The chat template's text of placeholder messages in ``roles`` (then the generation prompt), split at the
    placeholders; None where the template refuses them or does not keep each placeholder once."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    placeholders = [f"\x00rapidspec-{i}\x00" for i in range(len(roles))]
    try:
        text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in zip(roles, placeholders)],
                                             add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001  (templates raise what they like, e.g. on a system message)
        return None
    if not isinstance(text, str) or any(text.count(p) != 1 for p in placeholders):
        return None
    return re.split("|".join(map(re.escape, placeholders)), text)


@dataclass(frozen=True)
class ReadPrompt:
    """A prompt read back: its messages, the documents taken out of its system message, and whether it was a
    raw text (``raw``: one user message holding the whole prompt, rendered without a template)."""

    messages: tuple[Message, ...]
    documents: tuple[str, ...] = ()
    raw: bool = False


def read_prompt(tokenizer, layout: ChatLayout | None, prompt_ids: list[int]) -> ReadPrompt:
    """``prompt_ids`` as messages (module docstring); a raw text where they do not render back to the same ids."""
    text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    messages = layout.messages(text) if layout is not None else None
    if messages is not None and render(tokenizer, messages) == list(prompt_ids):
        return _documents_taken_out(messages)
    return ReadPrompt((Message("user", _without_bos(tokenizer, text)),), raw=True)


def _documents_taken_out(messages: list[Message]) -> ReadPrompt:
    """``messages`` with rapidspec's documents block taken out of the system message (module docstring)."""
    system = messages[0].content
    start = system.rfind(_DOCUMENTS_HEAD)
    if start < 0 or not system.endswith(_DOCUMENTS_TAIL):
        return ReadPrompt(tuple(messages))
    documents = system[start + len(_DOCUMENTS_HEAD): len(system) - len(_DOCUMENTS_TAIL)]
    own = system[:start]
    if own and not own.endswith(CHUNK_SEPARATOR):
        return ReadPrompt(tuple(messages))
    own = own[: len(own) - len(CHUNK_SEPARATOR)] if own else ""
    rest = messages[1:]
    return ReadPrompt(tuple(([Message("system", own)] if own else []) + rest), (documents,))


def _without_bos(tokenizer, text: str) -> str:
    """``text`` without the BOS token's text at its start (the raw render adds it again)."""
    bos = getattr(tokenizer, "bos_token", None)
    return text[len(bos):] if bos and text.startswith(bos) else text
