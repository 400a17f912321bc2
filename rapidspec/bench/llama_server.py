"""llama.cpp's own C++ server, ``llama-server``, built in the llama.cpp tree the pinned llama-cpp-python was built in.

The peer of ``rapidspec bench serve --peer llama.cpp``: what a CPU user would
run instead of rapidspec (parallel slots, continuous batching, prompt cache).
llama-cpp-python's source distribution vendors llama.cpp (``vendor/llama.cpp``,
with ``tools/server``). ``make demo``'s set-up compiles that sdist into the
binding's wheel in a tree of the rapidspec cache,
``$RAPIDSPEC_CACHE/llama.cpp/<version>-<cpu>`` (:mod:`.llama_cpp_tree`; the
CPU's flags: a native build may not run on another CPU);
:func:`build_llama_server` configures the same build folder again with the
server's options (the tools, the server and llama.cpp's common library; no web
UI, no HTTPS; ``GGML_NATIVE`` and the build type kept) and builds the one
target ``llama-server``, so the ggml and llama objects the wheel compiled are
reused and only llama.cpp's common library, mtmd, cpp-httplib and the server
are compiled (118 files: 5 min 10 s on 2 idle cores of an Intel Xeon with
AVX-512 on 2026-11-28, 9 min with the load at 3 to 4; the wheel before it took
2 min 41 s, and the static build from scratch this replaces took 11 min 46 s
at a load of 2 to 4). The
binary links the tree's shared libllama and libggml and is kept as
``llama-server`` in the tree. Where the tree is missing (llama-cpp-python
installed otherwise), the same code makes it: pip fetches the sdist of the
installed version from the package index (no other download: the web UI is
neither built nor fetched) and everything is compiled once. A cache folder
that cannot keep it (read-only, full) is a one-line error, before the build
where it can be told. ``$RAPIDSPEC_LLAMA_SERVER`` names a binary of your own
instead. ``python -m rapidspec.bench.llama_server`` builds it (``make test``'s
set-up runs it on CPU machines; ``make demo``'s does not), and so does the
first ``--peer llama.cpp`` that finds none: one line says so and about how long
it takes, the stages' output goes to ``llama-server-build.log`` beside the
binary, and a failure is one line (the stage, its last line of output, the
log's path).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable, Mapping
from pathlib import Path

from rapidspec.bench import llama_cpp_tree
from rapidspec.bench.llama_cpp_tree import PACKAGE, cpu_key  # noqa: F401 (cpu_key: the tree's key, one definition)
from rapidspec.errors import RapidspecError
from rapidspec.runtime.cache_dir import folder_fault

logger = logging.getLogger(__name__)

ENV_BINARY = "RAPIDSPEC_LLAMA_SERVER"
#: How long a build takes, for the line that announces one (2-core Intel Xeon with AVX-512, 2026-11-28: 5 min 10 s
#: idle and 9 min at a load of 3 to 4 after the wheel's build; the tree from scratch adds the wheel's 2 min 41 s).
BUILD_TIME = "about 5 minutes on 2 idle cores after `make demo`'s compilation, 8 without it, 9 or more on busy ones"


def installed_version() -> str:
    """The installed llama-cpp-python's version (RapidspecError when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        raise RapidspecError(f"{PACKAGE} is not installed: run `make install` (it builds it), "
                             f"or set ${ENV_BINARY} to a llama-server binary") from None


def cached_binary_path(version: str | None = None) -> Path:
    """Where the tree of ``version`` (default: the installed one) keeps its ``llama-server``."""
    return llama_cpp_tree.tree_for(version or installed_version()).server


def find_llama_server() -> Path | None:
    """``$RAPIDSPEC_LLAMA_SERVER``, else the cached build for the installed version and this CPU, else None."""
    given = os.environ.get(ENV_BINARY)
    if given:
        path = Path(given).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise RapidspecError(f"${ENV_BINARY} is {given!r}, which is not an executable file")
        return path
    return llama_cpp_tree.tree_for(installed_version()).server_binary()


def build_llama_server(progress: Callable[[str], None] = logger.info, jobs: int | None = None) -> Path:
    """Build ``llama-server`` for this CPU in the installed llama-cpp-python's tree; the kept binary's path.

    ``progress`` gets one line per stage; every stage's output goes to
    :func:`build_log_path`. Every failure is a one-line RapidspecError naming
    the stage, its last line of output and the log. An existing build is
    returned as it is.
    """
    version = installed_version()
    tree = llama_cpp_tree.tree_for(version)
    found = tree.server_binary()
    if found is not None:
        return found
    if shutil.which("cmake") is None:
        raise RapidspecError("building llama-server needs cmake on PATH (Debian: apt install cmake)")
    fault = folder_fault(tree.root)  # checked before the build: the tree and the binary must be kept somewhere
    if fault is not None:
        raise _cannot_keep(tree.server, fault.strerror or str(fault))
    log_path = build_log_path(version)
    try:
        log_path.write_bytes(b"")  # appended to by this process and by each stage's (O_APPEND: in order)
        with open(log_path, "a", encoding="utf-8") as log:
            def stage(line: str) -> None:
                progress(line)
                log.write(f"=== {line}\n")
                log.flush()

            def run(command: list[str], name: str, env: Mapping[str, str]) -> None:
                _run(command, name, log, log_path, env)

            return llama_cpp_tree.build_server(tree, sys.executable, run, stage, jobs, BUILD_TIME)
    except llama_cpp_tree.TreeError as err:
        raise RapidspecError(f"llama-server build: {err} (the build's output: {log_path})") from None
    except (OSError, tarfile.TarError) as err:  # a full disk, an unreadable archive: one line, not a traceback
        raise RapidspecError(f"llama-server build failed: {err} (the build's output: {log_path})") from None


def build_log_path(version: str | None = None) -> Path:
    """The build's output, kept beside the binary (written over by the next build)."""
    return cached_binary_path(version).parent / "llama-server-build.log"


def _cannot_keep(target: Path, reason: str) -> RapidspecError:
    """The one-line error of a build the cache folder cannot keep (read-only, full)."""
    return RapidspecError(f"cannot keep a llama-server build in {target.parent} ({reason}): set $RAPIDSPEC_CACHE "
                          f"to a writable folder with some room, or ${ENV_BINARY} to a llama-server binary")


def llama_server_binary(build: bool = True, progress: Callable[[str], None] = logger.info) -> Path:
    """The binary to run: :func:`find_llama_server`'s, else (``build``) a new build, else RapidspecError.

    A build on first use is announced with one line to ``progress`` (what and about how long); its stages go
    to the build log only, and it ends with one line naming the binary.
    """
    found = find_llama_server()
    if found is not None:
        return found
    if not build:
        raise RapidspecError(f"llama-server is not built: run `python -m rapidspec.bench.llama_server` "
                             f"({BUILD_TIME}) or set ${ENV_BINARY}")
    version = installed_version()
    progress(f"llama-server is not built yet: building it once for this CPU from {PACKAGE} {version}'s "
             f"sources ({BUILD_TIME}; its output: {build_log_path(version)})")
    path = build_llama_server(logger.info)
    progress(f"llama-server: built {path}")
    return path


def _run(command: list[str], stage: str, log, log_path: Path, env: Mapping[str, str] | None = None) -> None:
    """Run one stage (``env`` added to the environment), its output appended to ``log``; a failure is a one-line
    RapidspecError."""
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    start = log.tell()
    try:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env={**os.environ, **env} if env else None)
    except OSError as err:
        raise RapidspecError(f"llama-server build, {stage} could not start: {err}") from None
    if done.returncode != 0:
        log.flush()
        raise RapidspecError(f"llama-server build, {stage} failed (exit code {done.returncode}): "
                             f"{_last_line(log_path, start) or 'no output'} (the whole output: {log_path})")


def _last_line(path: Path, start: int = 0, limit: int = 200) -> str:
    """The last non-empty line of ``path`` from byte ``start`` on, shortened to ``limit`` characters ('' if none)."""
    try:
        with open(path, "rb") as file:
            file.seek(start)
            lines = file.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    return last if len(last) <= limit else last[:limit - 3] + "..."


def main() -> int:
    try:
        path = llama_server_binary(progress=lambda line: print(line, file=sys.stderr, flush=True))
    except RapidspecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
