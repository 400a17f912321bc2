"""``rapidspec serve`` (or a peer server) in a subprocess on 127.0.0.1, for ``rapidspec bench serve``.

:class:`LocalServer` starts the server on a free port with the given options,
its output in a log file, waits (bounded) until ``/health`` answers, and on
exit stops it with SIGTERM (then SIGKILL after ``stop_timeout_s``) and keeps
its exit code. A server that exits or does not answer in time is a
RapidspecError naming the log and its last line. A subclass names its own
``command`` and ``environment``; one with ``own_group`` (a server that starts
processes of its own, as vLLM's engine core) runs in a process group of its
own, and whatever of that group outlives the server is killed.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from rapidspec.errors import RapidspecError

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
#: Seconds the children of a server in a group of its own get to exit after it, then after SIGTERM.
GROUP_GRACE_S = 5.0
#: Seconds between the readiness checks of a server starting (its /health).
READY_POLL_S = 0.2


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LaunchConfig:
    """``serve_args``: options of ``rapidspec serve`` (not --host or --port, which are chosen here).

    ``api_key`` reaches the server as its environment variable ``RAPIDSPEC_API_KEY``
    (not on its command line, where other users of the machine could read it).
    """

    serve_args: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if any(arg.split("=")[0] in ("--host", "--port") for arg in self.serve_args):
            raise RapidspecError("bench serve starts its server on 127.0.0.1 on a free port; "
                                 "give --base-url to benchmark a server started elsewhere")
        if not self.start_timeout_s > 0 or not self.stop_timeout_s > 0:
            raise RapidspecError("the server's start and stop timeouts must be > 0")


class LocalServer:
    """A context manager: ``url`` once started, ``exit_code`` after the ``with`` block."""

    name = "rapidspec serve"
    own_group = False  # True: a process group of its own, killed whole once the server has exited

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.url: str | None = None
        self.exit_code: int | None = None
        self.log_path: str | None = None
        self._process: subprocess.Popen | None = None

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "rapidspec", "serve", "--host", HOST, "--port", str(port), *self.config.serve_args]

    def environment(self) -> dict[str, str]:
        return os.environ | ({"RAPIDSPEC_API_KEY": self.config.api_key} if self.config.api_key else {})

    def __enter__(self) -> LocalServer:
        port = free_port()
        with tempfile.NamedTemporaryFile("wb", prefix=f"rapidspec_bench_serve_{self.name.split()[0]}_", suffix=".log", delete=False) as log:
            self.log_path = log.name
            logger.info("starting %s (log: %s)", " ".join(self.command(port)), log.name)
            self._process = subprocess.Popen(self.command(port), stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, env=self.environment(),
                                              start_new_session=self.own_group)
        try:
            self._wait_ready(f"http://{HOST}:{port}")
        except BaseException:
            self.stop()
            raise
        self.url = f"http://{HOST}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self, url: str) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if (code := self._process.poll()) is not None:
                raise RapidspecError(f"{self.name} exited with code {code} before it was ready: "
                                     f"{self.last_log_line()} (log: {self.log_path})")
            if time.monotonic() > deadline:
                raise RapidspecError(f"{self.name} was not ready within {self.config.start_timeout_s:g} s "
                                     f"(log: {self.log_path})")
            time.sleep(READY_POLL_S)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``; the exit code (negative: killed by that signal)."""
        process, self._process = self._process, None
        if process is None:
            return self.exit_code
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            self.exit_code = process.wait(timeout=self.config.stop_timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %g s of SIGTERM; killing it", self.name, self.config.stop_timeout_s)
            process.kill()
            self.exit_code = process.wait()
        if self.own_group:
            _kill_group(process.pid, self.name)
        return self.exit_code

    def last_log_line(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                lines = [line.strip() for line in f.read()[-4000:].splitlines() if line.strip()]
        except OSError:
            return "(no log)"
        return lines[-1] if lines else "(empty log)"


def _group_alive(group: int) -> bool:
    """Whether a process of ``group`` still runs (zombies not counted: they wait for a parent to reap them)."""
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):
        return False
    if not os.path.isdir("/proc"):
        return True
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat, encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ... after "pid (comm)"
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(group) and fields[0] != "Z":
            return True
    return False


def _kill_group(group: int, name: str, grace_s: float | None = None) -> None:
    """What is left of process group ``group`` ``grace_s`` after its leader exited (nothing, normally: a server's
    children exit soon after it): SIGTERM, then SIGKILL after another ``grace_s``."""
    grace_s = GROUP_GRACE_S if grace_s is None else grace_s
    deadline = time.monotonic() + grace_s
    while _group_alive(group) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not _group_alive(group):
        return
    logger.warning("%s left processes behind after it exited; stopping them", name)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _group_alive(group) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_alive(group):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
