"""User-facing errors.

A :class:`RapidspecError` means the *user* asked for something that cannot be
done (a bad option, a missing file, an unknown model). The CLI prints its
message on one line and exits with code 2; the server answers 400 with
OpenAI's error body, whose ``param`` and ``code`` come from the error's
attributes; library callers catch it like any ``ValueError``. Bugs stay
ordinary exceptions with tracebacks.
"""

from __future__ import annotations


class RapidspecError(ValueError):
    """A mistake in the user's input, reported as one line.

    ``param`` names the offending field (``"messages"``, ``"max_tokens"``...)
    and ``code`` is a machine-readable reason, where they are known.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ContextLengthError(RapidspecError):
    """The prompt and the answer do not fit the model's window (and truncation is off)."""

    def __init__(self, message: str, *, param: str | None = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")
