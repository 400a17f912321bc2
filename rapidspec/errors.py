"""User-facing errors.

A :class:`RapidspecError` means the *user* asked for something that cannot be
done (a bad option, a missing file, an unknown model). The CLI prints its
message on one line and exits with code 2; library callers catch it like any
``ValueError``. Bugs stay ordinary exceptions with tracebacks.
"""


class RapidspecError(ValueError):
    """A mistake in the user's input, reported as one line."""
