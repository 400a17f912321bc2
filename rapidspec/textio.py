"""Reading user text files (documents, prompts) with one-line errors.

``read_text(path)`` returns the file decoded as UTF-8, exactly: line endings
are kept as they are (``"\\r\\n"`` stays), only a leading byte-order mark is
dropped. ``"-"`` reads standard input. Any problem (missing file, directory,
permission, invalid UTF-8) raises :class:`~rapidspec.errors.RapidspecError`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rapidspec.errors import RapidspecError

STDIN = "-"


def read_text(path: str | os.PathLike[str]) -> str:
    """The UTF-8 text of ``path`` (``"-"`` = stdin), byte-exact apart from a BOM."""
    name = "standard input" if str(path) == STDIN else str(path)
    try:
        if str(path) == STDIN:
            data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8")
        else:
            data = Path(path).read_bytes()
    except FileNotFoundError as err:
        raise RapidspecError(f"no such file: {name}") from err
    except IsADirectoryError as err:
        raise RapidspecError(f"is a directory, not a file: {name}") from err
    except OSError as err:
        raise RapidspecError(f"cannot read {name}: {err.strerror or err}") from err
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise RapidspecError(f"{name} is not valid UTF-8 (byte {err.start}: {data[err.start:err.start + 1]!r})") from err
