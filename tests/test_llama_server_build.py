"""llama-server built on first use of ``--peer llama.cpp`` (rapidspec.bench.llama_server), with the build mocked.

``make demo``'s set-up does not build llama-server; the first ``rapidspec
bench serve --peer llama.cpp`` that finds none builds it. Here the stages'
commands (pip download, cmake configure, cmake build) are stand-ins that make
what the real ones would (an sdist with vendor/llama.cpp/tools/server, a
llama-server file) or fail, so the whole path runs in a second.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from rapidspec.bench import llama_server
from rapidspec.bench.llama_server import ENV_BINARY, build_log_path, cached_binary_path, llama_server_binary
from rapidspec.cli import main
from rapidspec.errors import RapidspecError

VERSION = "0.0.1"


REAL_RUN, REAL_WHICH = subprocess.run, shutil.which


class FakeStages:
    """Stands in for subprocess.run: records each build stage; ``fail`` names one that exits 2; runs the rest."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.stages: list[str] = []

    def __call__(self, command, *args, stdout=None, **kwargs):
        if command[0] == "cmake":
            stage = "cmake build" if "--build" in command else "cmake configure"
        elif command[1:4] == ["-m", "pip", "download"]:
            stage = "pip download"
        else:  # not the build's: run as it is
            return REAL_RUN(command, *args, stdout=stdout, **kwargs)
        self.stages.append(stage)
        stdout.write(f"output of {stage}\n")
        stdout.flush()
        if stage == self.fail:
            stdout.write("error: the compiler ran out of patience\n\n")
            stdout.flush()
            return subprocess.CompletedProcess(command, 2)
        if stage == "pip download":
            into = Path(command[command.index("-d") + 1])
            with tarfile.open(into / f"llama_cpp_python-{VERSION}.tar.gz", "w:gz") as tar:
                data = b"int main() {}\n"
                member = tarfile.TarInfo(f"llama_cpp_python-{VERSION}/vendor/llama.cpp/tools/server/server.cpp")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
        elif stage == "cmake build":
            binary = Path(command[command.index("--build") + 1]) / "bin" / "llama-server"
            binary.parent.mkdir(parents=True)
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

    monkeypatch.setattr(llama_server, "_extract_vendored", broken)
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
