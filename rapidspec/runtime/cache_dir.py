"""The rapidspec cache directory, read from the environment.

:func:`cache_root` is ``$RAPIDSPEC_CACHE`` if set, else
``$XDG_CACHE_HOME/rapidspec``, else ``~/.cache/rapidspec``. It lives here so
that the runtime (which imports nothing from the rest of rapidspec) keeps its
files in the same place as the models; :func:`rapidspec.models.cache_root` is
this function.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """The rapidspec cache directory.

    ``$RAPIDSPEC_CACHE`` if set, else ``$XDG_CACHE_HOME/rapidspec``, else
    ``~/.cache/rapidspec``. Read on every call (it is cheap) so tests can point
    it elsewhere.
    """
    if os.environ.get("RAPIDSPEC_CACHE"):
        return Path(os.environ["RAPIDSPEC_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "rapidspec"


def write_json(path: Path, content: object) -> None:
    """Write ``content`` as JSON to ``path`` atomically (a temporary file beside it, then a rename), making its
    folder; ``OSError`` when it cannot be written (nothing partial is left)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(content, out, indent=1, sort_keys=True)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
