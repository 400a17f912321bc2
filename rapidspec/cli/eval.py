"""``rapidspec eval``: answer quality (and speed) of each mode on a benchmark, resumable.

Prints a summary table on stdout, then one JSON object as the last stdout
line; the progress bar goes to stderr. ``--results FILE.jsonl`` keeps one line
per (item, mode) and lets a rerun resume where the last one stopped.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import fields

from rich.console import Console
from rich.table import Table

from rapidspec.cli.options import (add_decode_options, add_model_options, add_retrieval_options, decode_config,
                                   engine_spec, json_object, load_models)
from rapidspec.cli.prefill_bar import prefill_bar
from rapidspec.config import MAX_TOP_LOGPROBS, MODES, DecodeConfig
from rapidspec.errors import RapidspecError
from rapidspec.evaluation.breakdown import GROUPS, RIGHT_AT, breakdown, gap_text
from rapidspec.evaluation.datasets import FORMATS, load_items
from rapidspec.evaluation.variants import parse_modes
from rapidspec.evaluation.runner import DEFAULT_MODES, run_eval
from rapidspec.evaluation.synthetic import TASKS
from rapidspec.evaluation.variants import parse_eval_sweep

# Decode options passed through to every generation when not at their defaults.
_PASSED_THROUGH = ("gamma_schedule", "max_gamma", "draft_confidence", "top_k", "top_p", "draft_gate", "residual", "stop",
                   "truncate", "ignore_eos", "sink_tokens", "streaming_tokens", "drafter_backend", "frequency_penalty",
                   "presence_penalty", "repetition_penalty")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="score each mode's answers on a benchmark (LongBench v2, L-Eval, LoCoMo, synthetic needles)",
        description=(
            "Runs every item under every mode (document by document, so the target's document cache serves "
            "the next modes and questions), scores the answers (accuracy, token F1/EM, ROUGE-L, needle recall) "
            "and reports means with 95% bootstrap intervals and the mean speed statistics of the same runs."
        ),
    )
    parser.add_argument("--data", default=None, help="benchmark file in its official format (not needed for synthetic)")
    parser.add_argument("--format", default=None, choices=FORMATS, help="data format (default: detected from the content)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N items only")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated modes (default: %(default)s)")
    parser.add_argument("--results", default=None, metavar="FILE.jsonl", help="append one JSON line per (item, mode); rerun to resume")
    parser.add_argument("--judge", default=None, metavar="MODEL",
                        help="rate open answers (short answers, summaries) 1-10 with this local model as an LLM judge "
                             "(builtin:NAME, an HF id or dir, a .gguf file; auto = the largest built-in model "
                             "installed); not comparable with GPT-4 scores")
    parser.add_argument("--overwrite", action="store_true", help="start --results afresh even if it holds another configuration")
    parser.add_argument("--include-adversarial", action="store_true", help="LoCoMo: keep category 5 (adversarial) questions")
    parser.add_argument("--sweep", default=None, metavar="NAME=V1,V2,...",
                        help="run the modes that use NAME once per value: eta or draft_gate (rapid), gamma or draft_confidence "
                             "(drafting modes), budget_tokens (retrieving modes), streaming_tokens (magicdec)")
    parser.add_argument("--retrieve-from", default=None, metavar="other-item|FILE",
                        help="retrieve the drafter's chunks from another item's document or from FILE instead of the "
                             "item's own (unrelated retrieval on purpose; the target still reads the item's document)")
    parser.add_argument("--logprobs", type=int, default=0, metavar="K",
                        help="store in each record the top-K log-probabilities of its first answer tokens under the lc, "
                             "rag and drafter views, for offline recomputation (benchmarks/offline_eta.py); 0 = off")
    synthetic = parser.add_argument_group("synthetic needle tasks (--format synthetic)")
    synthetic.add_argument("--lengths", default="4096", help="prompt lengths in tokens, comma-separated (default: %(default)s)")
    synthetic.add_argument("--tasks", default=",".join(TASKS), help="comma-separated (default: %(default)s)")
    synthetic.add_argument("--per-task", type=int, default=10, help="items per task and length (default: %(default)s)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON summary line")
    cluster = parser.add_argument_group("on Ray (docs/scaling.md; the ray extra)")
    cluster.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                         help="answer the items on Ray actors, each with its own engine: a local Ray instance, or the "
                              "cluster at ADDRESS (e.g. auto, or ray://HOST:10001); the results file stays here")
    cluster.add_argument("--workers", type=int, default=None, help="actors with --ray (default: 2)")
    cluster.add_argument("--worker-resources", default=None, metavar="JSON",
                         help='Ray resources of each actor, e.g. \'{"num_gpus": 1}\' (default: {"num_cpus": 1})')
    add_model_options(parser)
    add_decode_options(parser, modes=False)
    add_retrieval_options(parser)
    # 256-token chunks: the default 512 exceeds the default budget (doc/16, at least 256) below ~8K tokens.
    # the paper's setting, every token of rapid from p^: the drafter from the first round, gamma drafts a round
    # (--drafter-start auto --gamma-schedule auto ask for the serving defaults: rapidspec.drafting.join)
    parser.set_defaults(handler=run, max_new_tokens=None, seed=0, chunk_tokens=256, drafter_start="first",
                        gamma_schedule="constant")


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise RapidspecError(f"--{name} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise RapidspecError(f"--{name} is empty")
    return values


def run(args: argparse.Namespace) -> int:
    # Validate everything that does not need the model before loading it.
    modes = parse_modes(args.modes, allowed=MODES, lc_first=False)
    sweep = parse_eval_sweep(args.sweep) if args.sweep else None
    if args.retrieve_from not in (None, "other-item") and not os.path.isfile(args.retrieve_from):
        raise RapidspecError(f"--retrieve-from takes other-item or a file; {args.retrieve_from} is not a file")
    base = decode_config(args, mode="rapid", max_new_tokens=args.max_new_tokens or 64)
    if base.grammar is not None:
        raise RapidspecError("--json-schema and --json-object do not apply to eval: its scorers read free-text answers")
    defaults = DecodeConfig()
    passed = {f.name: getattr(base, f.name) for f in fields(DecodeConfig)
              if f.name in _PASSED_THROUGH and getattr(base, f.name) != getattr(defaults, f.name)}
    if "stop" in passed:
        passed["stop"] = list(passed["stop"])
    # the runner's defaults are eval's (the paper's setting), not the engine's
    passed["drafter_start"], passed["gamma_schedule"] = base.drafter_start, base.gamma_schedule
    if not 0 <= args.logprobs <= MAX_TOP_LOGPROBS:
        raise RapidspecError(f"--logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {args.logprobs}")
    if args.limit is not None and args.limit < 1:
        raise RapidspecError(f"--limit must be >= 1, got {args.limit}")
    synthetic = args.format == "synthetic" or (args.data is None and args.format is None)
    if args.data is None and not synthetic:
        raise RapidspecError(f"--data is required for --format {args.format}")
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    if synthetic:
        unknown = [t for t in tasks if t not in TASKS]
        if unknown or not tasks:
            raise RapidspecError(f"unknown synthetic task(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(TASKS)}")
        lengths = _int_list(args.lengths, "lengths")
    spec = engine_spec(args)  # every model, drafter and retrieval option, for the engine of each worker
    if args.data is not None and not synthetic:  # read the data before the (slow) model load
        items = load_items(args.data, args.format, include_adversarial=args.include_adversarial)

    workers = _ray_workers(args, spec)
    target, drafter = load_models(args) if workers is None else (None, None)
    max_context = target.max_context if workers is None else workers.ask_one("max_context")
    judge = None
    if args.judge is not None:
        from rapidspec.evaluation.judge import Judge, largest_installed_model
        from rapidspec.models import load_model

        name = largest_installed_model() if args.judge == "auto" else args.judge
        judge = Judge(load_model(name, dtype=args.dtype, device=args.device))
    if synthetic:
        too_long = [n for n in lengths if n > max_context]
        if too_long:
            raise RapidspecError(f"--lengths {too_long} exceed the model's {max_context}-token window")
        options = dict(lengths=lengths, tasks=tasks, per_task=args.per_task, seed=args.seed)
        items = (load_items(None, "synthetic", synthetic_options=options | {"tokenizer": target.tokenizer})
                 if workers is None else workers.ask_one("synthetic_items", options))
        label = f"synthetic lengths={','.join(map(str, lengths))} tasks={','.join(tasks)} seed={args.seed}"
    else:
        label = str(args.data)
    every_item = items
    if args.limit is not None:
        items = items[: args.limit]

    result = run_eval(
        items, target, drafter=drafter, spec=spec, modes=modes, eta=args.eta, gamma=args.gamma,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
        results=args.results, overwrite=args.overwrite, data_label=label, decode_options=passed,
        sweep=sweep, retrieve_from=args.retrieve_from, other_items=every_item, prefill_progress=prefill_bar(args.quiet),
        judge=judge, workers=workers, logprobs=args.logprobs,
    )
    who = breakdown(result.records)
    if not args.json_only:
        console = Console(width=160)
        console.print(summary_table(result.summary, title=f"{args.target} on {label}"))
        if who:
            console.print(breakdown_table(who))
    print(json.dumps({
        "model": args.target, "data": label, "judge": judge.name if judge is not None else None, "items": len(items), "modes": list(modes),
        "new_records": result.new_records, "resumed_records": result.skipped, "results": args.results,
        "summary": [row.to_dict() for row in result.summary], "breakdown": [row.to_dict() for row in who],
    }))
    return 0


def _ray_workers(args: argparse.Namespace, spec):
    """The Ray actors --ray asks for (connected, models loading), or None for a local run."""
    if args.ray is None:
        if args.workers is not None or args.worker_resources is not None:
            raise RapidspecError("--workers and --worker-resources apply with --ray")
        return None
    from rapidspec.scale.eval_workers import RayWorkers

    resources = json_object(args.worker_resources, "--worker-resources", '{"num_cpus": 1}')
    address = None if args.ray == "local" else args.ray
    return RayWorkers(spec, 2 if args.workers is None else args.workers, address, resources).connect()


def breakdown_table(rows) -> Table:
    """Who got it right (lc / rag split) and how each other run did in each group."""
    table = Table(title=f"right answers (score >= {RIGHT_AT}) by who else got them right: run right / items")
    table.caption = "gaps: mean score differences on the same items, paired bootstrap 95% intervals"
    for name in ("task", "mode", "η", "sweep", "n", *GROUPS.values(), "only here", "lost vs lc",
                 "- max(lc, rag)", "- lc"):
        table.add_column(name, justify="left" if name in ("task", "mode", "sweep") else "right")
    for row in rows:
        cells = [f"{row.right[g]}/{row.items[g]}" for g in GROUPS.values()]
        table.add_row(row.group, row.mode, f"{row.eta:g}", row.sweep or "-", str(row.n), *cells, str(row.only_here),
                      str(row.lost), gap_text(row.vs_best), gap_text(row.vs_lc))
    return table


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_table(rows, title: str | None = None) -> Table:
    judges = sorted({row.extra["judge"] for row in rows if "judge" in row.extra})
    caption = (f"judge ratings 1-10 by {', '.join(judges)}, a local model: not comparable with GPT-4 scores"
               if judges else None)
    table = Table(title=title, caption=caption)
    for name in ("task", "mode", "η", "γ", "sweep", "n", "metric", "mean [95% CI]", "EM", "no answer",
                 *(("judge 1-10", "unrated") if judges else ()), "decode tok/s", "accept", "mean acc. len", "prefill s"):
        table.add_column(name, justify="left" if name in ("task", "mode", "sweep", "metric") else "right")
    for row in rows:
        judged = (_fmt(row.extra.get("judge_rating"), ".2f"), _fmt(row.extra.get("judge_unrated"), "d")) if judges else ()
        table.add_row(
            row.group, row.mode, f"{row.eta:g}", _fmt(row.gamma, "d"), row.sweep or "-", str(row.n), row.metric,
            f"{row.mean:.3f} [{row.ci_low:.3f}, {row.ci_high:.3f}]",
            _fmt(row.extra.get("em"), ".3f"),
            _fmt(row.extra.get("unanswered"), "d"),
            *judged,
            _fmt(row.speed.get("decode_tokens_per_second"), ".2f"),
            _fmt(row.speed.get("acceptance_rate"), ".1%"),
            _fmt(row.speed.get("mean_accepted_length"), ".2f"),
            _fmt(row.speed.get("target_prefill_seconds"), ".2f"),
        )
    return table
