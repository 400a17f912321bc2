"""The rapidspec cache directory, read from the environment, and how files are written into it.

:func:`cache_root` is ``$RAPIDSPEC_CACHE`` if set, else
``$XDG_CACHE_HOME/rapidspec``, else ``~/.cache/rapidspec``. It lives here so
that the runtime (which imports nothing from the rest of rapidspec) keeps its
files in the same place as the models; :func:`rapidspec.models.cache_root` is
this function.

Every file rapidspec keeps there saves work another process would repeat
(embeddings, model conversions, measured timings), so a folder that cannot
take it never stops the work. :func:`cache_write` writes a hidden temporary
sibling and renames it into place (a reader sees the whole file or none);
where that fails with ``OSError`` (a read-only folder, no permission, a full
disk, a quota) it removes what it wrote, logs one warning per cache, folder
and cause (:func:`warn_once`, not one per request) and returns False, and the
caller carries on without the file. Files already in a read-only folder are
still read. A writer killed mid-write (SIGKILL, a lost machine) leaves its
temporary, which no reader ever opens; :func:`drop_unfinished` removes those
whose process has ended (``rapidspec serve`` does so when it starts, and says
what it dropped).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


# (what, folder, errno) of the warnings logged so far: each is logged once per process.
_warned: set[tuple[str, str, int | None]] = set()
_warned_lock = threading.Lock()


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


def cache_write(target: Path, write: Callable[[Path], None], what: str, without: str) -> bool:
    """Make ``target`` by ``write(temporary)`` and a rename; False where its folder cannot take it.

    ``write`` makes ``temporary`` (a file or a folder: a hidden sibling of
    ``target``, absent when it is called). On ``OSError`` (read-only, no
    permission, full, over quota) whatever ``write`` left is removed,
    :func:`warn_once` logs ``what`` could not be stored and ``without`` (what
    happens instead), and False is returned. A folder another process renamed
    into place first counts as written. Any other exception removes the
    temporary and propagates.
    """
    temporary = temporary_path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write(temporary)
        _rename(temporary, target)
        return True
    except OSError as err:
        warn_once(what, target.parent, err, without)
        return False
    finally:
        remove_quietly(temporary)


#: The name of a temporary (:func:`temporary_path`): ``.<target's name>.<writer's pid>.<12 hex digits>.tmp``.
_TEMPORARY = re.compile(r"^\..+\.(\d+)\.[0-9a-f]{12}\.tmp$")


def temporary_path(target: Path) -> Path:
    """A new hidden sibling of ``target`` to write before a rename, named after this process: where the writer
    is killed, :func:`drop_unfinished` knows it for one (:func:`cache_write`, the model store, export)."""
    return target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")


def drop_unfinished(root: Path | None = None) -> list[Path]:
    """Remove the temporaries of :func:`cache_write` under ``root`` (default :func:`cache_root`) whose writer
    process has ended (killed mid-write); returns what it removed. A live process's temporaries are writes in
    progress and stay (a writer in another PID namespace looks ended: its write is then lost, never corrupt)."""
    root = cache_root() if root is None else Path(root)
    dropped = []
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            match = _TEMPORARY.match(name)
            if match and not _alive(int(match.group(1))):
                remove_quietly(Path(folder) / name)
                dropped.append(Path(folder) / name)
        dirs[:] = [d for d in dirs if not _TEMPORARY.match(d)]
    return dropped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's live process
        return True
    return True


def keep_json(path: Path, content: object, what: str, without: str) -> bool:
    """Write ``content`` as JSON to ``path`` by :func:`cache_write`; False (logged once) where it cannot be written."""

    def write(temporary: Path) -> None:
        with open(temporary, "x", encoding="utf-8") as out:
            json.dump(content, out, indent=1, sort_keys=True)

    return cache_write(path, write, what, without)


def folder_fault(folder: Path) -> OSError | None:
    """Why ``folder`` (made here if missing) cannot take a new file now, or None: for writers that should fail
    before long work (a download, a build) rather than after it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return None
        code = errno.EROFS if os.statvfs(folder).f_flag & os.ST_RDONLY else errno.EACCES
    except OSError as err:
        return err
    return OSError(code, os.strerror(code), str(folder))


def warn_once(what: str, folder: Path, err: OSError, without: str) -> None:
    """Log ``cannot store <what> in <folder> (<cause>): <without>`` once per ``what``, folder and errno."""
    key = (what, str(folder), err.errno)
    with _warned_lock:
        first = key not in _warned
        _warned.add(key)
    if first:
        logger.warning("cannot store %s in %s (%s): %s", what, folder, err.strerror or err, without)


def remove_quietly(path: Path) -> None:
    """Remove the file or folder ``path`` if it is there; errors are ignored (nothing else can be done)."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def _rename(temporary: Path, target: Path) -> None:
    """Rename ``temporary`` to ``target``; a folder already there was renamed into place whole by another process."""
    try:
        os.replace(temporary, target)
    except OSError:
        if not (temporary.is_dir() and target.is_dir()):
            raise
