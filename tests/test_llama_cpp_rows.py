"""benchmarks/llama_cpp_rows.py: a run on a tiny GGUF prints a table and a JSON line; bad options are one line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rapidspec.runtime.llama_cpp import llama_cpp_available
from tests.tiny_gguf import write_tiny_gguf

if not llama_cpp_available():
    pytest.skip("llama-cpp-python is not installed", allow_module_level=True)

_SPEC = importlib.util.spec_from_file_location("llama_cpp_rows", Path(__file__).parents[1] / "benchmarks" / "llama_cpp_rows.py")
llama_cpp_rows = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(llama_cpp_rows)


def test_a_run_times_own_contexts_one_batch_and_one_sequence(tiny_model, tmp_path, capsys):
    gguf = write_tiny_gguf(tiny_model, tmp_path / "tiny.gguf")
    code = llama_cpp_rows.main(["--target", str(gguf), "--context", "40", "--rows", "1,3", "--threads", "1",
                                "--repeats", "2"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["threads"], r["rows"]) for r in result["results"]] == [(1, 1), (1, 3)]
    assert all(r[k] > 0 for r in result["results"] for k in ("own_contexts_ms", "one_batch_ms", "one_sequence_ms"))


def test_bad_options_are_one_line_errors(tmp_path, capsys):
    assert llama_cpp_rows.main(["--target", str(tmp_path / "missing.gguf")]) == 2
    assert "no GGUF file" in capsys.readouterr().err
    assert llama_cpp_rows.main(["--target", str(tmp_path / "missing.gguf"), "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err
