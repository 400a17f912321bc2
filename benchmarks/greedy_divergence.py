"""How often greedy speculative decoding with eta = 0 differs from ``lc``, per dtype.

In exact arithmetic greedy ``sd``/``ragsd``/``rapid`` with eta = 0 emit exactly
``lc``'s tokens (the engine's first invariant). On real hardware the target scores a
drafted token inside a k-token verification forward, while ``lc`` scores it in
a 1-token step; the two kernels round differently, and where two logits are
nearly tied the argmax can flip. This script measures how often that happens
on real questions:

    python benchmarks/greedy_divergence.py --data $DATA/leval/tpo.jsonl --limit 30 \
        --dtypes float32,bfloat16 --modes ragsd --max-new-tokens 48

For each dtype it loads the model, answers every question with ``lc`` and
with each mode (eta = 0, the same target cache of the document is reused
across modes and questions, EOS ignored so every answer has the same length),
and reports how many answers differ from ``lc`` and where the first
difference is. Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from rich.console import Console
from rich.progress import track
from rich.table import Table

from rapidspec import EngineSpec, Rapid, load_model
from rapidspec.config import DecodeConfig
from rapidspec.errors import RapidspecError
from rapidspec.evaluation.datasets import load_items
from rapidspec.retrieval import RetrievalConfig

SPECULATIVE = ("sd", "ragsd", "rapid")


def first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """Index of the first differing token (or the shorter length), None if equal."""
    if a == b:
        return None
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return min(len(a), len(b))


def run_dtype(args, dtype: str, items, modes) -> list[dict]:
    target = load_model(args.target, dtype=dtype)
    engine = Rapid(EngineSpec(retrieval=RetrievalConfig(method=args.retrieval, chunk_tokens=256), kv_cache_gib=0),
                   target=target)
    base = DecodeConfig(max_new_tokens=args.max_new_tokens, gamma=args.gamma, ignore_eos=True)
    rows = []
    for item in track(items, description=f"{dtype}", console=Console(stderr=True), transient=True):
        reference = engine.generate(item.document, item.question, query=item.query, template=item.template,
                                    config=base.with_(mode="lc"))
        for mode in modes:
            config = base.with_(mode=mode, eta=0.0 if mode == "rapid" else None)
            out = engine.generate(item.document, item.question, query=item.query, template=item.template, config=config)
            rows.append({
                "dtype": dtype,
                "item": item.id,
                "mode": mode,
                "prompt_tokens": out.stats.prompt_tokens_target,
                "first_difference": first_difference(reference.token_ids, out.token_ids),
                "acceptance_rate": out.stats.acceptance_rate,
            })
    return rows


def summary_rows(rows: list[dict]) -> list[dict]:
    out = []
    for key in sorted({(r["dtype"], r["mode"]) for r in rows}):
        group = [r for r in rows if (r["dtype"], r["mode"]) == key]
        differing = [r["first_difference"] for r in group if r["first_difference"] is not None]
        out.append({
            "dtype": key[0],
            "mode": key[1],
            "answers": len(group),
            "differ_from_lc": len(differing),
            "share_differing": len(differing) / len(group),
            "median_first_difference": statistics.median(differing) if differing else None,
            "median_prompt_tokens": statistics.median(r["prompt_tokens"] for r in group),
        })
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a benchmark file rapidspec eval reads (L-Eval, LongBench v2, LoCoMo)")
    parser.add_argument("--limit", type=int, default=30, help="questions (default: %(default)s)")
    parser.add_argument("--target", default="builtin")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--modes", default="ragsd", help=f"comma-separated, from {','.join(SPECULATIVE)}")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--gamma", type=int, default=6)
    parser.add_argument("--retrieval", default="bm25")
    args = parser.parse_args()
    try:
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        if not modes or any(m not in SPECULATIVE for m in modes):
            raise RapidspecError(f"--modes must name modes from {', '.join(SPECULATIVE)}")
        if args.limit < 1:
            raise RapidspecError("--limit must be >= 1")
        items = load_items(args.data)[: args.limit]
        rows = []
        for dtype in (d.strip() for d in args.dtypes.split(",") if d.strip()):
            rows.extend(run_dtype(args, dtype, items, modes))
    except RapidspecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    summary = summary_rows(rows)
    table = Table(title=f"greedy, eta = 0, {args.max_new_tokens} tokens per answer (EOS ignored): answers that differ from lc")
    for name in ("dtype", "mode", "answers", "differ from lc", "median first difference", "median prompt tokens"):
        table.add_column(name)
    for s in summary:
        table.add_row(
            s["dtype"], s["mode"], str(s["answers"]), f"{s['differ_from_lc']} ({s['share_differing']:.0%})",
            "-" if s["median_first_difference"] is None else f"{s['median_first_difference']:g}",
            f"{s['median_prompt_tokens']:g}",
        )
    Console(width=160).print(table)
    print(json.dumps({"data": args.data, "max_new_tokens": args.max_new_tokens, "summary": summary, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
