"""Step costs measured quiet and beside busy processes: what ``step_costs.json`` keeps (rapidspec.drafting.calibration).

    python -m benchmarks.calibration_busy --target builtin --contexts 1024,8192 --rounds 2

Each round measures with ``rapidspec calibrate`` (a process of its own, its own
costs file, ``again``): quiet, then beside one spinning process per CPU, then
quiet again. For every entry it prints the figures of each measurement, the
others' share of the CPUs the measurement saw, whether it was marked busy and
what the file kept afterwards, and checks the rule the module states: a busy
measurement's kept figures are within ``--margin`` of the quiet ones, or it was
marked busy and the next quiet measurement replaced it. The last line is one
JSON object. Run it on an otherwise idle machine (its header names the load).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.document_once import commit_line, cpu_line

SPIN = "import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"


def calibrate(costs: Path, target: str, contexts: str) -> dict[str, dict]:
    """``rapidspec calibrate --json`` into ``costs``: {key: {"kept": entry, "measured": this run's entry}}."""
    env = {**os.environ, "RAPIDSPEC_STEP_COSTS": str(costs)}
    done = subprocess.run([str(Path(sys.executable).parent / "rapidspec"), "calibrate", "--target", target, "--contexts",
                           contexts, "--json", "--quiet"], env=env, capture_output=True, text=True, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    not_kept = {e["key"]: e for e in out["not_kept"]}
    return {e["key"]: {"kept": e, "measured": not_kept.get(e["key"], e)} for e in out["entries"]}


def total(entry: dict) -> float:
    """The entry's seconds of one thing: a verification of 8 tokens, a drafter step, or an embedded token."""
    if "base" in entry:
        return entry["base"] + 8 * entry["per_token"]
    return entry["step"] if "step" in entry else entry["value"]


def verdict(within: bool, replaced: bool, not_kept: bool) -> str:
    if within:
        return "what the file kept stayed within the margin" + (" (the busy measurement was not kept)" if not_kept else "")
    return "replaced by the next quiet measurement" if replaced else "NOT within the margin nor replaced"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="builtin")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--margin", type=float, default=0.15)
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {os.getloadavg()[0]:.2f}; "
          f"{cpu_line()}; {commit_line()}; {' '.join(sys.argv)}")
    costs = Path(tempfile.mkdtemp()) / "step_costs.json"
    results, failures = [], 0
    for round_ in range(args.rounds):
        quiet = calibrate(costs, args.target, args.contexts)
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=900)]) for _ in range(os.cpu_count() or 1)]
        try:
            time.sleep(1.0)
            busy = calibrate(costs, args.target, args.contexts)
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
        after = calibrate(costs, args.target, args.contexts)
        for key in quiet:
            q, b, a = quiet[key]["measured"], busy[key]["measured"], after[key]["kept"]
            within = abs(total(busy[key]["kept"]) / total(q) - 1) <= args.margin
            replaced = b["busy"] and not a["busy"]
            ok = within or replaced
            failures += not ok
            results.append({"round": round_, "key": key, "quiet": total(q), "busy": total(b), "busy_ratio": total(b) / total(q),
                            "others_busy": b["others"], "marked": b["busy"], "kept_after_busy": total(busy[key]["kept"]),
                            "kept_after_quiet": total(a), "ok": ok})
            print(f"round {round_} {key}\n    quiet {total(q):.4g} s (others {q['others']}), beside spinners "
                  f"{total(b):.4g} s = {total(b) / total(q):.2f}x (others {b['others']}, busy {b['busy']}); kept then "
                  f"{total(busy[key]['kept']):.4g}, after the next quiet run {total(a):.4g}: "
                  f"{verdict(within, replaced, busy[key]['kept'] is not busy[key]['measured'])}")
    print(json.dumps({"target": args.target, "contexts": args.contexts, "margin": args.margin, "failures": failures,
                      "results": results}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
