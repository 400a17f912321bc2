"""benchmarks/prefill_floor.py: its arithmetic, and a run on the tiny model saved as a folder."""

from __future__ import annotations

import json
import sys

import torch

from benchmarks import prefill_floor


def test_the_floor_counts_the_linear_layers_and_causal_attention(tiny_model):
    config = tiny_model.model.config  # hidden 32, intermediate 64, 2 layers, 4 heads of 8, 2 key/value heads
    per_layer = 32 * 4 * 8 * 2 + 32 * 2 * 8 * 2 + 3 * 32 * 64
    assert prefill_floor.linear_weights(config) == 2 * per_layer
    params = sum(p.numel() for name, p in tiny_model.model.named_parameters()
                 if "layers" in name and p.dim() == 2)  # the decoder's weight matrices
    assert prefill_floor.linear_weights(config) == params
    tokens, rate = 100, 1e9
    attention = 4 * 2 * 4 * 8 * tokens * (tokens + 1) / 2
    assert prefill_floor.floor_seconds(config, tokens, rate) == (2 * params * tokens + attention) / rate


def test_a_run_reports_rate_and_fraction(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["prefill_floor", "--target", str(tiny_model_dir), "--lengths", "300",
                                      "--chunks", "64,128", "--quantize", "none"])
    assert prefill_floor.main() == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    header, rows = lines[0], lines[1:]
    assert "cpu" in header and len(rows) == 2 and {r["chunk"] for r in rows} == {64, 128}
    for row in rows:
        assert row["tokens_per_second"] > 0 and 0 < row["fraction_of_floor"] and row["matmul_gflops"] > 0
        assert row["quantization"] == "none" and row["tokens"] >= 250
    assert prefill_floor.matmul_rate(8, 16, 16, torch.float32, repeats=1) > 0
