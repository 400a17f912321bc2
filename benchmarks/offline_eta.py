"""Greedy RAPID under any eta, gate or transfer rule, recomputed offline from ``eval --logprobs K`` records.

A record made with ``rapidspec eval --logprobs K`` holds, at each of its
first answer positions, the top-K log-probabilities of the target reading
everything (``lc``: p), of the target on the retrieved text (``rag``) and of
the drafter on it (``drafter``: q; ``rag`` in self-speculation). Greedy rapid
picks argmax(log p + eta * g) with g = (q - p) where q >= alpha * max q
(sampling.greedy_target_choices), so its choice can be recomputed for any
eta, gate or rule without a model:

    python benchmarks/offline_eta.py docs/results/qwen_self_leval.jsonl --eta 0,1,2,3,5,10 \\
        --rules paper,confident,t0.5

Rules: ``paper`` (the engine's), ``confident`` (shift only where the
retrieved view is surer than the target, max q > max p), ``tX`` (g taken at
a reference temperature X, the paper's Eq. 6 at T = X: argmax(z/X + eta*(q_X - p_X)), so the
paper's eta grid at T = 0.1 carries over as t0.1).

For each item the records' answer prefixes form a tree; a rule walks it from
the empty prefix, choosing a token at each position, as long as some record
went that way. The walk's text is scored with the benchmark's scorer; an item
whose walk leaves the recorded tree before its answer can be read counts as
"undetermined". Tokens outside a view's top-K take that view's K-th
log-probability (an upper bound). Check first: with ``paper``, the walk must
reproduce every recorded rapid answer's first tokens (``reproduced`` column).
Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rapidspec.evaluation.metrics import score_prediction
from rapidspec.evaluation.runner import read_records

RIGHT_AT = 0.5


def _dist(rows: list) -> dict[int, float]:
    return {int(i): float(lp) for i, lp in rows}


def choose(views: dict[str, list], eta: float, alpha: float, rule: str = "paper") -> int:
    """The greedy token at one position from its views' top-K rows (see the module docstring)."""
    logp = _dist(views["lc"])
    logq = _dist(views.get("drafter", views["rag"]))
    floor_p, floor_q = min(logp.values()), min(logq.values())
    candidates = sorted(set(logp) | set(logq))
    lp = {i: logp.get(i, floor_p) for i in candidates}
    lq = {i: logq.get(i, floor_q) for i in candidates}
    if rule.startswith("t"):  # p and q at a reference temperature X, renormalised over the candidates
        lp, lq = _at_temperature(lp, float(rule[1:])), _at_temperature(lq, float(rule[1:]))
    p = {i: math.exp(v) for i, v in lp.items()}
    q = {i: math.exp(v) for i, v in lq.items()}
    top_q = max(q.values())
    shift = 0.0 if rule == "confident" and top_q <= max(p.values()) else eta
    # log p is z / X up to a constant, so argmax(z / X + eta * g) is argmax(log p + eta * g) (Eq. 6 at T = X).
    score = {i: lp[i] + (shift * (q[i] - p[i]) if q[i] >= alpha * top_q else 0.0) for i in candidates}
    best = max(score.values())
    return min(i for i in candidates if score[i] == best)  # argmax takes the first (lowest) id on ties


def _at_temperature(logprobs: dict[int, float], temperature: float) -> dict[int, float]:
    scaled = {i: v / temperature for i, v in logprobs.items()}
    top = max(scaled.values())
    norm = top + math.log(sum(math.exp(v - top) for v in scaled.values()))
    return {i: v - norm for i, v in scaled.items()}


def answer_tree(records: list[dict]) -> dict[tuple, dict]:
    """Answer prefix -> the views at the next position, from every record of one item that has them."""
    tree: dict[tuple, dict] = {}
    for record in records:
        lp = record.get("logprobs")
        if not lp:
            continue
        tokens = lp["tokens"]
        for position in range(len(tokens)):
            if any(t is None for t in tokens[:position]):
                break
            prefix = tuple(tokens[:position])
            tree.setdefault(prefix, {name: rows[position] for name, rows in lp["views"].items()})
    return tree


def walk(tree: dict[tuple, dict], eos: set[int], eta: float, alpha: float, rule: str = "paper") -> tuple[tuple, bool]:
    """The tokens a rule picks, following the tree; and whether the answer ended (an EOS was chosen)."""
    prefix: tuple = ()
    while prefix in tree:
        token = choose(tree[prefix], eta, alpha, rule)
        if token in eos:
            return prefix, True
        prefix += (token,)
    return prefix, False


def item_answer(records: list[dict], eta: float, alpha: float, rule: str) -> tuple[str | None, float | None]:
    """(text walked, score) for one item under one rule; score None when undetermined."""
    first = next(r for r in records if r.get("logprobs"))
    lp = first["logprobs"]
    text_of = {int(k): v for r in records if r.get("logprobs") for k, v in r["logprobs"]["text"].items()}
    tokens, ended = walk(answer_tree(records), set(lp["eos"]), eta, alpha, rule)
    text = "".join(text_of.get(t, "") for t in tokens)
    metrics = score_prediction(first["task_type"], text, first["gold"], len(first.get("choices") or ()) or 4)
    if first["task_type"] == "mc" and metrics.get("extracted") is None and not ended:
        return text, None  # left the recorded answers before a letter could be read
    return text, metrics["score"]


def reproduction(records: list[dict]) -> tuple[int, int]:
    """(rapid records whose first tokens the ``paper`` walk reproduces, rapid records with log-probabilities)."""
    by_item = defaultdict(list)
    for r in records:
        by_item[r["id"]].append(r)
    matched = total = 0
    for r in records:
        if r["mode"] != "rapid" or not r.get("logprobs"):
            continue
        total += 1
        alpha = r["config"]["decode"]["draft_gate"]
        tokens, _ = walk(answer_tree(by_item[r["id"]]), set(r["logprobs"]["eos"]), r["eta"], alpha)
        recorded = [t for t in r["logprobs"]["tokens"] if t is not None]
        matched += list(tokens[: len(recorded)]) == recorded
    return matched, total


def evaluate(records: list[dict], etas: list[float], rules: list[str], alpha: float) -> list[dict]:
    """One row per (rule, eta): accuracy over determined items and the lc/rag split kept and taken."""
    by_item = defaultdict(list)
    for r in records:
        by_item[r["id"]].append(r)
    right = {(r["id"], r["mode"]): r["score"] >= RIGHT_AT for r in records if r["mode"] in ("lc", "rag")}
    rows = []
    for rule in rules:
        for eta in etas:
            scores, lc_only, rag_only, both_lost, undetermined = [], [0, 0], [0, 0], 0, 0
            for item_id, item_records in by_item.items():
                if not any(r.get("logprobs") for r in item_records):
                    continue
                _, score = item_answer(item_records, eta, alpha, rule)
                if score is None:
                    undetermined += 1
                    continue
                scores.append(score)
                lc, rag, ok = right.get((item_id, "lc")), right.get((item_id, "rag")), score >= RIGHT_AT
                if lc and not rag:
                    lc_only[0] += ok
                    lc_only[1] += 1
                elif rag and not lc:
                    rag_only[0] += ok
                    rag_only[1] += 1
                elif lc and rag:
                    both_lost += not ok
            rows.append({"rule": rule, "eta": eta, "n": len(scores), "undetermined": undetermined,
                         "mean": sum(scores) / len(scores) if scores else None,
                         "lc_only_kept": lc_only, "rag_only_taken": rag_only, "both_lost": both_lost})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="eval results files made with --logprobs K")
    parser.add_argument("--eta", default="0,1,2,3,5,10", help="comma-separated eta values (default: %(default)s)")
    parser.add_argument("--rules", default="paper", help="comma-separated: paper, confident, tX (default: %(default)s)")
    parser.add_argument("--gate", type=float, default=None, help="draft gate alpha (default: the records' own)")
    args = parser.parse_args(argv)
    records = [r for path in args.results for r in read_records(Path(path))[0]]
    if not any(r.get("logprobs") for r in records):
        print("no record holds log-probabilities: run rapidspec eval with --logprobs K", file=sys.stderr)
        return 2
    alpha = args.gate if args.gate is not None else records[0]["config"]["decode"]["draft_gate"]
    etas = [float(v) for v in args.eta.split(",") if v.strip()]
    rules = [v.strip() for v in args.rules.split(",") if v.strip()]
    matched, total = reproduction(records)
    rows = evaluate(records, etas, rules, alpha)
    table = Table(title=f"offline greedy choices, gate {alpha:g}; paper rule reproduces {matched}/{total} rapid records")
    for name in ("rule", "eta", "n", "undetermined", "mean", "lc only kept", "rag only taken", "both lost"):
        table.add_column(name, justify="left" if name == "rule" else "right")
    for row in rows:
        table.add_row(row["rule"], f"{row['eta']:g}", str(row["n"]), str(row["undetermined"]),
                      "-" if row["mean"] is None else f"{row['mean']:.3f}", "{}/{}".format(*row["lc_only_kept"]),
                      "{}/{}".format(*row["rag_only_taken"]), str(row["both_lost"]))
    Console(width=140).print(table)
    print(json.dumps({"gate": alpha, "reproduced": [matched, total], "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
