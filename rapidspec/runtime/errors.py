"""Errors of :mod:`rapidspec.runtime` for an argument it cannot take.

The runtime imports nothing from the rest of rapidspec, so it cannot raise
:class:`rapidspec.errors.RapidspecError`. It raises these ``ValueError``
subclasses instead (library callers catch them like any ``ValueError``).
Where the argument is a user's option (``quantize``), the callers in
:mod:`rapidspec.models` re-raise them as ``RapidspecError`` with the same
message, which the CLI prints on one line (exit code 2) and the server
answers with 400.
"""

from __future__ import annotations


class QuantizationError(ValueError):
    """An unknown or unusable quantisation method (one line, the user's to fix)."""


class PrefillStopped(Exception):
    """A chunked prefill was stopped between two chunks because its caller asked (cancelled, out of time)."""
