"""benchmarks/precision_agreement.py and benchmarks/low_bit_kernels.py on tiny inputs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from rapidspec.runtime import dynamic_int8


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agreement_counts_identical_answers_and_right_ones(tiny_model_dir, tmp_path, capsys):
    agreement = _module("precision_agreement")
    (tmp_path / "NOTE").write_text("\n\n".join(f"Line {i}: the door code is 4711." for i in range(20)))
    questions = {"questions": [{"document": "NOTE", "question": "What is the door code?", "expected": ["4711"]},
                               {"document": "NOTE", "question": "Which line is first?", "expected": ["zzz-never"]}]}
    (tmp_path / "q.json").write_text(json.dumps(questions))
    code = agreement.main(["--target", str(tiny_model_dir), "--dtype", "float32", "--quantize", "none,none,int8",
                           "--questions", str(tmp_path / "q.json"), "--documents", str(tmp_path), "--max-new-tokens", "8"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    reference, again, int8 = result["rows"]
    assert reference["identical"] == again["identical"] == 2 and again["first_differences"] == []  # greedy: the same
    assert int8["label"].endswith("int8") and int8["questions"] == 2
    assert all(row["scored"] == 2 and 0 <= row["right_interval"][0] <= row["right_interval"][1] <= 1 for row in result["rows"])


def test_agreement_refuses_one_setting(tiny_model_dir, capsys):
    assert _module("precision_agreement").main(["--target", str(tiny_model_dir), "--quantize", "none"]) == 2
    assert "two or more" in capsys.readouterr().err


def test_wilson_interval():
    wilson = _module("precision_agreement").wilson
    low, high = wilson(5, 10)
    assert 0.23 < low < 0.24 and 0.76 < high < 0.77  # the textbook 95% interval of 5/10
    assert wilson(0, 0) == (0.0, 1.0)


def test_first_difference():
    first = _module("precision_agreement").first_difference
    assert first([1, 2, 3], [1, 2, 3]) is None and first([1, 2, 3], [1, 5, 3]) == 1 and first([1, 2], [1, 2, 3]) == 2


def test_kernels_are_timed_per_input_dtype(capsys):
    kernels = _module("low_bit_kernels")
    assert kernels.main(["--shapes", "64x64", "--rows", "1,2", "--min-run-time", "0.02"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["out"], r["rows"]) for r in result["records"]] == [(64, 1), (64, 2)]
    dynamic = {"int8 x int8 per token"} if dynamic_int8.AVAILABLE else set()
    assert set(result["records"][0]["ms"]) == {f"{kind} {dtype}" for kind in ("float", "int8", "int4")
                                               for dtype in ("float32", "bfloat16")} | dynamic
    assert kernels.main(["--shapes", "64x40"]) == 2
    assert kernels.main(["--shapes", "64x64", "--min-run-time", "0"]) == 2
