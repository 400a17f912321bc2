"""llama.cpp's own C++ server, ``llama-server``, built from the sources the pinned llama-cpp-python ships.

The peer of ``rapidspec bench serve --peer llama.cpp``: what a CPU user would
run instead of rapidspec (parallel slots, continuous batching, prompt cache).
llama-cpp-python's source distribution vendors llama.cpp
(``vendor/llama.cpp``, with ``tools/server``); :func:`build_llama_server`
fetches that sdist of the installed version from the package index with pip
(no other download: the web UI is neither built nor fetched), configures it
with CMake for this CPU (``GGML_NATIVE``) and builds the one target
``llama-server`` (about 5 minutes on 2 idle cores). The binary is cached under
``$RAPIDSPEC_CACHE/llama-server/<version>-<cpu>`` (the CPU's flags: a native
build may not run on another CPU); a cache folder that cannot keep it
(read-only, full) is a one-line error, before the build where it can be
told. ``$RAPIDSPEC_LLAMA_SERVER`` names a binary of your own instead.
``python -m rapidspec.bench.llama_server`` builds it (``make test``'s set-up
runs it on CPU machines; ``make demo``'s does not), and so does the first
``--peer llama.cpp`` that finds none: one line says so and about how long it
takes, the stages' output goes to ``build.log`` beside the binary, and a
failure is one line (the stage, its last line of output, the log's path).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from rapidspec.errors import RapidspecError
from rapidspec.runtime.cache_dir import cache_root, cache_write, folder_fault

logger = logging.getLogger(__name__)

ENV_BINARY = "RAPIDSPEC_LLAMA_SERVER"
PACKAGE = "llama-cpp-python"
#: CMake options: a native CPU build of the server alone, no web UI (built with npm or downloaded otherwise),
#: no HTTPS (the peer listens on 127.0.0.1), static libraries (one self-contained binary).
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
                 "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                 "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DGGML_CUDA=OFF")
#: How long a build takes, for the line that announces one (2-core AMD EPYC: 4.5 minutes idle as first measured;
#: 10 and 14 minutes on 2026-11-26 while other processes kept the load at 2 to 6).
BUILD_TIME = "about 5 minutes on 2 idle cores, 10 or more on busy ones"


def installed_version() -> str:
    """The installed llama-cpp-python's version (RapidspecError when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        raise RapidspecError(f"{PACKAGE} is not installed: run `make install` (it builds it), "
                             f"or set ${ENV_BINARY} to a llama-server binary") from None


def cpu_key() -> str:
    """A short hash of this CPU's model and instruction-set flags (a native build runs only where they hold)."""
    text = platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        wanted = ("model name", "flags", "Features")
        text += "|".join(sorted({line for line in info.splitlines() if line.split(":")[0].strip() in wanted}))
    except OSError:
        text += platform.processor()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cached_binary_path(version: str | None = None) -> Path:
    return cache_root() / "llama-server" / f"{version or installed_version()}-{cpu_key()}" / "llama-server"


def find_llama_server() -> Path | None:
    """``$RAPIDSPEC_LLAMA_SERVER``, else the cached build for the installed version and this CPU, else None."""
    given = os.environ.get(ENV_BINARY)
    if given:
        path = Path(given).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise RapidspecError(f"${ENV_BINARY} is {given!r}, which is not an executable file")
        return path
    path = cached_binary_path()
    return path if path.is_file() else None


def build_llama_server(progress: Callable[[str], None] = logger.info, jobs: int | None = None) -> Path:
    """Build ``llama-server`` for this CPU from the installed llama-cpp-python's sdist; the cached binary's path.

    ``progress`` gets one line per stage; every stage's output goes to
    :func:`build_log_path`. Every failure is a one-line RapidspecError naming
    the stage, its last line of output and the log. An existing build is
    returned as it is.
    """
    version = installed_version()
    target = cached_binary_path(version)
    if target.is_file():
        return target
    if shutil.which("cmake") is None:
        raise RapidspecError("building llama-server needs cmake on PATH (Debian: apt install cmake)")
    fault = folder_fault(target.parent)  # checked before the build: the binary must be kept somewhere
    if fault is not None:
        raise _cannot_keep(target, fault.strerror or str(fault))
    jobs = jobs or os.cpu_count() or 1
    log_path = build_log_path(version)
    try:
        log_path.write_bytes(b"")  # appended to by this process and by each stage's (O_APPEND: in order)
        with open(log_path, "a", encoding="utf-8") as log, \
                tempfile.TemporaryDirectory(prefix="rapidspec-llama-server-") as work:
            _build(Path(work), version, target, jobs, log, log_path, progress)
    except (OSError, tarfile.TarError) as err:  # a full disk, an unreadable archive: one line, not a traceback
        raise RapidspecError(f"llama-server build failed: {err} (the build's output: {log_path})") from None
    return target


def build_log_path(version: str | None = None) -> Path:
    """The build's output, kept beside the binary (written over by the next build)."""
    return cached_binary_path(version).parent / "build.log"


def _build(work_dir: Path, version: str, target: Path, jobs: int, log, log_path: Path,
           progress: Callable[[str], None]) -> None:
    def stage(line: str) -> None:
        progress(line)
        log.write(f"=== {line}\n")
        log.flush()

    stage(f"llama-server: fetching the {PACKAGE}=={version} source distribution with pip")
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
          f"{PACKAGE}=={version}", "-d", str(work_dir)], "pip download", log, log_path)
    archives = sorted(work_dir.glob("*.tar.gz"))
    if not archives:
        raise RapidspecError(f"pip download gave no source archive of {PACKAGE}=={version} (its output: {log_path})")
    source = _extract_vendored(archives[0], work_dir / "src")
    build = work_dir / "build"
    stage(f"llama-server: configuring llama.cpp for this CPU (cmake, {source.name})")
    _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS], "cmake configure", log, log_path)
    stage(f"llama-server: compiling with {jobs} jobs ({BUILD_TIME})")
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)], "cmake build", log, log_path)
    built = next((p for p in build.rglob("llama-server") if p.is_file() and os.access(p, os.X_OK)), None)
    if built is None:
        raise RapidspecError(f"the build finished without a llama-server binary (its output: {log_path})")
    # a temporary renamed into place: another process sees no binary or the whole one
    if not cache_write(target, lambda partial: shutil.copy2(built, partial), "the llama-server build",
                       "it is not kept"):
        raise _cannot_keep(target, "see the warning above")


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


def _extract_vendored(archive: Path, into: Path) -> Path:
    """Extract the archive's ``vendor/llama.cpp`` only; its folder."""
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in f"{m.name}/"]
        if not members:
            raise RapidspecError(f"{archive.name} holds no vendor/llama.cpp")
        tar.extractall(into, members=members, filter="data")
    found = next(iter(sorted(into.glob("*/vendor/llama.cpp"))), None)
    if found is None or not (found / "tools" / "server").is_dir():
        raise RapidspecError(f"{archive.name}: vendor/llama.cpp has no tools/server")
    return found


def _run(command: list[str], stage: str, log, log_path: Path) -> None:
    """Run one stage, its output appended to ``log``; a failure is a one-line RapidspecError."""
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    start = log.tell()
    try:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
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
