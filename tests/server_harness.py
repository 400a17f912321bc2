"""A live server on 127.0.0.1 (a free port) in a thread, for the server tests."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from rapidspec.server import ServerConfig, create_app
from rapidspec.server.http import uvicorn_config

START_TIMEOUT_S = 30
#: The tests' HTTP client: ``HTTP.post(...)`` as ``httpx.post(...)`` (a new connection each request, httpx's default
#: timeout of 5 s) without building a client, and its TLS context (about 40 ms), for every request.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlowEngine:
    """An engine whose every streamed chunk takes ``delay`` seconds more (to hold the worker busy)."""

    def __init__(self, engine, delay: float) -> None:
        self._engine, self.delay = engine, delay
        self.chunks_made = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def decode(self, prompts, config, **options):
        for chunk in self._engine.decode(prompts, config, **options):
            time.sleep(self.delay)
            self.chunks_made += 1
            yield chunk


@contextmanager
def running_server(engine, apps: list | None = None, **config):
    """Yield the base URL of a server for ``engine``; stops it (bounded) on exit (``apps`` gets the app)."""
    config.setdefault("model_name", "tiny")
    config.setdefault("disconnect_poll_seconds", 0.1)
    server_config = ServerConfig(**config)
    app = create_app(engine, server_config)
    if apps is not None:
        apps.append(app)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, read_timeout_s=server_config.read_timeout_s,
                                           log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(15)


@contextmanager
def serve_subprocess(*options: str, env: dict | None = None):
    """``rapidspec serve OPTIONS`` in a subprocess on a free port of 127.0.0.1: yields (the process, its URL) once
    ``/health`` answers 200 (within 120 s); killed on exit if still running (its output stays readable)."""
    port = free_port()
    command = [sys.executable, "-c", "import sys; from rapidspec.cli import main; sys.exit(main())", "serve",
               "--port", str(port), *options]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            try:
                return HTTP.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return process.poll() is not None
        assert wait_until(healthy, timeout=120, every=0.2) and process.poll() is None
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def wait_until(condition, timeout: float = 10.0, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return False


def metric(url: str, name: str, **labels) -> float:
    """The value of one sample of ``/metrics`` (0 when absent)."""
    for line in HTTP.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0
