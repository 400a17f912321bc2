"""The README's headline results are copied from kept outputs: every figure with a decimal point in a row's result
(tokens/s, seconds, accuracies) must appear, as written, in one of the outputs that row links (files under docs/
that are not pages). Ratios (``1.92x``) and counts are derived or settings and are not checked."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURE = re.compile(r"(?<![\w.+\-\[])(\d+\.\d+)(?![\dx.])")
LINK = re.compile(r"\]\((docs/[^)#\s]+)")


def headline_rows(readme: str) -> list[list[str]]:
    """The cells of the "Headline results" table's rows (what, result, date, page and outputs)."""
    section = readme.split("## Headline results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows if not set(row) <= set("|- ")]


def missing_figures(row: list[str]) -> tuple[list[str], list[str]]:
    """(the row's linked outputs, the figures of its result found in none of them)."""
    outputs = [link for link in LINK.findall(" ".join(row)) if not link.endswith(".md")]
    text = "\n".join((ROOT / link).read_text(encoding="utf-8", errors="replace") for link in outputs)
    return outputs, [figure for figure in FIGURE.findall(row[1]) if figure not in text]


def test_every_headline_figure_is_in_an_output_its_row_links():
    rows = headline_rows((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(rows) >= 8
    problems = {}
    for row in rows:
        outputs, missing = missing_figures(row)
        if not outputs or missing:
            problems[row[0][:60]] = missing or "no output linked"
    assert problems == {}


def test_a_figure_its_outputs_do_not_hold_is_found(tmp_path):
    row = ["what", "decode 20.50 tokens/s, rapid 99.99 (1.92x), accuracy 0.536 [+0.008, +0.067]", "2026-11-28",
           "[output](docs/bench_lookup_8k_2026-11-28.txt)"]
    outputs, missing = missing_figures(row)
    assert outputs == ["docs/bench_lookup_8k_2026-11-28.txt"] and "99.99" in missing and "20.50" not in missing
    assert "1.92" not in missing and "0.008" not in missing  # ratios and bracketed intervals are not figures here
