"""One ``rapidspec bench serve`` run: the load on a server (started here or not), then on each peer, with progress.

Servers started here listen on 127.0.0.1 and are stopped afterwards, on SIGTERM too (:func:`terminate_as_interrupt`);
a peer that does not start is one line and a ``failed`` summary, and the others still run.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import replace

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rapidspec.errors import RapidspecError


def measure(config, requests, err: Console, counters: dict[str, str] | None = None) -> dict:
    """The summary of ``config``'s load (a :class:`~rapidspec.bench.serve.load.LoadConfig`) with a progress bar."""
    from rapidspec.bench.serve.load import run_benchmark

    counts = {"completed": 0, "rejected": 0, "error": 0}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task("test request" if config.test_request else "requests", total=config.num_prompts)

        def done(result) -> None:
            counts[result.outcome] += 1
            progress.update(task, advance=1, description=", ".join(f"{k} {v}" for k, v in counts.items()))

        return run_benchmark(config, requests, on_done=done, counters=counters)


def measure_started(server, config, requests, err: Console, args: list[str], counters=None) -> dict:
    """Start ``server`` (a LocalServer) on 127.0.0.1, measure the load on it, stop it; the summary with its side."""
    with contextlib.ExitStack() as stack:
        with err.status(f"starting {server.name} on 127.0.0.1"):
            stack.enter_context(server)
        err.print(f"{server.name} started at {server.url} (log: {server.log_path})", soft_wrap=True)
        summary = measure(replace(config, base_url=server.url), requests, err, counters)
    return summary | {"server": {"started_here": True, "args": args, "exit_code": server.exit_code,
                                 "log": server.log_path}}


def measure_peer(peer, requests, err: Console) -> dict:
    """The peer's summary; one that did not start or whose test request failed is one line on stderr (naming the
    server's log) and ``{"failed": message}`` in the results, and the other servers still run."""
    try:
        return measure_started(peer.server, peer.load, requests, err, peer.args, peer.counters)
    except RapidspecError as error:
        log = peer.server.log_path
        message = str(error) if log is None or log in str(error) else f"{error} (log: {log})"
        err.print(f"{peer.name}: {message}", soft_wrap=True, markup=False, highlight=False)
        return {"failed": message, "server": {"started_here": True, "args": peer.args,
                                                 "exit_code": peer.server.exit_code, "log": peer.server.log_path}}


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM (``timeout``, ``kill``) raises KeyboardInterrupt, so the servers started here are stopped as on
    Ctrl-C rather than left running (vLLM's in a process group of their own would not get the signal)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def redacted(serve_args: tuple[str, ...]) -> list[str]:
    """The arguments without the API key."""
    return ["***" if previous == "--api-key" else "--api-key=***" if arg.startswith("--api-key=") else arg
            for previous, arg in zip(("", *serve_args), serve_args)]


def failed(summaries: dict[str, dict]) -> bool:
    """A request lost or failed on any server, a peer that did not run, or a server started here that did not stop
    cleanly."""
    return any(s.get("failed") or s["lost"] or s["errors"] or s["server"].get("exit_code", 0) != 0
               for s in summaries.values())
