"""A reproduction report in Markdown from ``rapidspec eval`` results files (``rapidspec report``).

For each results file: the scores of every run with 95% bootstrap intervals
and n, each run against ``lc`` (score difference, decode speedup as the median
over items of the run's decode tokens/s over lc's on the same item), rapid
against the better reference max(lc, rag), the η sweep beside the paper's
Table 3, the retrieval-length sweep (Figure 3), and who got which item right
(Figure 2). The paper's numbers are for
LLaMA-3.1-8B on LongBench v2 and InfiniteBench; ours are small models on other
data, so the *direction* of each effect compares, not the values.
"""

from __future__ import annotations

import json

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from rapidspec.errors import RapidspecError
from rapidspec.evaluation.breakdown import GROUPS, RIGHT_AT, breakdown, gap_text, speedups
from rapidspec.evaluation.report_plots import plot_file
from rapidspec.evaluation.runner import SummaryRow, read_records, summarize
from rapidspec.evaluation.run_config import drafter_name

#: Table 1, LLaMA-3.1-8B target, self-speculation: LongBench v2 overall accuracy (%) and decode speedup.
PAPER_TABLE1 = {
    "lc": (28.0, 1.00), "rag": (29.2, 3.35), "ragsd": (29.4, 1.63), "magicdec": (29.2, 0.71), "rapid": (32.4, 2.10),
}
#: Table 3, unrelated retrieval, 8B drafter: eta -> (accuracy change vs the target, points; decode speedup).
PAPER_TABLE3 = {0: (1.20, 1.62), 5: (2.80, 1.75), 10: (1.60, 1.77), 20: (1.20, 1.78), 30: (-2.40, 2.07),
                40: (-2.60, 2.08), 50: (-6.30, 2.10)}


def load_records(path: str | Path) -> list[dict]:
    """The records of one results file (a line cut off mid-write is ignored; the file is not changed)."""
    path = Path(path)
    if not path.is_file():
        raise RapidspecError(f"no such results file: {path}")
    records, _ = read_records(path)
    if not records:
        raise RapidspecError(f"{path} holds no records")
    for number, record in enumerate(records, 1):
        missing = [k for k in RECORD_KEYS if not isinstance(record, dict) or k not in record]
        if missing:
            raise RapidspecError(f"{path} is not a results file of `rapidspec eval`: record {number} has no "
                                 f"{', '.join(missing)}")
    return records


#: What every record of a results file holds (rapidspec.evaluation.item_runner writes them).
RECORD_KEYS = ("id", "mode", "metrics", "stats", "config")


def data_name(data) -> str:
    """A results file's data as a reader elsewhere names it: a path's last folder and file (the machine's own
    folders above them say nothing to another reader), other labels as they are."""
    text = str(data)
    return "/".join(Path(text).parts[-2:]) if "/" in text else text


def _key(row: SummaryRow) -> tuple:
    return (row.group, row.mode, row.eta, row.gamma, row.sweep)


def _label(row) -> str:
    return row.mode + (f" η={row.eta:g}" if row.mode == "rapid" and not (row.sweep or "").startswith("eta=") else "") + (
        f" {row.sweep}" if row.sweep else "")


def _ci(row: SummaryRow) -> str:
    return f"{row.mean:.3f} [{row.ci_low:.3f}, {row.ci_high:.3f}]"


def _overlap(a: SummaryRow, b: SummaryRow) -> bool:
    return a.ci_low <= b.ci_high and b.ci_low <= a.ci_high


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def scores_section(rows: list[SummaryRow], speed: dict[tuple, float]) -> list[str]:
    lc = {row.group: row for row in rows if row.mode == "lc"}
    body = []
    for row in rows:
        base = lc.get(row.group)
        delta = "-" if base is None or row.mode == "lc" else f"{row.mean - base.mean:+.3f}"
        paper = PAPER_TABLE1.get(row.mode)
        body.append([
            row.group, _label(row), str(row.n), row.metric, _ci(row), delta, _fmt(speed.get(_key(row)), ".2f") + "x",
            _fmt(row.speed.get("acceptance_rate"), ".1%"),
            "-" if paper is None else f"{paper[0]:.1f} / {paper[1]:.2f}x",
        ])
    return ["### Scores and speed (the paper's Table 1)", "",
            "Decode speedup: the median over items of the run's decode tokens/s over lc's on the same item "
            "(decode only, as the paper). Paper: LLaMA-3.1-8B, LongBench v2 accuracy (%) / speedup.", "",
            *_table(["task", "run", "n", "metric", "mean [95% CI]", "vs lc", "decode speedup", "acceptance",
                     "paper"], body), ""]


def claim_section(rows: list[SummaryRow]) -> list[str]:
    """Does rapid reach max(lc, rag)? Per task group and rapid run, with the intervals' overlap stated."""
    lines = []
    refs = defaultdict(dict)
    for row in rows:
        if row.mode in ("lc", "rag") and row.sweep is None:
            refs[row.group][row.mode] = row
    for row in rows:
        if row.mode != "rapid" or len(refs[row.group]) < 2:
            continue
        best = max(refs[row.group].values(), key=lambda r: r.mean)
        gap = row.mean - best.mean
        verdict = "reaches" if gap >= 0 else "falls short of"
        overlap = "the intervals overlap" if _overlap(row, best) else "the intervals do not overlap"
        lines.append(f"* {row.group}, {_label(row)}: {_ci(row)} {verdict} the better reference, "
                     f"{best.mode} {_ci(best)}, by {gap:+.3f} (n = {row.n}; {overlap}).")
    if not lines:
        return []
    return ["### The quality claim: rapid against max(lc, rag)", "",
            "The paper reports RAPID at or above both the long-context target and RAG.", "", *lines, ""]


def eta_section(rows: list[SummaryRow], speed: dict[tuple, float]) -> list[str]:
    swept = [row for row in rows if row.mode == "rapid" and (row.sweep or "").startswith("eta=")]
    if not swept:
        return []
    groups = list(dict.fromkeys(row.group for row in rows))
    swept.sort(key=lambda row: (groups.index(row.group), row.eta))  # values added to a sweep later come in order
    lc = {row.group: row for row in rows if row.mode == "lc"}
    body = []
    for row in swept:
        paper = PAPER_TABLE3.get(int(row.eta)) if float(row.eta).is_integer() else None
        delta = "-" if row.group not in lc else f"{row.mean - lc[row.group].mean:+.3f}"
        body.append([row.group, f"{row.eta:g}", str(row.n), _ci(row), delta, _fmt(speed.get(_key(row)), ".2f") + "x",
                     _fmt(row.speed.get("acceptance_rate"), ".1%"),
                     "-" if paper is None else f"{paper[0]:+.1f} pt / {paper[1]:.2f}x"])
    return ["### η (the paper's Table 3)", "",
            "Paper: LLaMA-3.1-8B with unrelated retrieval, change in accuracy vs the target and speedup; "
            "its gains peak at η = 5 and turn negative above 20 for self-speculation.", "",
            *_table(["task", "η", "n", "score [95% CI]", "vs lc", "decode speedup", "acceptance", "paper"], body), ""]


def budget_section(rows: list[SummaryRow], speed: dict[tuple, float]) -> list[str]:
    swept = [row for row in rows if (row.sweep or "").startswith("budget_tokens=")]
    if not swept:
        return []
    body = [[row.group, _label(row), str(row.n), _ci(row), _fmt(speed.get(_key(row)), ".2f") + "x",
             _fmt(row.speed.get("acceptance_rate"), ".1%")] for row in swept]
    return ["### Retrieval length (the paper's Figure 3)", "",
            "Paper: 4K and 8K retrieved tokens gave nearly the same speedup; above 16K the drafter's cost cut it.", "",
            *_table(["task", "run", "n", "score [95% CI]", "decode speedup", "acceptance"], body), ""]


def breakdown_section(records: Sequence[dict]) -> list[str]:
    rows = breakdown(records)
    if not rows:
        return []
    body = [[row.group, _label(row), str(row.n), *(f"{row.right[g]}/{row.items[g]}" for g in GROUPS.values()),
             str(row.only_here), str(row.lost), gap_text(row.vs_best), gap_text(row.vs_lc)] for row in rows]
    return ["### Who got it right (the paper's Figure 2)", "",
            f"Items split by whether lc and rag answered right (score >= {RIGHT_AT}); each cell: the run's right "
            "answers / items in the group. Paper: RAPID adds successes, including ones neither reference had "
            "(\"only here\"), without adding failures (\"lost vs lc\"). The last two columns are the run's mean "
            "score minus max(lc, rag) and minus lc on the same items, with paired bootstrap 95% intervals "
            "(items resampled together across runs): an interval that excludes 0 is a difference these items "
            "establish.", "",
            *_table(["task", "run", "n", *GROUPS.values(), "only here", "lost vs lc", "- max(lc, rag)", "- lc"], body),
            ""]


def retrieval_section(files: Sequence[list[dict]]) -> list[str]:
    """rag (the model on the retrieved text alone) per retrieval method, across files that differ only in the method."""
    cells: dict[tuple, dict[str, SummaryRow]] = defaultdict(dict)
    for records in files:
        config = records[0].get("config") or {}
        retrieval = dict(config.get("retrieval") or {})
        method = retrieval.pop("method", None)
        rag = [r for r in records if r["mode"] == "rag" and r.get("sweep") is None]
        if method and rag:
            settings = [config.get(k) for k in ("model", "data", "temperature", "max_new_tokens", "retrieve_from")]
            # max_new_tokens is a dict of per-task limits in newer files: compare the settings as JSON
            same = (settings[0], settings[1], json.dumps([settings, retrieval], sort_keys=True, default=str),
                    frozenset(r["id"] for r in rag))
            cells[same][method] = summarize(overall(rag))[0]
    compared = {same: rows for same, rows in cells.items() if len(rows) > 1}
    if not compared:
        return []
    methods = sorted({method for rows in compared.values() for method in rows})
    body = [[str(same[0]), data_name(same[1]), str(next(iter(rows.values())).n),
             *(_ci(rows[m]) if m in rows else "-" for m in methods)] for same, rows in compared.items()]
    return ["## Retrieval methods: rag per method", "",
            "rag (the model reads only the retrieved text) on the same items with the same budget, per retrieval "
            "method: the end-task side of the default method's evidence (`benchmarks/retrieval_recall.py` measures "
            "the recall side).", "", *_table(["model", "data", "n", *methods], body), ""]


def overall(records: list[dict]) -> list[dict]:
    """``records`` as one task group ``all`` (the paper reports overall scores); unchanged when there is one group."""
    if len({r["group"] for r in records}) < 2:
        return records
    return [{**r, "group": "all"} for r in records]


def _tables(records: list[dict]) -> list[str]:
    rows = summarize(records)
    if len({r["task_type"] for r in records}) > 1:
        for row in rows:
            row.metric = "mean score"  # accuracy, F1, recall... averaged together
    speed = speedups(records)
    return [*scores_section(rows, speed), *claim_section(rows), *eta_section(rows, speed),
            *budget_section(rows, speed), *breakdown_section(records)]


def file_section(path: str | Path, records: list[dict], figures: list[str], per_group: bool = False) -> list[str]:
    config = records[0].get("config") or {}
    groups = list(dict.fromkeys(r["group"] for r in records))
    longest = max(r["stats"].get("prompt_tokens_target") or 0 for r in records)
    head = [f"## {Path(path).name}", "",
            f"Model {config.get('model')}, drafter {drafter_name(config) or 'the target (self-speculation)'}; "
            f"data {data_name(config.get('data'))}; {len({r['id'] for r in records})} items, {len(records)} runs; "
            f"temperature {config.get('temperature')}, seed {config.get('seed')}; retrieval "
            f"{(config.get('retrieval') or {}).get('method')}; longest target prompt {longest} tokens"
            + (f"; drafter chunks from {config['retrieve_from']}" if config.get("retrieve_from") else "")
            + f"; task groups: {', '.join(groups)}.", ""]
    body = _tables(overall(records))
    if per_group and len(groups) > 1:
        for group in groups:
            body += [f"#### {group}", "", *_tables([r for r in records if r["group"] == group])]
    return [*head, *body, *(f"![]({name})\n" for name in figures)]


def write_report(paths: Sequence[str | Path], out: str | Path, title: str = "rapidspec reproduction report",
                 plots: bool = True, per_group: bool = False, preamble: str = "") -> Path:
    """Write the Markdown report of ``paths`` to ``out`` (figures beside it) and return ``out``."""
    if not paths:
        raise RapidspecError("no results files given")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title}", "", __doc__.split("\n\n")[1].replace("\n", " "), "", *([preamble, ""] if preamble else [])]
    pooled = defaultdict(list)  # "model <- drafter" -> the greedy records of its files
    files = []
    for index, path in enumerate(paths):
        records = load_records(path)
        files.append(records)
        pooled[model_pair(records[0].get("config") or {})] += [
            {**r, "id": f"{index}/{r['id']}"} for r in records if r.get("config", {}).get("temperature") == 0.0]
        figures = []
        if plots:
            figures = [p.name for p in plot_file(records, out.with_name(f"{out.stem}_{index}"))]
        lines += file_section(path, records, figures, per_group)
    if plots and len(paths) > 1:
        for index, (pair, records) in enumerate(pooled.items()):
            pooled_figures = plot_file(records, out.with_name(f"{out.stem}_all_{index}"), figures=("speedup",))
            if pooled_figures:
                lines += [f"## {pair}, all greedy files: decode speedup against context length", "",
                          "Median over items of each run's decode speedup against lc on the same item, per prompt "
                          "length of the synthetic tasks, pooled over the greedy results files of this model and "
                          "drafter.", "", *(f"![]({p.name})\n" for p in pooled_figures)]
    lines += retrieval_section(files)
    out.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    return out


def model_pair(config: dict) -> str:
    """``"target <- drafter"`` as a results file's configuration names them (speed pools only within a pair)."""
    return f"{config.get('model')} ← {drafter_name(config) or 'self'}"


