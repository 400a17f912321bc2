"""One llama.cpp build per llama-cpp-python version and CPU, for both the Python binding and ``llama-server``.

llama-cpp-python's source distribution vendors llama.cpp. ``make demo``
compiles it into a wheel for this CPU (the demo's drafter) and ``make test``
needs llama.cpp's own ``llama-server`` (the peer of ``rapidspec bench serve
--peer llama.cpp``). Both are built in one tree of the rapidspec cache, so
the ggml and llama objects are compiled once and a fresh clone on the same
machine installs the wheel without compiling::

    <cache>/llama.cpp/<version>-<cpu>/
        src/          the sdist, extracted under a temporary name and renamed: a src/ is a whole one
        build/        the one CMake build folder: scikit-build-core's ``build-dir`` for the wheel, then
                      configured again with the server's options for the target ``llama-server``
        wheels/       the wheel built there
        llama-server  a copy of build/bin/llama-server, which links build/bin's libllama and libggml*
        .lock         held (fcntl.flock) while a process builds in the tree

The wheel's CMake options are those of the set-up before this tree existed
(``GGML_NATIVE``, no llava, no common library: scripts/llama_cpp_no_common.cmake);
the server's add the tools, the server and the common library, with no web UI
and no HTTPS, and keep ``GGML_NATIVE`` and the build type, so configuring the
wheel's folder for the server changes none of the ggml and llama compile
commands and ninja compiles only what the server adds (0.3.36: 118 files of
common, mtmd, cpp-httplib and the server; none of the wheel's 74). A tree the
wheel never built in (llama-cpp-python installed otherwise) is made by the
server's build itself, with the same generator, compilers and options, so
its ggml and llama compile commands are the wheel's (checked: the 74 are the
same) and a later wheel build reuses its objects.

Standard library only and no rapidspec import: scripts/install.py loads this
file by its path and runs it as a script (``wheel``) before rapidspec is
installed; rapidspec.bench.llama_server imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import itertools
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE = "llama-cpp-python"
#: scripts/llama_cpp_no_common.cmake in the checkout this file belongs to (the wheel build runs from a checkout).
NO_COMMON = Path(__file__).resolve().parents[2] / "scripts" / "llama_cpp_no_common.cmake"
#: Both builds: ggml for this CPU (``-march=native``), no llava/mtmd library of llama-cpp-python's own.
SHARED_CMAKE_ARGS = ("-DGGML_NATIVE=ON", "-DLLAVA_BUILD=OFF")
#: The server's additions on the wheel's build folder: the project include that turns common off is dropped
#: (common is back on), the tools with the server, no web UI (built with npm or downloaded otherwise), no
#: HTTPS (the peer listens on 127.0.0.1). None of them changes how ggml or llama compile.
SERVER_CMAKE_ARGS = ("-DCMAKE_BUILD_TYPE=Release", *SHARED_CMAKE_ARGS, "-UCMAKE_PROJECT_llama.cpp_INCLUDE",
                     "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
                     "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                     "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DGGML_CUDA=OFF")

#: Runs one stage: (the command, the stage's name, environment variables to add); raises where it fails.
Runner = Callable[[list[str], str, Mapping[str, str]], None]
#: Gets one line per stage.
Progress = Callable[[str], None]


class TreeError(RuntimeError):
    """A build in the tree that cannot go on (a missing archive, a failed stage); its message is one line."""


class Tree:
    """The folders of one version's tree for this CPU (nothing is made until a build runs)."""

    def __init__(self, version: str, root: Path) -> None:
        self.version, self.root = version, root
        self.src, self.build, self.wheels = root / "src", root / "build", root / "wheels"
        self.server = root / "llama-server"

    def wheel(self) -> Path | None:
        """The wheel built in the tree, or None."""
        found = sorted(self.wheels.glob(f"{PACKAGE.replace('-', '_')}-{self.version}-*.whl"))
        return found[-1] if found else None

    def server_binary(self) -> Path | None:
        """The built ``llama-server``, or None (also when the build folder whose libraries it links is gone)."""
        return self.server if self.server.is_file() and (self.build / "bin").is_dir() else None


def cache_root() -> Path:
    """The rapidspec cache folder, by rapidspec.runtime.cache_dir.cache_root's rule (a test checks they agree):
    this module cannot import rapidspec (scripts/install.py runs it before rapidspec is installed)."""
    if os.environ.get("RAPIDSPEC_CACHE"):
        return Path(os.environ["RAPIDSPEC_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "rapidspec"


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


def tree_for(version: str) -> Tree:
    """The tree of llama-cpp-python ``version`` for this CPU."""
    return Tree(version, cache_root() / "llama.cpp" / f"{version}-{cpu_key()}")


def wheel_cmake_args() -> str:
    """``CMAKE_ARGS`` of the wheel build: the shared options and the include that leaves llama.cpp's common
    library out (llama-cpp-python does not load it; half the compilation)."""
    return shlex.join([*SHARED_CMAKE_ARGS, f"-DCMAKE_PROJECT_llama.cpp_INCLUDE={NO_COMMON}"])


def generator() -> str:
    """The CMake generator of both builds: ``$CMAKE_GENERATOR``, else Ninja where it is on PATH, else make.

    Named for scikit-build-core too, which would otherwise fetch ninja from PyPI into its temporary build
    environment where none is on PATH, and the build folder would then name a ninja that is gone.
    """
    return os.environ.get("CMAKE_GENERATOR") or ("Ninja" if shutil.which("ninja") else "Unix Makefiles")


def compiler_env() -> dict[str, str]:
    """``CC`` and ``CXX`` as scikit-build-core sets them (Python's compilers, flags dropped) where unset: a
    tree the server's build configures first finds the compilers the wheel's build would."""
    env = {}
    for name in ("CC", "CXX"):
        words = (sysconfig.get_config_var(name) or "").split()
        command = " ".join(itertools.takewhile(lambda word: not word.startswith("-"), words))
        if name not in os.environ and command:
            env[name] = command
    return env


@contextlib.contextmanager
def locked(tree: Tree, progress: Progress) -> Iterator[None]:
    """Hold the tree's lock (made here with the tree's folder): one process builds in a tree at a time, and
    what an interrupted one left (``.partial-*``) is removed first."""
    tree.root.mkdir(parents=True, exist_ok=True)
    with open(tree.root / ".lock", "a", encoding="utf-8") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"llama.cpp: waiting for another process building in {tree.root}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        for leftover in tree.root.glob(".partial-*"):  # what an interrupted build left (no one else's now)
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_source(tree: Tree, python: str, run: Runner, progress: Progress) -> Path:
    """The tree's whole ``src/``, fetched with pip and extracted where missing (called with the lock held).

    The archive is extracted under a temporary name and renamed into place, so a ``src/`` is a whole one;
    one without the files a build needs (an older, interrupted layout) is replaced.
    """
    if _whole(tree.src):
        return tree.src
    progress(f"llama.cpp: fetching the {PACKAGE}=={tree.version} source distribution with pip")
    with tempfile.TemporaryDirectory(prefix=".partial-", dir=tree.root) as work:
        run([python, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"{PACKAGE}=={tree.version}", "-d", work], "pip download", {})
        archives = sorted(Path(work).glob("*.tar.gz"))
        if not archives:
            raise TreeError(f"pip download gave no source archive of {PACKAGE}=={tree.version}")
        top = _extract(archives[0], Path(work) / "x")
        if tree.src.exists():
            shutil.rmtree(tree.src)
        os.replace(top, tree.src)
    return tree.src


def build_wheel(tree: Tree, python: str, run: Runner, progress: Progress, jobs: int | None = None) -> Path:
    """The tree's wheel, built from ``src/`` in ``build/`` with pip where the tree has none yet."""
    with locked(tree, progress):
        built = tree.wheel()
        if built is not None:  # built by another process while this one waited
            return built
        ensure_source(tree, python, run, progress)
        progress(f"llama.cpp: compiling {PACKAGE}=={tree.version} for this CPU in {tree.build}")
        env = {"CMAKE_ARGS": wheel_cmake_args(), "CMAKE_GENERATOR": generator(),
               "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs or os.cpu_count() or 1)}
        with tempfile.TemporaryDirectory(prefix=".partial-", dir=tree.root) as out:
            run([python, "-m", "pip", "wheel", "--progress-bar", "off", "--no-deps", "--wheel-dir", out,
                 f"--config-settings=build-dir={tree.build}", str(tree.src)], "pip wheel", env)
            made = sorted(Path(out).glob("*.whl"))
            if not made:
                raise TreeError(f"pip wheel left no wheel of {PACKAGE}=={tree.version}")
            tree.wheels.mkdir(exist_ok=True)
            os.replace(made[-1], tree.wheels / made[-1].name)  # a reader sees the whole wheel or none
    return tree.wheel()


def build_server(tree: Tree, python: str, run: Runner, progress: Progress, jobs: int | None = None,
                 building: str = "") -> Path:
    """``llama-server`` built in the tree's ``build/`` (the wheel's objects reused), copied to ``tree.server``.

    ``building`` is said in the compile stage's line (e.g. about how long it takes).
    """
    with locked(tree, progress):
        found = tree.server_binary()
        if found is not None:  # built by another process while this one waited
            return found
        ensure_source(tree, python, run, progress)
        progress(f"llama.cpp: configuring {tree.build} for llama-server (cmake)")
        run(["cmake", "-S", str(tree.src), "-B", str(tree.build), *SERVER_CMAKE_ARGS], "cmake configure",
            {"CMAKE_GENERATOR": generator(), **compiler_env()})
        jobs = jobs or os.cpu_count() or 1
        progress(f"llama.cpp: compiling llama-server with {jobs} jobs{f' ({building})' if building else ''}")
        run(["cmake", "--build", str(tree.build), "--target", "llama-server", "-j", str(jobs)], "cmake build", {})
        built = tree.build / "bin" / "llama-server"
        if not (built.is_file() and os.access(built, os.X_OK)):
            raise TreeError(f"the build finished without {built}")
        partial = tree.root / f".partial-llama-server.{os.getpid()}"
        try:
            shutil.copy2(built, partial)
            os.replace(partial, tree.server)  # a reader sees the whole binary or none
        finally:
            partial.unlink(missing_ok=True)
    return tree.server


def _whole(src: Path) -> bool:
    """Whether ``src`` holds what both builds read (a folder renamed into place whole)."""
    return all(path.exists() for path in (src / "pyproject.toml", src / "CMakeLists.txt",
                                          src / "vendor" / "llama.cpp" / "CMakeLists.txt",
                                          src / "vendor" / "llama.cpp" / "tools" / "server"))


def _extract(archive: Path, into: Path) -> Path:
    """Extract the sdist ``archive`` into ``into``; its one top folder, checked to be a whole source tree."""
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(into, filter="data")
        else:  # Pythons before the filters: refuse names that leave the folder
            if any(m.name.startswith("/") or ".." in Path(m.name).parts for m in tar.getmembers()):
                raise TreeError(f"{archive.name} holds paths outside its folder")
            tar.extractall(into)
    tops = [path for path in into.iterdir() if path.is_dir()]
    if len(tops) != 1 or not _whole(tops[0]):
        raise TreeError(f"{archive.name} is not a {PACKAGE} source with vendor/llama.cpp/tools/server")
    return tops[0]


def run_printing(command: list[str], stage: str, env: Mapping[str, str]) -> None:
    """The script's :data:`Runner`: the command and its output on stdout (the set-up's log)."""
    print(f"$ {shlex.join(command)}", flush=True)
    done = subprocess.run(command, stdin=subprocess.DEVNULL, env={**os.environ, **env})
    if done.returncode != 0:
        raise TreeError(f"{stage} failed (exit code {done.returncode})")


def main(argv: list[str] | None = None) -> int:
    """``wheel``: build (or find) the tree's wheel and print its path (scripts/install.py runs this)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("wheel",))
    parser.add_argument("--version", required=True, help="the llama-cpp-python version")
    parser.add_argument("--python", default=sys.executable, help="the Python whose pip builds it")
    args = parser.parse_args(argv)
    tree = tree_for(args.version)
    try:
        wheel = build_wheel(tree, args.python, run_printing, lambda line: print(line, flush=True))
    except (TreeError, tarfile.TarError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a read-only or full cache folder: one line, not a traceback
        print(f"error: cannot build in {tree.root}: {err} (set $RAPIDSPEC_CACHE to a writable folder with some "
              f"room)", file=sys.stderr)
        return 1
    print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
