"""llama-cpp-python in scripts/install.py (``make demo``, ``make vllm``): compiled once per machine, in the llama.cpp
tree of the rapidspec cache (rapidspec.bench.llama_cpp_tree), and installed from there by every later set-up.

The set-up's own steps are recorded, not run; the wheel build runs the tree's script with a stand-in Python whose
``-m pip download`` and ``-m pip wheel`` make what the real ones would.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SDIST_FILES = ("pyproject.toml", "CMakeLists.txt", "vendor/llama.cpp/CMakeLists.txt",
               "vendor/llama.cpp/tools/server/server.cpp")


def install_script():
    spec = importlib.util.spec_from_file_location("install_script", ROOT / "scripts" / "install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Recorded:
    """A set-up whose steps and background starts are recorded: (what, commands) and the started commands."""

    def __init__(self, install, venv: Path) -> None:
        self.install = install
        self.setup = install.Setup(venv)
        self.steps: list[tuple[str, tuple[list[str], ...]]] = []
        self.started: list[list[str]] = []
        self.setup.has = lambda requirement: False
        self.setup.step = lambda what, about, *commands, **kwargs: self.steps.append((what, commands)) or True
        self.setup.start = self.start
        self.setup.finish = lambda job, what: None

    def start(self, what, about, command, log, env=None, ready=None):
        self.started.append(command)
        return self.install.Background(what, subprocess.Popen(["true"]), log)


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path / "cache"))
    install = install_script()
    monkeypatch.setattr(install, "cuda_machine", lambda: False)
    (tmp_path / "venv").mkdir()
    return Recorded(install, tmp_path / "venv")


def version(install) -> str:
    return install.llama_requirement().partition("==")[2]


def keep_a_wheel(install) -> Path:
    """A wheel in the tree of the pinned version, as an earlier set-up on this machine left it."""
    tree = install.llama_cpp_tree().tree_for(version(install))
    tree.wheels.mkdir(parents=True)
    wheel = tree.wheels / f"llama_cpp_python-{version(install)}-py3-none-linux_x86_64.whl"
    wheel.write_text("a wheel")
    return wheel


def test_a_wheel_this_machine_compiled_is_installed_without_compiling(recorded):
    """A fresh clone's `make demo` on the same machine: the kept wheel, no compilation."""
    wheel = keep_a_wheel(recorded.install)
    compiled = recorded.setup.compile_llama_cpp("the demo's drafter", "minutes")
    assert compiled == wheel and recorded.started == []
    recorded.setup.install_llama_cpp(compiled)
    (what, commands), = recorded.steps
    assert "compiled for this CPU by an earlier set-up" in what
    assert commands[0][-1] == str(wheel) and commands[0][1:4] == ["-m", "pip", "install"]
    assert "llama_backend_init" in commands[1][-1]
    assert wheel.is_file()  # kept for the next set-up


def test_vllm_s_set_up_installs_the_kept_wheel_with_its_constraints(recorded):
    wheel = keep_a_wheel(recorded.install)
    recorded.setup.install_llama_cpp(recorded.setup.compile_llama_cpp("the proposer's drafter", "seconds"),
                                     "-c", "constraints.txt")
    (what, commands), = recorded.steps
    assert commands[0][-3:] == ["-c", "constraints.txt", str(wheel)] and recorded.started == []


def test_without_a_kept_wheel_the_tree_s_script_compiles_it_in_the_background(recorded):
    install = recorded.install
    job = recorded.setup.compile_llama_cpp("the demo's drafter", "minutes")
    command, = recorded.started
    assert command == [sys.executable, "-I", str(install.LLAMA_CPP_TREE), "wheel", "--version", version(install),
                       "--python", str(recorded.setup.python)]
    wheel = keep_a_wheel(install)  # what the script leaves
    recorded.setup.install_llama_cpp(job)
    (what, commands), = recorded.steps
    assert what == f"installing the compiled {install.llama_requirement()}" and commands[0][-1] == str(wheel)


def test_an_installed_binding_or_a_cuda_machine_compiles_nothing(recorded, monkeypatch):
    recorded.setup.has = lambda requirement: True
    assert recorded.setup.compile_llama_cpp("the demo's drafter", "minutes") is None
    recorded.setup.has = lambda requirement: False
    monkeypatch.setattr(recorded.install, "cuda_machine", lambda: True)
    assert recorded.setup.compile_llama_cpp("the demo's drafter", "minutes") is None
    assert recorded.started == []


FAKE_PYTHON = textwrap.dedent("""\
    #!{python}
    # A stand-in for the venv's Python: `-m pip download` makes an sdist, `-m pip wheel` a wheel; each call is logged.
    import io, json, os, sys, tarfile
    from pathlib import Path

    args = sys.argv[1:]
    with open({calls!r}, "a") as calls:
        calls.write(json.dumps({{"args": args, "CMAKE_ARGS": os.environ.get("CMAKE_ARGS")}}) + "\\n")
    if args[2] == "download":
        into = Path(args[args.index("-d") + 1])
        with tarfile.open(into / "llama_cpp_python-0.0.1.tar.gz", "w:gz") as tar:
            for name in {files!r}:
                member = tarfile.TarInfo("llama_cpp_python-0.0.1/" + name)
                member.size = 2
                tar.addfile(member, io.BytesIO(b"#\\n"))
    elif args[2] == "wheel":
        out = Path(args[args.index("--wheel-dir") + 1])
        (out / "llama_cpp_python-0.0.1-py3-none-linux_x86_64.whl").write_text("a wheel")
""")


def test_the_tree_s_script_builds_the_wheel_once_from_the_kept_source(tmp_path):
    """What the set-up starts: `python3 -I llama_cpp_tree.py wheel` fetches, extracts and builds in the tree with
    the set-up's CMake options; run again it finds the wheel and prints it."""
    calls = tmp_path / "calls.jsonl"
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable, calls=str(calls), files=SDIST_FILES))
    fake.chmod(0o755)
    env = {**os.environ, "RAPIDSPEC_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-I", str(install_script().LLAMA_CPP_TREE), "wheel", "--version", "0.0.1",
               "--python", str(fake)]
    first = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    wheel = Path(first.stdout.strip().splitlines()[-1])
    tree = wheel.parent.parent
    assert wheel.read_text() == "a wheel" and wheel.parent.name == "wheels"
    assert tree.parent == tmp_path / "cache" / "llama.cpp" and tree.name.startswith("0.0.1-")
    assert all((tree / "src" / name).is_file() for name in SDIST_FILES)
    download, build = [json.loads(line) for line in calls.read_text().splitlines()]
    assert download["args"][:3] == ["-m", "pip", "download"]
    assert build["args"][-1] == str(tree / "src") and f"--config-settings=build-dir={tree / 'build'}" in build["args"]
    assert "-DGGML_NATIVE=ON" in build["CMAKE_ARGS"] and "-DLLAVA_BUILD=OFF" in build["CMAKE_ARGS"]
    assert f"-DCMAKE_PROJECT_llama.cpp_INCLUDE={ROOT / 'scripts' / 'llama_cpp_no_common.cmake'}" in build["CMAKE_ARGS"]
    again = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    assert again.stdout.strip() == str(wheel) and len(calls.read_text().splitlines()) == 2


def test_a_failing_compilation_is_the_script_s_exit_code(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport sys\nprint('error: no compiler')\nsys.exit(3)\n")
    fake.chmod(0o755)
    done = subprocess.run([sys.executable, "-I", str(install_script().LLAMA_CPP_TREE), "wheel", "--version",
                           "0.0.1", "--python", str(fake)], env={**os.environ, "RAPIDSPEC_CACHE": str(tmp_path)},
                          capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.strip() == "error: pip download failed (exit code 3)"
    assert "error: no compiler" in done.stdout


def test_a_cache_that_cannot_take_the_tree_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = subprocess.run([sys.executable, "-I", str(install_script().LLAMA_CPP_TREE), "wheel", "--version",
                           "0.0.1", "--python", sys.executable],
                          env={**os.environ, "RAPIDSPEC_CACHE": str(blocker / "cache")}, capture_output=True, text=True)
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith(f"error: cannot build in {blocker / 'cache' / 'llama.cpp'}")
    assert "set $RAPIDSPEC_CACHE to a writable folder" in done.stderr
