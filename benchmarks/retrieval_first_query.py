"""A document's first retrieval in a fresh process: from an empty embedding store, then from a filled one.

What a new `rapidspec generate` (or a restarted server, or another replica)
pays before the drafter can start, on the demo document with its question and
the default settings (hybrid retrieval, the built-in tokenizer). Each run is a
new Python process that loads the embedder and warms the retriever up
(reported apart), then times one retrieval. ``--repeats`` runs start from an
empty store (a temporary folder) and as many read the store the first of them
filled.

    python benchmarks/retrieval_first_query.py [--repeats 3]

Prints one line per run, the medians, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def one_run() -> dict:
    from rapidspec.prompting.demo_document import demo_document
    from rapidspec.retrieval import RetrievalConfig, Retriever, resolve_tokenizer

    tokenizer = resolve_tokenizer("builtin")
    item = demo_document(tokenizer=tokenizer)
    retriever = Retriever(RetrievalConfig(), tokenizer=tokenizer)
    start = time.perf_counter()
    retriever.warm_up()
    warm_up = time.perf_counter() - start
    start = time.perf_counter()
    result = retriever.retrieve(item.document, item.question)
    first = time.perf_counter() - start
    return {"warm_up_seconds": warm_up, "first_retrieval_seconds": first, "method": result.method,
            "retrieved_tokens": result.num_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_run()))
        return
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    runs: dict[str, list[dict]] = {"empty store": [], "from store": []}

    def run(label: str, store: str) -> None:
        env = dict(os.environ, RAPIDSPEC_EMBEDDING_STORE=store)
        out = subprocess.run([sys.executable, __file__, "--child"], env=env, check=True,
                             capture_output=True, text=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        runs[label].append(result)
        print(f"{label}: warm-up {result['warm_up_seconds']:.2f} s, first retrieval "
              f"{result['first_retrieval_seconds']:.3f} s ({result['method']}, {result['retrieved_tokens']} tokens)",
              flush=True)

    with tempfile.TemporaryDirectory() as filled:
        run("empty store", filled)  # fills the store the "from store" runs read
        for _ in range(args.repeats - 1):
            with tempfile.TemporaryDirectory() as empty:
                run("empty store", empty)
        for _ in range(args.repeats):
            run("from store", filled)
    summary = {label: statistics.median(r["first_retrieval_seconds"] for r in rs) for label, rs in runs.items()}
    for label, seconds in summary.items():
        print(f"median first retrieval, {label}: {seconds:.3f} s (of {args.repeats})")
    print(json.dumps({"repeats": args.repeats, "median_first_retrieval_seconds": summary, "runs": runs}))


if __name__ == "__main__":
    main()
