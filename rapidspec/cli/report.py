"""``rapidspec report``: a Markdown reproduction report from ``rapidspec eval`` results files."""

from __future__ import annotations

import argparse

from rapidspec.evaluation.report import write_report
from rapidspec.prompting.textio import read_text


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "report",
        help="write a Markdown reproduction report (tables, paper numbers, plots) from eval results files",
        description=(
            "Reads one or more --results files of rapidspec eval and writes Markdown: every run's score with its 95% "
            "interval and n, decode speedup against lc, rapid against max(lc, rag), the eta and retrieval-length "
            "sweeps beside the paper's Table 3 and Figure 3, the Figure 2 breakdown, and PNG figures beside the file."
        ),
    )
    parser.add_argument("results", nargs="+", metavar="RESULTS.jsonl", help="results files of rapidspec eval")
    parser.add_argument("--out", required=True, metavar="FILE.md", help="the report to write (figures go beside it)")
    parser.add_argument("--title", default="rapidspec reproduction report", help="the report's heading")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--per-group", action="store_true", help="also one set of tables per task group (default: overall)")
    parser.add_argument("--preamble", default=None, metavar="FILE.md",
                        help="a Markdown file placed under the heading (the commands, the machine)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    preamble = read_text(args.preamble) if args.preamble else ""
    path = write_report(args.results, args.out, title=args.title, plots=not args.no_plots, per_group=args.per_group,
                        preamble=preamble)
    print(path)
    return 0
