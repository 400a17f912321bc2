"""How often answers loop, with and without penalties: read ``rapidspec eval`` results files, one per setting.

An answer loops when a run of 1 to 8 words repeats back to back at least 4 times ("command-line command-line
command-line command-line"), or when a 6-word sequence occurs 3 times or more (a paragraph said again and
again). For each results file the script prints the setting (its penalties), the answers, how many loop, how
many ran to the token limit, and the mean score, as a table and one JSON line::

    for p in 1.0 1.1 1.2; do
      rapidspec eval --data locomo_dev.json --format locomo-chat --modes rapid --limit 40 \\
        --max-new-tokens 128 --repetition-penalty $p --results loops_rep$p.jsonl
    done
    python benchmarks/loops.py loops_rep*.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")
DEFAULTS = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


def loops(text: str, max_run: int = 8, run_repeats: int = 4, ngram: int = 6, ngram_repeats: int = 3) -> bool:
    """Whether ``text`` loops (see the module docstring)."""
    words = re.findall(r"\S+", text.lower())
    for size in range(1, max_run + 1):
        for start in range(len(words) - size * run_repeats + 1):
            unit = words[start : start + size]
            if all(words[start + k * size : start + (k + 1) * size] == unit for k in range(1, run_repeats)):
                return True
    grams = Counter(tuple(words[i : i + ngram]) for i in range(len(words) - ngram + 1))
    return any(count >= ngram_repeats for count in grams.values())


def summarise(path: Path) -> dict:
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    records = [r for r in records if r["mode"] != "drafter"]
    if not records:
        raise SystemExit(f"{path}: no records")
    decode = records[0]["config"]["decode"]
    setting = {name: decode.get(name, DEFAULTS[name]) for name in PENALTIES}
    looped = sum(loops(r["prediction"]) for r in records)
    at_limit = sum(r["stats"].get("stop_reason") == "length" for r in records)
    return {"file": path.name, "model": records[0]["config"]["model"], "modes": sorted({r["mode"] for r in records}),
            **setting, "answers": len(records), "loops": looped, "loop_rate": looped / len(records),
            "at_token_limit": at_limit, "mean_score": sum(r["score"] for r in records) / len(records)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="rapidspec eval results files (JSONL), one per setting")
    args = parser.parse_args(argv)
    rows = [summarise(path) for path in args.results]
    print(f"{'file':<32} {'rep':>5} {'freq':>5} {'pres':>5} {'answers':>7} {'loop':>10} {'at limit':>8} {'score':>6}")
    for r in rows:
        print(f"{r['file']:<32} {r['repetition_penalty']:>5g} {r['frequency_penalty']:>5g} {r['presence_penalty']:>5g} "
              f"{r['answers']:>7} {r['loops']:>4} ({r['loop_rate']:>3.0%}) {r['at_token_limit']:>8} {r['mean_score']:>6.3f}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
