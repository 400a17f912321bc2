"""Reading user text files (documents, prompts) with one-line errors.

``read_text(path)`` returns the file decoded as UTF-8, exactly: line endings
are kept as they are (``"\\r\\n"`` stays), only a leading byte-order mark is
dropped. ``"-"`` reads standard input. Any problem (missing file, directory,
permission, more than :data:`MAX_TEXT_BYTES`, invalid UTF-8) raises :class:`~rapidspec.errors.RapidspecError`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rapidspec.errors import RapidspecError

STDIN = "-"
#: The largest text read (far more than any model's window holds; /dev/zero stops here).
MAX_TEXT_BYTES = 256 * 1024 * 1024


def read_text(path: str | os.PathLike[str]) -> str:
    """The UTF-8 text of ``path`` (``"-"`` = stdin), byte-exact apart from a BOM."""
    name = "standard input" if str(path) == STDIN else str(path)
    try:
        if str(path) == STDIN:
            data = (sys.stdin.buffer.read(MAX_TEXT_BYTES + 1) if hasattr(sys.stdin, "buffer")
                    else sys.stdin.read(MAX_TEXT_BYTES + 1).encode("utf-8"))
        else:
            with Path(path).open("rb") as file:
                data = file.read(MAX_TEXT_BYTES + 1)
    except FileNotFoundError as err:
        raise RapidspecError(f"no such file: {name}") from err
    except IsADirectoryError as err:
        raise RapidspecError(f"is a directory, not a file: {name}") from err
    except OSError as err:
        raise RapidspecError(f"cannot read {name}: {err.strerror or err}") from err
    if len(data) > MAX_TEXT_BYTES:
        raise RapidspecError(f"{name} is larger than {MAX_TEXT_BYTES // 2**20} MiB, more text than any model reads")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise RapidspecError(f"{name} is not valid UTF-8 (byte {err.start}: {data[err.start:err.start + 1]!r})") from err
