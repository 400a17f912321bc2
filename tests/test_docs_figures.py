"""Figures are copied from kept outputs: every measured figure in a paragraph or table row of the README and of
every docs page (decimals such as tokens/s and accuracies, durations such as ``393 s``, ``218 ms`` or
``4 min 7 s``, test counts) must be found in one of the outputs that paragraph or row links, or, for a table row,
that the paragraph before its table links (files beside the pages that are not pages themselves). Durations may
be rounded from the output's (``0.987`` -> ``0.99 s``, ``0:04:07`` or ``247.22s`` -> ``4 min 7 s``), decimals
too (``1.03125`` -> ``1.03``). Ratios (``1.92x``), model sizes (``0.5B``), bracketed intervals, code spans (commands and
settings) and tables of settings (a ``default`` column) are not measurements and are not checked.
docs/reproduction.md is written by ``rapidspec report`` from docs/results/, and a test writes it again."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The pages whose figures are checked: all of them (docs/reproduction.md is checked by writing it again).
CHECKED_PAGES = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md") if p.name != "reproduction.md"))
DURATION = re.compile(r"(?<![\w.,])(?:(\d+) min(?: (\d+) s)?|(\d+(?:\.\d+)?) (ms|s))(?!\w)")
FIGURE = re.compile(r"(?<![\w.+\-\[])(\d+\.\d+)(?![\dxB.]| m?s\b)")
COUNT = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+) tests")
LINK = re.compile(r"\]\(([^)#\s]+)")
CODE = re.compile(r"`[^`]*`")
NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)")
CLOCK = re.compile(r"(?<![\d:])(?:(\d+):)?(\d{1,2}):(\d\d)(?![\d:])")  # 0:04:07, 15:55
MINUTES = re.compile(r"(\d+)m(\d+(?:\.\d+)?)s|(\d+) min (\d+) s")  # `time`'s 19m19.980s, a set-up's 2 min 15 s


def blocks(text: str) -> list[tuple[str, str]]:
    """(paragraph or table row, the paragraph before the row's table) of a page, outside code blocks and tables of
    settings; code spans are left out of both."""
    out, current, fenced, caption, table = [], [], False, "", None
    for line in [*text.splitlines(), ""]:
        if line.startswith("```"):
            fenced = not fenced
        if fenced or line.startswith(("```", "#", "|")) or not line.strip():
            if current:
                caption = CODE.sub("", " ".join(current))
                out.append((caption, ""))
                current = []
            if line.startswith("#"):
                caption = ""
            if line.startswith("|") and not fenced:
                table = line if table is None else table  # its header row
                if "default" not in table.lower():
                    out.append((CODE.sub("", line), caption))
            else:
                table = None
            continue
        current.append(line)
    return [(block, context) for block, context in out if block.strip()]


def seconds_in(text: str) -> tuple[set[float], set[float]]:
    """(every duration in ``text`` in seconds, every number that may be milliseconds)."""
    numbers = {float(n) for n in NUMBER.findall(text)}
    seconds = set(numbers)
    for hours, minutes, secs in CLOCK.findall(text):
        seconds.add(int(hours or 0) * 3600 + int(minutes) * 60 + int(secs))
    for m, s, mins, secs in MINUTES.findall(text):
        seconds.add(int(m) * 60 + float(s) if m else int(mins) * 60 + int(secs))
    return seconds, numbers | {n * 1000 for n in numbers}


def found(duration: tuple[str, str, str, str], seconds: set[float], millis: set[float]) -> bool:
    minutes, secs, value, unit = duration
    if minutes:
        want = int(minutes) * 60 + int(secs or 0)
        return any(round(s) == want or int(s) == want for s in seconds) if secs else \
            any(int(s) // 60 == int(minutes) for s in seconds)
    digits = len(value.partition(".")[2])
    return any(round(n, digits) == float(value) for n in (millis if unit == "ms" else seconds))


def rounded_from(figure: str, numbers: set[str]) -> bool:
    """``figure`` is one of ``numbers`` rounded to its decimals (``1.03`` from ``1.03125``)."""
    digits = len(figure.partition(".")[2])
    return any(len(n.partition(".")[2]) > digits and round(float(n), digits) == float(figure) for n in numbers)


def outputs_of(page: Path, text: str) -> list[Path]:
    """The kept outputs ``text`` links: files beside ``page`` (or below), not pages, not web addresses."""
    found = []
    for link in LINK.findall(text):
        path = (page.parent / link).resolve()
        if not link.startswith(("http:", "https:")) and not link.endswith(".md") and path.is_file():
            found.append(path)
    return found


def missing_figures(block: str, page: Path = ROOT / "README.md", context: str = "") -> tuple[list[str], list[str]]:
    """(the block's linked outputs, its figures found in none of them)."""
    outputs = outputs_of(page, block + " " + context)
    text = "\n".join(path.read_text(encoding="utf-8", errors="replace") for path in outputs)
    seconds, millis = seconds_in(text)
    numbers = {n for n in NUMBER.findall(text) if "." in n}
    missing = [f for f in FIGURE.findall(block) if f not in text and not rounded_from(f, numbers)]
    missing += [m.group(0) for m in DURATION.finditer(block) if not found(m.groups(), seconds, millis)]
    missing += [f"{c} tests" for c in COUNT.findall(block) if c not in text and c.replace(",", "") not in text]
    return [str(p.relative_to(ROOT)) for p in outputs], missing


def page_problems(page: Path) -> dict[str, object]:
    """Each paragraph or row of ``page`` with figures that links no output, or whose figures its outputs lack."""
    problems = {}
    for block, context in blocks(page.read_text(encoding="utf-8")):
        if FIGURE.search(block) or DURATION.search(block) or COUNT.search(block):
            outputs, missing = missing_figures(block, page, context)
            if not outputs or missing:
                problems[block[:70]] = missing or "no output linked"
    return problems


def test_every_figure_of_the_checked_pages_is_in_an_output_its_paragraph_links():
    readme = blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len([b for b, _ in readme if FIGURE.search(b) or DURATION.search(b) or COUNT.search(b)]) >= 10
    problems = {page: page_problems(ROOT / page) for page in CHECKED_PAGES}
    assert {page: found for page, found in problems.items() if found} == {}


def test_a_figure_its_outputs_do_not_hold_is_found():
    row = ("| what | decode 20.50 tokens/s, rapid 99.99 (1.92x), accuracy 0.536 [+0.008, +0.067], a 0.5B model | "
           "2026-11-28 | [output](docs/bench_lookup_8k_2026-11-28.txt) |")
    outputs, missing = missing_figures(row)
    assert outputs == ["docs/bench_lookup_8k_2026-11-28.txt"] and "99.99" in missing and "20.50" not in missing
    assert not {"1.92", "0.008", "0.5"} & set(missing)  # ratios, bracketed intervals and model sizes


def test_durations_and_counts_are_read_as_the_outputs_write_them(tmp_path):
    output = ROOT / "docs" / "test_suite_clean_clone_2026-11-29f.txt"  # "1753 passed ... in 955.97s (0:15:55)"
    link = f"[output]({output.relative_to(ROOT)})"
    assert missing_figures(f"pytest 15 min 55 s for 1,753 tests, {link}") == ([str(output.relative_to(ROOT))], [])
    _, missing = missing_figures(f"pytest 15 min 54 s for 1,754 tests and 956.5 s, {link}")
    assert missing == ["15 min 54 s", "956.5 s", "1,754 tests"]
    assert missing_figures("the demo took 12.5 s")[1] == ["12.5 s"]  # no output linked: nothing holds it
    once = "[output](docs/document_once_32k_2026-11-29.txt)"  # "load_average_at_start": [1.03125, 2.0029296875, ...]
    assert missing_figures(f"load averages 1.03, 2.00 at the start, {once}")[1] == []
    assert missing_figures(f"load averages 1.04, 2.01 at the start, {once}")[1] == ["1.04", "2.01"]


def test_the_reproduction_page_is_what_its_command_writes_from_the_results_files(tmp_path):
    """docs/reproduction.md's tables come from docs/results/ by the command it ends its preamble with; written
    again (without its figures), the page is the same."""
    from rapidspec.evaluation.report import write_report

    preamble = (ROOT / "docs" / "results" / "preamble.md").read_text(encoding="utf-8")
    command = next(line for line in preamble.splitlines() if line.startswith("rapidspec report "))
    prefixes = re.search(r"docs/results/\{([\w,]+)\}\*\.jsonl", command).group(1).split(",")
    files = sorted(p for p in (ROOT / "docs" / "results").glob("*.jsonl") if p.name.startswith(tuple(prefixes)))
    written = write_report([str(p.relative_to(ROOT)) for p in files], tmp_path / "reproduction.md", plots=False,
                           preamble=preamble)
    page = (ROOT / "docs" / "reproduction.md").read_text(encoding="utf-8")
    without_figures = re.sub(r"## [^\n]*, all greedy files: [^\n]*\n\n[^\n]*\n\n", "", page)  # sections of figures
    without_figures = re.sub(r"!\[\]\([^)]+\)\n\n?", "", without_figures)
    assert written.read_text(encoding="utf-8") == without_figures
