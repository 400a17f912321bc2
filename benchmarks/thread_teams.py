"""What a second thread's torch work costs every later decode step of a process (rapidspec.runtime.threads).

    python benchmarks/thread_teams.py --target builtin:smollm2-135m --tokens 2048

torch and llama.cpp share one OpenMP runtime, which gives each thread that
runs a parallel region a team of its own and keeps it while the thread lives.
This script decodes lc answers on the main thread, then lets a long-lived
helper thread (a ``ThreadPoolExecutor`` worker, as the disk key/value writer
is) copy a cache-sized slice once, and decodes again: once with the helper on
torch's threads, once with :func:`~rapidspec.runtime.threads.helper_thread`
(one thread), each in a process of its own so that neither inherits the
other's teams. Prints each arm's milliseconds per token before and after (the
median of ``--answers`` answers), then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ARMS = ("torch threads", "helper_thread")


def one_arm(arm: str, target: str, tokens: int, answers: int, new_tokens: int) -> dict:
    """Decode, let a helper thread copy once, decode again; milliseconds per token before and after."""
    import torch

    from rapidspec import EngineSpec, Rapid, load_model
    from rapidspec.prompting.demo_document import demo_document
    from rapidspec.runtime.threads import helper_thread

    loaded = load_model(target)
    engine = Rapid(EngineSpec(kv_cache_gib=0), target=loaded)
    item = demo_document(tokenizer=loaded.tokenizer, target_tokens=tokens)

    def per_token(suffix: str) -> list[float]:
        times = []
        for n in range(answers):
            out = engine.generate(item.document, f"{item.question}{suffix}{' Briefly.' * n}", mode="lc",
                                  max_new_tokens=new_tokens, ignore_eos=True)
            times.append(1e3 * out.stats.decode_seconds / out.stats.new_tokens)
        return times

    per_token("")  # warm: the prefill and the first shapes
    before = per_token(" Again.")
    source = torch.randn(loaded.model.config.num_hidden_layers, 2, 4 * 256, 64).to(loaded.dtype)
    helper = ThreadPoolExecutor(1, initializer=helper_thread if arm == "helper_thread" else None)
    helper.submit(lambda: source[:, :, :256].contiguous()).result()  # one parallel copy, as a block write does
    after = per_token(" Once more.")
    return {"arm": arm, "helper_threads": helper.submit(torch.get_num_threads).result(),
            "main_threads": torch.get_num_threads(), "before_ms": before, "after_ms": after,
            "before_median_ms": statistics.median(before), "after_median_ms": statistics.median(after)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="builtin:smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2048, help="document tokens")
    parser.add_argument("--answers", type=int, default=3, help="answers timed before and after")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in a child process
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(one_arm(args.arm, args.target, args.tokens, args.answers, args.max_new_tokens)))
        return 0
    header = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_at_start": os.getloadavg(),
              "cpus": os.cpu_count(), "target": args.target, "tokens": args.tokens}
    print(json.dumps(header), flush=True)
    rows = []
    for arm in ARMS:
        done = subprocess.run([sys.executable, __file__, "--arm", arm, "--target", args.target, "--tokens",
                               str(args.tokens), "--answers", str(args.answers), "--max-new-tokens",
                               str(args.max_new_tokens)], capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        row = rows[-1]
        print(f"{arm:>14} (helper on {row['helper_threads']} thread(s)): lc decode "
              f"{row['before_median_ms']:.1f} ms a token before, {row['after_median_ms']:.1f} after "
              f"({row['after_median_ms'] / row['before_median_ms']:.2f}x)", flush=True)
    print(json.dumps({**header, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
