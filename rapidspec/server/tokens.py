"""Token work the server does without the engine: size checks before a request queues, /tokenize, /detokenize.

The engine thread owns the engine's tokenizer; this uses a copy of its own,
one call at a time, called off the event loop (``asyncio.to_thread``). So
sizing up a 5 MB document neither waits for the engine nor holds it: a
request whose texts cannot fit is refused before any retrieval or prefill.
Counting stops as soon as the limit is passed.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence

from rapidspec.conversation import Message
from rapidspec.errors import RapidspecError
from rapidspec.prompts import chat_template_ids

#: Characters tokenized at a time while counting (a few thousand tokens).
SLICE_CHARS = 16384


class ServerTokens:
    """A private tokenizer and the checks and routes that use it."""

    def __init__(self, tokenizer, max_document_tokens: int) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)
        self._lock = threading.Lock()
        self.max_document_tokens = max_document_tokens

    def _count_upto(self, text: str, limit: int) -> int:
        """Tokens of ``text``, counted slice by slice until more than ``limit`` (slice edges: +-1 token each)."""
        count = 0
        for start in range(0, len(text), SLICE_CHARS):
            count += len(self._tokenizer.encode(text[start : start + SLICE_CHARS], add_special_tokens=False))
            if count > limit:
                break
        return count

    def check_fits(self, messages: Sequence[Message], documents: Sequence[str], truncate: str, window: int) -> None:
        """RapidspecError (context_length_exceeded) when the texts alone cannot fit.

        With ``truncate="error"`` the limit is the window; with ``"middle"``
        (the engine cuts what is too long) it is ``max_document_tokens``, so
        retrieval never runs over an unbounded text.
        """
        limit = window if truncate == "error" else self.max_document_tokens
        count = 0
        with self._lock:
            for text in [*documents, *(m.content for m in messages)]:
                count += self._count_upto(text, limit - count)
                if count > limit:
                    break
        if count <= limit:
            return
        if truncate == "error":
            raise RapidspecError(
                f"the documents and messages hold more than {limit} tokens, more than the {window}-token window; "
                "shorten them, or send \"truncate\": \"middle\" to cut the document's middle",
                param="documents" if documents else "messages", code="context_length_exceeded")
        raise RapidspecError(
            f"the documents and messages hold more than {limit} tokens, the server's limit even with truncation "
            "(rapidspec serve --max-document-tokens)", param="documents" if documents else "messages",
            code="context_length_exceeded")

    def tokenize(self, prompt: str | None, messages: Sequence[Message] | None, add_special_tokens: bool) -> list[int]:
        """The ids of a prompt, or of messages through the chat template (with the assistant's turn opened)."""
        with self._lock:
            if messages is not None:
                if not getattr(self._tokenizer, "chat_template", None):
                    raise RapidspecError("this model's tokenizer has no chat template: send a prompt instead of "
                                         "messages", param="messages")
                return chat_template_ids(self._tokenizer, [m.to_dict() for m in messages])
            return list(self._tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's text on its own (for /tokenize and log-probabilities)."""
        with self._lock:
            return [self._tokenizer.decode([t], clean_up_tokenization_spaces=False) for t in token_ids]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        with self._lock:
            vocab = len(self._tokenizer)
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
                raise RapidspecError(f"tokens must be integers in [0, {vocab})", param="tokens")
            return self._tokenizer.decode(list(token_ids), clean_up_tokenization_spaces=False)
