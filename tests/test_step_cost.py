"""benchmarks/step_cost.py: byte counts of a step and a run on the tiny model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from rapidspec.models import load_model, low_bit_copy
from rapidspec.runtime.packed import PackedLinear

_SPEC = importlib.util.spec_from_file_location("step_cost", Path(__file__).parents[1] / "benchmarks" / "step_cost.py")
step_cost = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(step_cost)


def test_bytes_of_a_step(tiny_model, tiny_model_dir):
    model = tiny_model.model  # 2 layers, hidden 32, MLP 64, 4 heads of 8 (2 key/value heads), 257 tokens, untied head
    linear = 2 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64) + 32 * 257
    norms = (2 * 2 + 1) * 32
    assert step_cost.weight_bytes(model) == 4 * (linear + norms)
    assert step_cost.cache_bytes(model, 100) == 2 * 2 * 2 * 8 * 100 * 4
    int8 = low_bit_copy(tiny_model, "int8").model
    scales_and_norms = 2 * (2 * (32 + 16 + 16 + 32 + 64 + 64 + 32) + 257) + 4 * norms  # bfloat16 scales
    assert step_cost.weight_bytes(int8) == linear + scales_and_norms
    packed = load_model(str(tiny_model_dir), dtype="float32")  # the lean runtime's prepacked layers
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
    assert step_cost.weight_bytes(packed.model) == 4 * (linear + norms)


def test_arithmetic_of_a_forward(tiny_model, tiny_model_dir):
    """2 x tokens x linear weights + 4 x tokens x heads x head_dim x context x layers, packed or not."""
    linear = 2 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64) + 32 * 257
    expected = 2 * 7 * linear + 4 * 7 * 4 * 8 * 100 * 2
    assert step_cost.forward_flops(tiny_model.model, 7, 100) == expected
    assert step_cost.forward_flops(load_model(str(tiny_model_dir), dtype="float32").model, 7, 100) == expected


def test_a_run_prints_a_table_and_a_json_line(tiny_model_dir, capsys):
    code = step_cost.main([
        "--target", str(tiny_model_dir), "--dtype", "float32", "--lengths", "64,128", "--drafter-tokens", "32",
        "--steps", "2", "--bandwidth-megabytes", "8", "--device", "cpu", "--profile",
    ])
    assert code == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["device"] == "cpu"
    for runtime in ("lean", "transformers"):  # --profile: one plain step and one verification per runtime, by operator
        assert f"{runtime}, one plain step after 127 tokens: host time by operator" in captured.err
        assert f"{runtime}, one verification of 7 tokens after 127 tokens: host time by operator" in captured.err
    assert "device time by operator" not in captured.err  # a CPU has no device time
    rows = result["rows"]
    assert [(r["runtime"], r["length"]) for r in rows] == [("lean", 64), ("transformers", 64), ("lean", 128), ("transformers", 128)]
    assert all(r["plain_ms"] > 0 and r["verify_ms"] > 0 and r["plain_roofline_ms"] > 0 for r in rows)
    assert rows[2]["plain_roofline_ms"] > rows[0]["plain_roofline_ms"]  # more cache to read
    assert result["read_bandwidth_gb_s"] > 0 and result["matmul_gflop_s"] > 0
    assert all(r["verify_floor_ms"] >= r["plain_roofline_ms"] for r in rows)  # never below a plain step's bytes


def test_bad_options_are_one_line_errors(tiny_model_dir, capsys):
    assert step_cost.main(["--target", str(tiny_model_dir), "--lengths", "4"]) == 2
    assert step_cost.main(["--target", str(tiny_model_dir), "--runtimes", "fast"]) == 2
    assert "error" in capsys.readouterr().err
