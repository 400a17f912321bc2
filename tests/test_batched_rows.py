"""benchmarks/batched_rows.py: a run on the tiny model prints a table and a JSON line; bad options are one line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location("batched_rows", Path(__file__).parents[1] / "benchmarks" / "batched_rows.py")
batched_rows = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(batched_rows)


def test_a_run_times_batched_and_one_by_one_rows(tiny_model_dir, capsys):
    code = batched_rows.main(["--target", str(tiny_model_dir), "--dtype", "float32", "--context", "64",
                              "--rows", "1,3", "--tokens", "1,2", "--repeats", "2"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["tokens"], r["rows"]) for r in result["results"]] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(r["batched_ms"] > 0 and r["one_by_one_ms"] > 0 for r in result["results"])


def test_bad_options_are_one_line_errors(tiny_model_dir, capsys):
    assert batched_rows.main(["--target", str(tiny_model_dir), "--context", "0"]) == 2
    assert "error" in capsys.readouterr().err
