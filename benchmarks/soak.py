"""A quarter hour of mixed requests against one `rapidspec serve`: does anything leak, break or go missing?

    python benchmarks/soak.py --requests 3000 --minutes 15 --out docs/soak_2026-11-26 \\
        --json docs/results/soak_2026-11-26.json

Starts `rapidspec serve` (built-in model, --max-num-seqs 4) on 127.0.0.1 on a
free port and sends --requests requests over --minutes from --concurrency
clients, each due at an even pace (behind schedule they go as fast as the
clients can; none is sent after --minutes). The mix (benchmarks/soak_mix.py):
short chats and short, shared long and first-seen long documents in every
mode, two-turn chats, streams read to the end and streams closed after a few
chunks, log-probabilities, JSON schemas (some with ignore_eos), tools,
ignore_eos, stop strings, text completions, the official openai client, and
bad bodies (malformed JSON, wrong types: each must be a 4xx).

Every --sample-seconds it reads the server process's RSS, open descriptors and
threads (psutil) and the prefix cache's entries and bytes (/health). After
--warmup-minutes the load pauses until the engine is idle for the baseline;
after the load it waits until idle, --settle seconds more, and reads again.
The server's prefix cache is capped at --prefix-cache-gib (0.5; the server's
default is 2) so that it fills during the warm-up: what grows after it is not the cache.

Verdicts (exit code 1 if one fails): RSS idle after the load at most 10% above
idle after the warm-up; descriptors back to at most the warm-up's, threads
too or only idle workers of bounded pools added (:data:`BOUNDED_POOLS`);
no 5xx (nor an internal error inside a stream); nothing lost (every request
answered, or a stream closed on purpose); every answer well-formed; SIGTERM
stops the server with exit code 0. Writes OUT.txt (the summary), OUT.png (the
samples over time) and --json (every sample, each request in columns, every
problem in full); prints one JSON object (the figures) as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict

import httpx
import psutil
from rich.console import Console
from rich.table import Table

from rapidspec.bench.serve.process import LaunchConfig, LocalServer
from rapidspec.prompting.demo_document import demo_document
from soak_mix import MIX, Client, Outcome, sentences

MIB = 2**20


class Sampler(threading.Thread):
    """Reads the server process and its /health every ``every`` seconds until stopped."""

    def __init__(self, url: str, pid: int, every: float, t0: float, done) -> None:
        super().__init__(daemon=True)
        self.url, self.process, self.every, self.t0, self.done = url, psutil.Process(pid), every, t0, done
        self.samples: list[dict] = []
        self.halt = threading.Event()

    def sample(self, label: str = "load") -> dict:
        with self.process.oneshot():  # before /health, whose connection is one more descriptor
            rss, fds, threads = self.process.memory_info().rss, self.process.num_fds(), self.process.num_threads()
        children = self.process.children(recursive=True)
        row = {"t": round(time.monotonic() - self.t0, 1), "label": label, "rss": rss, "fds": fds, "threads": threads,
               "children": len(children), "load1": os.getloadavg()[0], "done": self.done()}
        try:
            health = httpx.get(f"{self.url}/health", timeout=10).json()
            row |= {"prefix_cache_bytes": health["prefix_cache"]["bytes"],
                    "prefix_cache_entries": health["prefix_cache"]["entries"],
                    "running": health["running"], "waiting": health["waiting"]}
        except (httpx.HTTPError, ValueError, KeyError) as err:
            row["health_error"] = repr(err)
        self.samples.append(row)
        return row

    def run(self) -> None:
        console = Console(stderr=True)
        while not self.halt.wait(self.every):
            row = self.sample()
            console.log(f"t={row['t']:.0f}s done={row['done']} rss={row['rss'] / MIB:.0f} MiB fds={row['fds']} "
                        f"threads={row['threads']} prefix cache={row.get('prefix_cache_bytes', 0) / MIB:.0f} MiB "
                        f"running={row.get('running')} waiting={row.get('waiting')} load={row['load1']:.1f}")


def build_schedule(rng: random.Random, requests: int) -> list[tuple[str, int, int]]:
    """(kind, seed, position): ``position`` is the index of the item's first request, which sets when it is due."""
    names, weights = list(MIX), [weight for weight, _, _ in MIX.values()]
    items, position = [], 0
    while position < requests:
        name = rng.choices(names, weights)[0]
        items.append((name, rng.getrandbits(32), position))
        position += MIX[name][2]
    return items


def run_phase(items: list, make_client, concurrency: int, due_at, deadline: float, outcomes: list) -> list:
    """Sends ``items`` from ``concurrency`` threads, none after ``deadline``; the items left, in order."""
    pending, lock, unsent = list(reversed(items)), threading.Lock(), []

    def worker() -> None:
        client = make_client()
        try:
            while True:
                with lock:
                    if not pending:
                        return
                    name, seed, position = item = pending.pop()
                    if max(time.monotonic(), due_at(position)) > deadline:
                        unsent.append(item)
                        continue
                time.sleep(max(0.0, due_at(position) - time.monotonic()))
                try:
                    results = MIX[name][1](client, random.Random(seed))
                except Exception as err:  # the benchmark's own bug: counted, never taken for the server's
                    results = [Outcome(name, "client error", ok=False, note=f"client error: {err!r}")]
                with lock:
                    outcomes.extend(results)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(unsent, key=lambda item: item[2])


def wait_idle(url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health", timeout=10).json()
        if health["running"] == 0 and health["waiting"] == 0:
            return
        time.sleep(0.5)
    raise RuntimeError("the engine was not idle within the timeout")


def idle_sample(sampler: Sampler, settle: float, label: str) -> dict:
    """After ``settle`` seconds (idle kept-alive connections close after 5 s), the least of three reads 2 s apart."""
    time.sleep(settle)
    rows = []
    for i in range(3):
        rows.append(sampler.sample(label))
        time.sleep(2 if i < 2 else 0)
    return rows[-1] | {"fds": min(r["fds"] for r in rows), "threads": min(r["threads"] for r in rows)}


#: Pools whose workers start on first need and then wait idle, up to a bound (py-spy's names, numbers as _N).
BOUNDED_POOLS = {
    "rapidspec-prepare_N": "the server's preparing pool (max_queue + max_num_seqs threads)",
    "rapidspec-step_N": "the batched step pool (max_num_seqs threads)",
    "uvloop_N": "the event loop's default executor (min(32, cores + 4) threads)",
    "asyncio_N": "the event loop's default executor (min(32, cores + 4) threads)",
}


def thread_names(pid: int) -> list[str] | None:
    """The Python names of the server's threads (py-spy, where installed), to say which ones a count adds."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy is None:
        return None
    try:
        dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sorted(re.sub(r"_\d+$", "_N", name) for name in re.findall(r'^Thread \S+ \(\w+\): "(.*)"', dump, re.M))


def code_version() -> str:
    """The commit the server ran, and whether rapidspec/ had uncommitted changes (it is installed editable)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=30).stdout.strip()
    changed = git("status", "--porcelain", "--", "rapidspec")
    return f"commit {git('rev-parse', '--short', 'HEAD')}" + (
        f" plus uncommitted changes to {len(changed.splitlines())} files under rapidspec/" if changed else "")


def server_counters(url: str) -> dict[str, float]:
    """The server's own request counters from /metrics (success by finish reason, failure by reason)."""
    counters = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(("rapidspec:request_success_total", "rapidspec:request_failure_total")):
            name, value = line.rsplit(" ", 1)
            counters[name.replace('model_name="builtin",', "")] = float(value)
    return counters


def count_verdict(sent: int, counters: dict[str, float]) -> tuple[str, bool, str]:
    """Whether the server's counters (:func:`server_counters`) account for every request the clients sent:
    each one finishes (success, by reason) or fails (failure, by reason) exactly once."""
    counted = sum(counters.values())
    by_kind = ", ".join(f"{name.split('{')[1].rstrip('}')} {value:g}" for name, value in sorted(counters.items()) if value)
    return ("the server counted every request once", counted == sent,
            f"{counted:g} counted of {sent} sent ({by_kind or 'none'})")


def percentile(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summarise(outcomes: list[Outcome], samples: list[dict], marks: dict, extra: dict) -> tuple[dict, list, tuple]:
    """The figures, the verdicts (name, passed, text) and the problems: (lost, 5xx, not well-formed)."""
    lost = [o for o in outcomes if o.status is None and not o.cancelled and not o.note.startswith("client error")]
    server_errors = [o for o in outcomes if (o.status or 0) >= 500 or o.error_type == "internal_error"]
    counted = {id(o) for o in lost + server_errors}
    malformed = [o for o in outcomes if not o.ok and id(o) not in counted]
    warm, after = marks["after_warmup"], marks["after_load"]
    rss_growth = after["rss"] / warm["rss"] - 1
    net = [m["rss"] - m.get("prefix_cache_bytes", 0) for m in (warm, after)]
    under_load = [s for s in samples if s["label"] == "load" and s["t"] > warm["t"]]
    figures = {"requests": len(outcomes), "not_sent": extra["not_sent"], "lost": len(lost), "5xx": len(server_errors),
               "malformed": len(malformed), "cancelled": sum(o.cancelled for o in outcomes),
               "statuses": dict(sorted(Counter(str(o.status) for o in outcomes).items())),
               "rss_growth_after_warmup": rss_growth, "rss_less_prefix_cache_growth": net[1] / net[0] - 1,
               "rss_max_under_load_after_warmup": max((s["rss"] for s in under_load), default=None),
               "marks": marks} | extra
    threads_ok, threads_note = after["threads"] <= warm["threads"], ""
    names = extra["thread_names"]
    if not threads_ok and names["after_warmup"] is not None and names["after_load"] is not None:
        added = Counter(names["after_load"]) - Counter(names["after_warmup"])
        threads_ok = set(added) <= set(BOUNDED_POOLS)
        threads_note = f" (added: {', '.join(f'{n} x {name}' for name, n in added.items())})"
    verdicts = [
        ("RSS after warm-up grows at most 10%", rss_growth <= 0.10,
         f"{warm['rss'] / MIB:.0f} -> {after['rss'] / MIB:.0f} MiB idle ({rss_growth:+.1%}); prefix cache "
         f"{warm.get('prefix_cache_bytes', 0) / MIB:.0f} -> {after.get('prefix_cache_bytes', 0) / MIB:.0f} MiB, "
         f"RSS less it {net[0] / MIB:.0f} -> {net[1] / MIB:.0f} MiB ({net[1] / net[0] - 1:+.1%})"),
        ("descriptors back to the warm-up's", after["fds"] <= warm["fds"], f"{warm['fds']} -> {after['fds']}"),
        ("threads back to the warm-up's, or only bounded pools' idle workers added", threads_ok,
         f"{warm['threads']} -> {after['threads']}{threads_note}"),
        ("no 5xx", not server_errors, f"{len(server_errors)} (HTTP 5xx or an internal error inside a stream)"),
        ("nothing lost", not lost, f"{len(lost)} of {len(outcomes)} requests without an answer"),
        ("every answer well-formed", not malformed, f"{len(malformed)} not"),
        ("SIGTERM: exit code 0", extra["server_exit_code"] == 0, f"exit code {extra['server_exit_code']}"),
        count_verdict(len(outcomes), extra["server_counters"]),
    ]
    return figures, verdicts, (lost, server_errors, malformed)


def report(console: Console, outcomes: list[Outcome], figures: dict, verdicts: list, problems: tuple, header: str):
    console.print(header)
    marks = figures["marks"]
    table = Table(title="the server process (idle: nothing running or waiting)")
    for column in ("", "start, idle", "after warm-up, idle", "end of load", "after load, idle", "max under load"):
        table.add_column(column, justify="right")
    peak = figures["rss_max_under_load_after_warmup"]
    order = ("start", "after_warmup", "end_of_load", "after_load")
    table.add_row("RSS, MiB", *(f"{marks[m]['rss'] / MIB:.0f}" for m in order), f"{peak / MIB:.0f}" if peak else "")
    table.add_row("open descriptors", *(str(marks[m]["fds"]) for m in order), "")
    table.add_row("threads", *(str(marks[m]["threads"]) for m in order), "")
    table.add_row("prefix cache, MiB (entries)", *(f"{marks[m].get('prefix_cache_bytes', 0) / MIB:.0f} "
                                                   f"({marks[m].get('prefix_cache_entries')})" for m in order), "")
    console.print(table)
    kinds = Table(title="requests by kind")
    for column in ("kind", "sent", "2xx", "4xx", "5xx", "cancelled", "lost", "not well-formed", "median s", "p95 s"):
        kinds.add_column(column, justify="right")
    lost, errors, malformed = ({id(o) for o in group} for group in problems)
    for name in [*MIX, "chat_turn2"]:
        mine = [o for o in outcomes if o.kind == name]
        if not mine:
            continue
        seconds = [o.seconds for o in mine if o.status is not None]
        kinds.add_row(name, str(len(mine)), *(str(sum(1 for o in mine if o.status and o.status // 100 == c))
                                               for c in (2, 4, 5)),
                      str(sum(o.cancelled for o in mine)), str(sum(id(o) in lost for o in mine)),
                      str(sum(id(o) in malformed for o in mine)),
                      f"{statistics.median(seconds):.2f}" if seconds else "", f"{percentile(seconds, 0.95):.2f}")
    console.print(kinds)
    console.print(f"statuses: {figures['statuses']}; not sent (past --minutes): {figures['not_sent']}")
    console.print(f"the server's own counters (/metrics): {figures['server_counters']}")
    names = figures["thread_names"]
    if names["after_warmup"] is not None and names["after_load"] is not None:
        added, gone = Counter(names["after_load"]) - Counter(names["after_warmup"]), \
            Counter(names["after_warmup"]) - Counter(names["after_load"])
        console.print(f"threads (py-spy) after warm-up -> after load: added {dict(added) or 'none'}, "
                      f"gone {dict(gone) or 'none'}")
    for title, group in zip(("lost", "5xx", "not well-formed"), problems):
        for (kind, shape, status, note), count in Counter((o.kind, o.shape, o.status, o.note)
                                                          for o in group).most_common(20):
            console.print(f"{title}: {count} x {kind} [{shape}] status {status}: {note}")
    for name, passed, text in verdicts:
        console.print(f"[{'green' if passed else 'red'}]{'PASS' if passed else 'FAIL'}[/] {name}: {text}")


def plot(samples: list[dict], marks: dict, warm_end: float, path: str, title: str) -> None:
    """``warm_end``: minutes after the server was ready when the warm-up's load stopped."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s["t"] / 60 for s in samples]
    panels = (("RSS, MiB", lambda s: s["rss"] / MIB), ("open descriptors", lambda s: s["fds"]),
              ("threads", lambda s: s["threads"]),
              ("prefix cache, MiB", lambda s: s.get("prefix_cache_bytes", float("nan")) / MIB),
              ("load average, 1 min", lambda s: s["load1"]))
    fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(9, 11))
    for ax, (label, value) in zip(axes, panels):
        ax.plot(minutes, [value(s) for s in samples], marker=".", linewidth=1)
        ax.set_ylabel(label)
        ax.axvspan(0, warm_end, color="0.9", label="warm-up")
        ax.axvspan(warm_end, marks["after_warmup"]["t"] / 60, color="0.8", label="idle pause (baseline)")
        ax.axvline(marks["end_of_load"]["t"] / 60, color="tab:red", linewidth=0.8, linestyle="--",
                   label="load ends")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    axes[0].set_title(title)
    axes[-1].set_xlabel("minutes since the server was ready")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="builtin")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--warmup-minutes", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=8, help="clients at once (default: 8)")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--prefix-cache-gib", type=float, default=0.5,
                        help="the server's prefix cache (its default is 2): small enough to fill in the warm-up")
    parser.add_argument("--serve-arg", action="append", default=[], help="another option of rapidspec serve")
    parser.add_argument("--sample-seconds", type=float, default=10.0)
    parser.add_argument("--settle", type=float, default=8.0, help="seconds idle before the idle reads")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a client waits for an answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="", help="a line for the summary (what else ran on the machine)")
    parser.add_argument("--out", default="soak", help="writes OUT.txt and OUT.png")
    parser.add_argument("--json", help="the JSON of samples and requests (default: OUT.json)")
    args = parser.parse_args(argv)
    if not (1 <= args.requests <= 100_000 and 0 < args.minutes <= 240 and 0 <= args.warmup_minutes < args.minutes
            and 1 <= args.concurrency <= 64 and args.sample_seconds >= 1 and 0 < args.timeout <= 600):
        parser.error("--requests in [1, 100000], --minutes in (0, 240], --warmup-minutes below --minutes, "
                     "--concurrency in [1, 64], --sample-seconds >= 1, --timeout in (0, 600]")
    console = Console(record=True, width=130)
    rng = random.Random(args.seed)
    items = build_schedule(rng, args.requests)
    long_docs = [demo_document(target_tokens=3000).document, sentences(random.Random("shared"), 3000)]
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    serve_args = ("--target", args.target, "--max-num-seqs", str(args.max_num_seqs),
                  "--prefix-cache-gib", f"{args.prefix_cache_gib:g}", *args.serve_arg)
    outcomes: list[Outcome] = []
    version = code_version()
    with LocalServer(LaunchConfig(serve_args)) as server:
        url = server.url

        def make_client() -> Client:
            return Client(url, long_docs, timeout)

        pid = httpx.get(f"{url}/health", timeout=10).json()["pid"]
        t0 = time.monotonic()
        sampler = Sampler(url, pid, args.sample_seconds, t0, done=lambda: len(outcomes))
        marks = {"start": sampler.sample("start")}
        sampler.start()
        per_request = args.minutes * 60 / args.requests
        began = time.monotonic()
        warm_end = began + args.warmup_minutes * 60
        left = run_phase(items, make_client, args.concurrency, lambda p: began + p * per_request, warm_end, outcomes)
        wait_idle(url)
        marks["after_warmup"] = idle_sample(sampler, args.settle, "after warm-up")
        names = {"after_warmup": thread_names(pid)}
        paused = time.monotonic() - warm_end
        left = run_phase(left, make_client, args.concurrency, lambda p: began + paused + p * per_request,
                         began + paused + args.minutes * 60, outcomes)
        load_seconds = time.monotonic() - began - paused
        marks["end_of_load"] = sampler.sample("end of load")
        wait_idle(url)
        marks["after_load"] = idle_sample(sampler, args.settle, "after load")
        names["after_load"] = thread_names(pid)
        sampler.halt.set()
        sampler.join()
        counters = server_counters(url)
    extra = {"not_sent": len(left), "load_seconds": round(load_seconds, 1), "paused_seconds": round(paused, 1),
             "code": version, "server_exit_code": server.exit_code, "server_counters": counters, "thread_names": names}
    figures, verdicts, problems = summarise(outcomes, sampler.samples, marks, extra)
    loads = [s["load1"] for s in sampler.samples]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    header = (f"soak: {' '.join(['python benchmarks/soak.py', *(argv if argv is not None else sys.argv[1:])])}\n"
              f"rapidspec serve {' '.join(serve_args)}; {args.concurrency} clients; {len(outcomes)} requests in "
              f"{load_seconds / 60:.1f} min of load ({len(outcomes) / load_seconds:.2f}/s; a {paused:.0f} s pause "
              f"after the warm-up of {args.warmup_minutes:g} min for the idle baseline)\n"
              f"machine: {cpu}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
              f"{platform.platform()}; 1-min load average during the run: median {statistics.median(loads):.1f}, "
              f"max {max(loads):.1f}\ncode: {version}\n" + (f"{args.note}\n" if args.note else ""))
    report(console, outcomes, figures, verdicts, problems, header)
    plot(sampler.samples, marks, (warm_end - t0) / 60, f"{args.out}.png",
         f"rapidspec serve under {len(outcomes)} mixed requests ({args.concurrency} clients)")
    with open(f"{args.out}.txt", "w") as f:
        f.write(console.export_text())
    kinds = list(dict.fromkeys(o.kind for o in outcomes))
    columns = {"kinds": kinds, "kind": [kinds.index(o.kind) for o in outcomes],
               "started": [round(o.started - t0, 2) for o in outcomes], "seconds": [round(o.seconds, 3) for o in outcomes],
               "status": [o.status for o in outcomes], "ok": [int(o.ok) for o in outcomes],
               "cancelled": [int(o.cancelled) for o in outcomes]}
    unusual = [asdict(o) | {"started": round(o.started - t0, 2)} for o in outcomes
               if not o.ok or (o.status or 0) >= 500 or o.status is None and not o.cancelled]
    with open(args.json or f"{args.out}.json", "w") as f:
        json.dump({"args": vars(args), "figures": figures, "verdicts": verdicts, "samples": sampler.samples,
                   "requests": columns, "problems": unusual}, f)
    print(json.dumps({k: v for k, v in figures.items() if k != "marks"} | {
        "verdicts": {name: passed for name, passed, _ in verdicts}}))
    return 0 if all(passed for _, passed, _ in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
