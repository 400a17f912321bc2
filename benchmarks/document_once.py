"""Read a document once: the first process prefills it, later processes read its key/value blocks from disk.

    python benchmarks/document_once.py --lengths 8192,16384,32768 --out docs/document_once.json

For each length, the built-in long document of about that many tokens (Python's reference documentation with a
planted fact) is written to a file and asked about by separate ``rapidspec generate --json`` processes sharing a
fresh ``--kv-cache-dir``, one after the other: the first asks the planted-fact question (a full prefill, whose
blocks it writes), the second asks the same question again (a new process: the answer must equal the first's),
the third asks another question about the same document; then ``rapidspec serve`` is started on the folder,
asked the first question (streamed), stopped, and started and asked again (a restart). Reported per process: the wait before the first token
(``stats.time_to_first_token``: retrieval, the target's prefill or its read from disk, the first step), the
target's prefill seconds, the prompt tokens read from disk, the process's wall time, and the folder's bytes per
1K tokens held (the target's blocks); the drafter's prefill seconds and the prompt tokens it read from disk (a
llama.cpp drafter's state, with ``--drafter-start first`` in every process); for the servers, the seconds from sending the request to its first token's chunk, measured
by the client. Every process runs with the same options (``--mode``, greedy); the machine, its CPU flags and its
load average at the start head the output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rapidspec.bench.serve.process import LaunchConfig, LocalServer
from rapidspec.cli.cache import models

OTHER_QUESTION = "Which module does the document describe first? Answer in one sentence."


def cpu_line() -> str:
    flags, name = "", platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = " ".join(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx")) or "vnni" in f)
                break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} CPUs): {flags}"


def commit_line() -> str:
    """``commit abc1234`` of the checkout the benchmark runs (rapidspec is installed editable from it)."""
    return "commit " + subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                      timeout=30).stdout.strip()


def ask(document: Path, question: str, folder: Path, args) -> dict:
    command = [sys.executable, "-m", "rapidspec", "generate", "--document", str(document), "--question", question,
               "--json", "--quiet", "--mode", args.mode, "--temperature", "0", "--max-new-tokens", str(args.max_new_tokens),
               "--kv-cache-dir", str(folder), "--target", args.target, "--dtype", args.dtype,
               "--drafter-start", args.drafter_start]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    output = json.loads(done.stdout.strip().splitlines()[-1])
    stats = output["stats"]
    return {"question": question, "text": output["text"], "wall_s": round(wall, 2),
            "time_to_first_token_s": round(stats["time_to_first_token"], 3),
            "target_prefill_s": round(stats["target_prefill_seconds"], 3),
            "prompt_tokens": stats["prompt_tokens_target"], "disk_tokens": stats["target_prefill_disk_tokens"],
            "reused_tokens": stats["target_prefill_reused_tokens"], "drafter_prefill_s": round(stats["drafter_prefill_seconds"], 3),
            "drafter_prompt_tokens": stats["prompt_tokens_drafter"], "drafter_disk_tokens": stats["drafter_prefill_disk_tokens"]}


def serve_and_ask(document: Path, question: str, folder: Path, args) -> dict:
    """A ``rapidspec serve`` started now on the folder, one streamed request: seconds from sending it to the first
    token's chunk, measured by the client, and the prompt tokens the server read from disk."""
    import httpx

    launch = LaunchConfig(("--kv-cache-dir", str(folder), "--target", args.target, "--dtype", args.dtype),
                          start_timeout_s=args.timeout)
    with LocalServer(launch) as server:
        url = server.url
        body = {"messages": [{"role": "user", "content": question}], "documents": [document.read_text(encoding="utf-8")],
                "max_tokens": args.max_new_tokens, "temperature": 0, "mode": args.mode, "stream": True}
        first, text, stats = None, [], {}
        started = time.perf_counter()
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=args.timeout) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        first = first or time.perf_counter() - started
                        text.append(choice["delta"]["content"])
                stats = chunk.get("rapidspec", {}).get("stats", stats)
        return {"question": question, "text": "".join(text), "request_to_first_token_s": round(first or float("nan"), 3),
                "disk_tokens": stats.get("target_prefill_disk_tokens"), "prompt_tokens": stats.get("prompt_tokens_target")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="8192,16384,32768", help="document lengths in tokens, comma-separated")
    parser.add_argument("--target", default="builtin")
    parser.add_argument("--mode", default="rapid")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--drafter-start", default="auto", choices=("auto", "first"),
                        help="first: every process prepares its drafter before the first round (its state on disk is "
                             "then read by the later ones)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for one process")
    parser.add_argument("--dtype", default="auto", help="the target's dtype (default: %(default)s)")
    parser.add_argument("--out", default=None, help="write the results as JSON here (updated after each length)")
    args = parser.parse_args(argv)
    from rapidspec.models import load_model
    from rapidspec.prompting.demo_document import demo_document

    tokenizer = load_model(args.target, dtype=args.dtype).tokenizer
    header = {"cpu": cpu_line(), "load_average_at_start": os.getloadavg(), "target": args.target, "mode": args.mode,
              "max_new_tokens": args.max_new_tokens, "drafter_start": args.drafter_start, "date": time.strftime("%Y-%m-%d %H:%M")}
    print(json.dumps(header), flush=True)
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        item = demo_document(tokenizer=tokenizer, target_tokens=length)
        with tempfile.TemporaryDirectory() as scratch:
            document, folder = Path(scratch) / "document.txt", Path(scratch) / "kv"
            document.write_text(item.document, encoding="utf-8")
            runs = [ask(document, item.question, folder, args), ask(document, item.question, folder, args),
                    ask(document, OTHER_QUESTION, folder, args)]
            served = [serve_and_ask(document, item.question, folder, args) for _ in range(2)]  # a restart between
            held = [m for m in models(folder) if m["model"].get("runtime") != "llama.cpp"]  # the target's blocks
            tokens, size = sum(m["tokens"] for m in held), sum(m["bytes"] for m in held)
            drafter_bytes = sum(m["bytes"] for m in models(folder) if m["model"].get("runtime") == "llama.cpp")
            row = {"length": length, "runs": runs, "served": served,
                   "same_answer": runs[0]["text"] == runs[1]["text"], "served_same_answer": served[0]["text"] == served[1]["text"],
                   "disk_tokens": tokens, "disk_bytes": size, "disk_bytes_per_1k_tokens": round(size / max(tokens, 1) * 1000),
                   "drafter_disk_bytes": drafter_bytes}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({**header, "rows": rows}, indent=1) + "\n", encoding="utf-8")
    for row in rows:
        first, again, other = row["runs"]
        print(f"{row['length']:>6} tokens: first {first['time_to_first_token_s']:.2f} s to the first token "
              f"(prefill {first['target_prefill_s']:.1f} s); a new process, same question "
              f"{again['time_to_first_token_s']:.2f} s ({again['disk_tokens']} tokens from disk, same answer: "
              f"{row['same_answer']}); another question {other['time_to_first_token_s']:.2f} s; "
              f"{row['disk_bytes_per_1k_tokens'] / 2**20:.2f} MiB per 1K tokens; rapidspec serve, started twice: "
              f"{' and '.join(str(r['request_to_first_token_s']) for r in row['served'])} s from the request to its "
              f"first token")
        if first["drafter_prompt_tokens"]:
            print(f"{'':>6}  the drafter's prefill: first {first['drafter_prefill_s']:.2f} s; a new process, same "
                  f"question {again['drafter_prefill_s']:.2f} s ({again['drafter_disk_tokens']} of its "
                  f"{again['drafter_prompt_tokens']} prompt tokens from disk); another question "
                  f"{other['drafter_prefill_s']:.2f} s ({other['drafter_disk_tokens']} of {other['drafter_prompt_tokens']}); "
                  f"its states on disk {row['drafter_disk_bytes'] / 2**20:.1f} MiB")
    print("median wall s per process:", statistics.median(r["wall_s"] for row in rows for r in row["runs"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
