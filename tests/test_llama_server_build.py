"""llama-server built on first use of ``--peer llama.cpp`` (rapidspec.bench.llama_server), with the build mocked.

``make demo``'s set-up does not build llama-server; the first ``rapidspec
bench serve --peer llama.cpp`` that finds none builds it, in the llama.cpp
tree of the cache (rapidspec.bench.llama_cpp_tree) where the set-up compiled
llama-cpp-python's wheel. Here the stages' commands (pip download, pip wheel,
cmake configure, cmake build) are stand-ins that make what the real ones
would (an sdist with vendor/llama.cpp/tools/server, a wheel, a llama-server
file) or fail, so the whole path runs in a second.
"""

from __future__ import annotations

import fcntl
import io
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from rapidspec.bench import llama_cpp_tree, llama_server
from rapidspec.bench.llama_server import ENV_BINARY, build_log_path, cached_binary_path, llama_server_binary
from rapidspec.cli import main
from rapidspec.errors import RapidspecError
from rapidspec.runtime.cache_dir import cache_root

VERSION = "0.0.1"
#: The files of a whole source tree (llama_cpp_tree._whole), as the fake sdist holds them.
SDIST_FILES = ("pyproject.toml", "CMakeLists.txt", "vendor/llama.cpp/CMakeLists.txt",
               "vendor/llama.cpp/tools/server/server.cpp")


REAL_RUN, REAL_WHICH = subprocess.run, shutil.which


class FakeStages:
    """Stands in for subprocess.run: records each build stage and its command; ``fail`` names one that exits 2;
    runs the rest."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.stages: list[str] = []
        self.commands: list[list[str]] = []

    def __call__(self, command, *args, stdout=None, **kwargs):
        if command[0] == "cmake":
            stage = "cmake build" if "--build" in command else "cmake configure"
        elif command[1:4] in (["-m", "pip", "download"], ["-m", "pip", "wheel"]):
            stage = f"pip {command[3]}"
        else:  # not the build's: run as it is
            return REAL_RUN(command, *args, stdout=stdout, **kwargs)
        out = stdout or io.StringIO()
        self.stages.append(stage)
        self.commands.append(command)
        out.write(f"output of {stage}\n")
        out.flush()
        if stage == self.fail:
            out.write("error: the compiler ran out of patience\n\n")
            out.flush()
            return subprocess.CompletedProcess(command, 2)
        if stage == "pip download":
            into = Path(command[command.index("-d") + 1])
            with tarfile.open(into / f"llama_cpp_python-{VERSION}.tar.gz", "w:gz") as tar:
                for name in SDIST_FILES:
                    data = b"# a stand-in\n"
                    member = tarfile.TarInfo(f"llama_cpp_python-{VERSION}/{name}")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
        elif stage == "pip wheel":
            build = Path(next(word for word in command if word.startswith("--config-settings=build-dir="))
                         .partition("build-dir=")[2])
            (build / "bin").mkdir(parents=True, exist_ok=True)
            (build / "bin" / "libllama.so").write_text("")
            wheel_dir = Path(command[command.index("--wheel-dir") + 1])
            (wheel_dir / f"llama_cpp_python-{VERSION}-py3-none-linux_x86_64.whl").write_text("a wheel")
        elif stage == "cmake build":
            binary = Path(command[command.index("--build") + 1]) / "bin" / "llama-server"
            binary.parent.mkdir(parents=True, exist_ok=True)
            binary.write_text("#!/bin/sh\n")
            binary.chmod(0o755)
        return subprocess.CompletedProcess(command, 0)


@pytest.fixture
def no_build_yet(tmp_path, monkeypatch):
    """An empty rapidspec cache, no $RAPIDSPEC_LLAMA_SERVER, llama-cpp-python VERSION installed, cmake on PATH."""
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(ENV_BINARY, raising=False)
    monkeypatch.setattr(llama_server, "installed_version", lambda: VERSION)
    monkeypatch.setattr(llama_server.shutil, "which",
                        lambda name, *args, **kwargs: "/usr/bin/cmake" if name == "cmake" else REAL_WHICH(name, *args, **kwargs))

    def stages(fail: str | None = None) -> FakeStages:
        fake = FakeStages(fail)
        monkeypatch.setattr(llama_server.subprocess, "run", fake)
        return fake

    return stages


def test_the_first_use_builds_it_once_with_one_line_saying_so(no_build_yet):
    stages = no_build_yet()
    lines: list[str] = []
    path = llama_server_binary(progress=lines.append)
    assert path == cached_binary_path(VERSION) and path.is_file()
    assert stages.stages == ["pip download", "cmake configure", "cmake build"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("llama-server is not built yet: building it once") and "minutes" in lines[0]
    assert str(build_log_path(VERSION)) in lines[0] and lines[1] == f"llama-server: built {path}"
    log = build_log_path(VERSION).read_text()
    assert log.index("output of pip download") < log.index("output of cmake configure") < log.index("output of cmake build")
    # the next use finds the build and says nothing
    again: list[str] = []
    assert llama_server_binary(progress=again.append) == path
    assert again == [] and stages.stages == ["pip download", "cmake configure", "cmake build"]


@pytest.mark.parametrize("stage", ["pip download", "cmake configure", "cmake build"])
def test_a_failed_build_is_one_line_naming_the_stage_its_last_line_and_the_log(no_build_yet, stage):
    no_build_yet(fail=stage)
    with pytest.raises(RapidspecError) as raised:
        llama_server_binary(progress=lambda line: None)
    message = str(raised.value)
    assert "\n" not in message
    assert f"{stage} failed (exit code 2): error: the compiler ran out of patience" in message
    assert str(build_log_path(VERSION)) in message and not cached_binary_path(VERSION).exists()


def test_a_broken_source_archive_is_one_line(no_build_yet, monkeypatch):
    no_build_yet()

    def broken(archive, into):
        raise tarfile.ReadError("not a gzip file")

    monkeypatch.setattr(llama_cpp_tree, "_extract", broken)
    with pytest.raises(RapidspecError, match=r"^llama-server build failed: not a gzip file \(the build's output: "):
        llama_server_binary(progress=lambda line: None)


def test_bench_serve_peer_builds_on_first_use_and_a_failure_is_one_error_line(no_build_yet, capsys, tmp_path):
    """Through the command line: the announcing line, then one error line, no traceback (exit code 2)."""
    gguf = tmp_path / "model.gguf"  # the binary is looked for before the peer's tokenizer is read
    gguf.write_bytes(b"GGUF")
    stages = no_build_yet(fail="cmake build")
    code = main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--peer", "llama.cpp",
                 "--peer-gguf", str(gguf), "--document-tokens", "256", "--max-tokens", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and stages.stages == ["pip download", "cmake configure", "cmake build"]
    assert len(err) == 2, err
    assert err[0].startswith("llama-server is not built yet: building it once") and "minutes" in err[0]
    assert err[1].startswith("rapidspec bench serve: error: llama-server build, cmake build failed (exit code 2)")
    assert "Traceback" not in "\n".join(err)


def build_the_wheel(lines: list[str] | None = None) -> Path:
    """The set-up's wheel build in the tree of VERSION (the runner of ``python3 llama_cpp_tree.py wheel``)."""
    tree = llama_cpp_tree.tree_for(VERSION)
    return llama_cpp_tree.build_wheel(tree, sys.executable, llama_cpp_tree.run_printing,
                                      (lines if lines is not None else []).append)


def test_the_server_is_built_in_the_tree_the_wheel_was_built_in(no_build_yet):
    """One tree: the server's cmake configures the wheel's build folder and the sdist is not fetched again."""
    stages = no_build_yet()
    wheel = build_the_wheel()
    tree = llama_cpp_tree.tree_for(VERSION)
    assert wheel == tree.wheel() and wheel.parent == tree.wheels and wheel.read_text() == "a wheel"
    assert stages.stages == ["pip download", "pip wheel"]
    pip_wheel = stages.commands[1]
    assert pip_wheel[-1] == str(tree.src) and f"--config-settings=build-dir={tree.build}" in pip_wheel
    path = llama_server_binary(progress=lambda line: None)
    assert stages.stages == ["pip download", "pip wheel", "cmake configure", "cmake build"]
    configure, build = stages.commands[2:]
    assert configure[configure.index("-S") + 1] == str(tree.src)
    assert configure[configure.index("-B") + 1] == str(tree.build)
    assert "-UCMAKE_PROJECT_llama.cpp_INCLUDE" in configure and "-DGGML_NATIVE=ON" in configure
    assert build[build.index("--build") + 1] == str(tree.build) and build[build.index("--target") + 1] == "llama-server"
    assert path == cached_binary_path(VERSION) == tree.server and path.parent == tree.root
    assert llama_server.find_llama_server() == path
    # a second wheel build finds the kept wheel and compiles nothing
    assert build_the_wheel() == wheel and len(stages.stages) == 4


def test_the_tree_lies_in_the_cache_under_the_version_and_this_cpu(no_build_yet, tmp_path):
    tree = llama_cpp_tree.tree_for(VERSION)
    assert tree.root == tmp_path / "cache" / "llama.cpp" / f"{VERSION}-{llama_cpp_tree.cpu_key()}"
    assert llama_server.cpu_key is llama_cpp_tree.cpu_key  # one definition
    assert build_log_path(VERSION).parent == tree.root


def test_a_partial_source_folder_is_not_used(no_build_yet):
    """A src/ without what the builds read (an interrupted extraction of an older layout) is fetched again;
    what an interrupted build left (.partial-*) is removed."""
    stages = no_build_yet()
    tree = llama_cpp_tree.tree_for(VERSION)
    (tree.src / "vendor").mkdir(parents=True)
    (tree.src / "pyproject.toml").write_text("half")
    leftover = tree.root / ".partial-abc"
    leftover.mkdir()
    llama_server_binary(progress=lambda line: None)
    assert stages.stages == ["pip download", "cmake configure", "cmake build"]
    assert all((tree.src / name).is_file() for name in SDIST_FILES) and not leftover.exists()
    assert [path.name for path in tree.root.iterdir() if path.name.startswith(".partial")] == []


def test_a_whole_source_folder_is_reused(no_build_yet):
    stages = no_build_yet()
    tree = llama_cpp_tree.tree_for(VERSION)
    for name in SDIST_FILES:
        (tree.src / name).parent.mkdir(parents=True, exist_ok=True)
        (tree.src / name).write_text("kept")
    llama_server_binary(progress=lambda line: None)
    assert stages.stages == ["cmake configure", "cmake build"]


def test_a_server_whose_build_folder_is_gone_is_built_again(no_build_yet):
    """The kept binary links the build folder's libraries: without them it is no build."""
    stages = no_build_yet()
    path = llama_server_binary(progress=lambda line: None)
    shutil.rmtree(llama_cpp_tree.tree_for(VERSION).build)
    assert llama_server.find_llama_server() is None
    assert llama_server_binary(progress=lambda line: None) == path and stages.stages.count("cmake build") == 2


def test_a_build_waits_for_another_process_s_and_takes_its_wheel(no_build_yet):
    """The tree's lock: a second build waits, then finds the first one's wheel and compiles nothing."""
    stages = no_build_yet()
    tree = llama_cpp_tree.tree_for(VERSION)
    tree.root.mkdir(parents=True)
    lines: list[str] = []
    result: list[Path] = []
    with open(tree.root / ".lock", "a") as other:  # another open file: flock treats it as another process
        fcntl.flock(other, fcntl.LOCK_EX)
        waiting = threading.Thread(target=lambda: result.append(build_the_wheel(lines)))
        waiting.start()
        deadline = time.monotonic() + 10
        while not lines and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lines and lines[0].startswith("llama.cpp: waiting for another process building in")
        tree.wheels.mkdir()
        (tree.wheels / f"llama_cpp_python-{VERSION}-py3-none-any.whl").write_text("the other's")
        fcntl.flock(other, fcntl.LOCK_UN)
    waiting.join(10)
    assert result == [tree.wheel()] and stages.stages == []


def test_the_tree_s_cache_folder_is_rapidspec_s(monkeypatch, tmp_path):
    """llama_cpp_tree cannot import rapidspec: its copy of the cache folder's rule must agree."""
    for rapidspec_cache, xdg in ((str(tmp_path / "a"), None), (None, str(tmp_path / "x")), (None, None)):
        for name, value in (("RAPIDSPEC_CACHE", rapidspec_cache), ("XDG_CACHE_HOME", xdg)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        assert llama_cpp_tree.cache_root() == cache_root()


def test_the_tree_module_needs_only_the_standard_library():
    """scripts/install.py loads it by its path before rapidspec is installed; imported as rapidspec's module it
    pulls no torch either (rapidspec and rapidspec.bench load nothing heavy)."""
    path = Path(llama_cpp_tree.__file__)
    check = ("import importlib.util, sys\n"
             f"spec = importlib.util.spec_from_file_location('tree', {str(path)!r})\n"
             "module = importlib.util.module_from_spec(spec); sys.modules['tree'] = module\n"
             "spec.loader.exec_module(module)\n"
             "assert not [name for name in sys.modules if name.startswith(('rapidspec', 'torch'))]\n")
    subprocess.run([sys.executable, "-I", "-c", check], check=True)
    subprocess.run([sys.executable, "-c", "import sys, rapidspec.bench.llama_cpp_tree\n"
                    "assert 'torch' not in sys.modules"], check=True)
