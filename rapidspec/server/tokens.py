"""Token work the server does without the engine: size checks before a request queues, /tokenize, /detokenize,
and the texts and bytes of tokens in log-probabilities.

The engine thread owns the engine's tokenizer; :class:`ServerTokens` uses a
copy of its own, one call at a time, called off the event loop
(``asyncio.to_thread``). So sizing up a 5 MB document neither waits for the
engine nor holds it: a request whose texts cannot fit is refused before any
retrieval or prefill. Counting goes a slice at a time and stops as soon as
the limit is passed, so the cost of a check is bounded by the limit, not by
the text. :class:`TokenPieces` (another copy, another lock, a cache) gives
log-probabilities their token texts and bytes on the event loop, so they
never wait behind a size check or a /tokenize.
"""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Sequence

from rapidspec.errors import RapidspecError
from rapidspec.prompting.conversation import Message
from rapidspec.prompting.prompts import chat_template_ids

#: Characters tokenized at a time while counting (a few thousand tokens).
SLICE_CHARS = 16384
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback


class ServerTokens:
    """A private tokenizer and the checks and routes that use it."""

    def __init__(self, tokenizer, max_document_tokens: int) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)
        self._lock = threading.Lock()
        self.max_document_tokens = max_document_tokens
        self.message_tokens = _template_tokens_per_message(self._tokenizer)

    def _count_upto(self, text: str, limit: int) -> int:
        """Tokens of ``text``, counted slice by slice until more than ``limit`` (slice edges: +-1 token each)."""
        count = 0
        for start in range(0, len(text), SLICE_CHARS):
            count += len(self._tokenizer.encode(text[start : start + SLICE_CHARS], add_special_tokens=False))
            if count > limit:
                break
        return count

    def count_upto(self, texts: Sequence[str], limit: int, per_text: int = 0) -> int:
        """Tokens of ``texts`` (and ``per_text`` more for each), counted until more than ``limit``."""
        count = per_text * len(texts)
        with self._lock:
            for text in texts:
                if count > limit:
                    break
                count += self._count_upto(text, limit - count)
        return count

    def check_fits(self, messages: Sequence[Message], documents: Sequence[str], truncate: str, window: int,
                   query: str | None = None) -> None:
        """RapidspecError (context_length_exceeded) when the texts alone cannot fit.

        Counted: the documents, each message with the chat template's tokens around it, and the query.
        With ``truncate="error"`` the limit is the window; with ``"middle"``
        (the engine cuts what is too long) it is ``max_document_tokens``, so
        retrieval never runs over an unbounded text.
        """
        limit = window if truncate == "error" else self.max_document_tokens
        texts = [*documents, *(m.content for m in messages), *([query] if query else [])]
        if self.count_upto(texts, limit) + self.message_tokens * len(messages) <= limit:
            return
        what = "the documents, messages and query" if query else "the documents and messages"
        param = "documents" if documents else "messages"
        if truncate == "error":
            raise RapidspecError(
                f"{what} hold more than {limit} tokens, more than the {window}-token window; "
                "shorten them, or send \"truncate\": \"middle\" to cut the document's middle",
                param=param, code="context_length_exceeded")
        raise RapidspecError(
            f"{what} hold more than {limit} tokens, the server's limit even with truncation "
            "(rapidspec serve --max-document-tokens)", param=param, code="context_length_exceeded")

    def tokenize(self, prompt: str | None, messages: Sequence[Message] | None, add_special_tokens: bool) -> list[int]:
        """The ids of a prompt, or of messages through the chat template (with the assistant's turn opened).

        Texts of more than ``max_document_tokens`` tokens are refused after counting that many.
        """
        texts = [prompt] if messages is None else [m.content for m in messages]
        per_text = 0 if messages is None else self.message_tokens
        if self.count_upto(texts, self.max_document_tokens, per_text) > self.max_document_tokens:
            raise RapidspecError(f"the text holds more than {self.max_document_tokens} tokens, the server's limit "
                                 "(rapidspec serve --max-document-tokens)", param="messages" if messages else "prompt",
                                 code="context_length_exceeded")
        with self._lock:
            if messages is not None:
                if not getattr(self._tokenizer, "chat_template", None):
                    raise RapidspecError("this model's tokenizer has no chat template: send a prompt instead of "
                                         "messages", param="messages")
                return chat_template_ids(self._tokenizer, [m.to_dict() for m in messages])
            return list(self._tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        with self._lock:
            vocab = len(self._tokenizer)
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
                raise RapidspecError(f"tokens must be integers in [0, {vocab})", param="tokens")
            return self._tokenizer.decode(list(token_ids), clean_up_tokenization_spaces=False)


class TokenPieces:
    """Each token's text on its own and its bytes (log-probabilities, /tokenize), cached per id.

    A token may hold part of a character (byte-level BPE splits multi-byte
    characters): its text then shows U+FFFD, while its bytes are the token's
    own bytes, so the bytes of the answer's tokens join into its UTF-8 text.
    """

    def __init__(self, tokenizer) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)
        self._lock = threading.Lock()
        self._cache: dict[int, tuple[str, bytes]] = {}
        self._byte_level = _is_byte_level(self._tokenizer)

    def texts(self, token_ids: Sequence[int]) -> list[str]:
        return [self._piece(t)[0] for t in token_ids]

    def bytes_of(self, token_ids: Sequence[int]) -> list[bytes]:
        return [self._piece(t)[1] for t in token_ids]

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        piece = self._cache.get(token_id)
        if piece is None:
            with self._lock:
                raw = self._tokenizer.convert_ids_to_tokens(token_id)
                raw_bytes = _byte_level_bytes(raw) if self._byte_level else None
                if raw_bytes is not None:  # no decode call: thousands of top-20 entries stay cheap on the event loop
                    piece = (raw_bytes.decode("utf-8", "replace"), raw_bytes)
                else:
                    text = self._tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
                    piece = (text, _token_bytes(raw, text))
            self._cache[token_id] = piece
        return piece


def _byte_level_bytes(raw: str | None) -> bytes | None:
    """The bytes a byte-level BPE vocabulary entry stands for (None when it is not in that alphabet)."""
    if raw is None or not all(c in _UNICODE_TO_BYTE for c in raw):
        return None
    return bytes(_UNICODE_TO_BYTE[c] for c in raw)


def _token_bytes(raw: str | None, text: str) -> bytes:
    """A token's own bytes when its vocabulary entry ``raw`` is not byte-level (``text`` is its decoded text)."""
    if raw is not None and (match := _BYTE_TOKEN.fullmatch(raw)):
        return bytes([int(match.group(1), 16)])
    return text.encode("utf-8")


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): printable bytes stand for themselves, the others for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + extra)] = byte
            extra += 1
    return alphabet


_UNICODE_TO_BYTE = _byte_alphabet()


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def _template_tokens_per_message(tokenizer) -> int:
    """The chat template's tokens around one message (at least 1; 1 without a template)."""
    if not getattr(tokenizer, "chat_template", None):
        return 1
    try:
        one = chat_template_ids(tokenizer, [{"role": "user", "content": ""}])
        two = chat_template_ids(tokenizer, [{"role": "user", "content": ""}, {"role": "assistant", "content": ""},
                                            {"role": "user", "content": ""}])
    except Exception:  # a template that refuses these shapes: count one token per message
        return 1
    return max(1, (len(two) - len(one)) // 2)
