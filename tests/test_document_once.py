"""benchmarks/document_once.py on the tiny model saved as a folder: generate processes and two servers on one
key/value folder (five processes: marked slow)."""

from __future__ import annotations

import json

import pytest

from benchmarks import document_once

pytestmark = pytest.mark.slow


def test_later_processes_and_a_restarted_server_read_the_document_from_disk(tiny_model_dir, capsys):
    assert document_once.main(["--target", str(tiny_model_dir), "--dtype", "float32", "--lengths", "1500",
                               "--max-new-tokens", "4", "--mode", "lc", "--timeout", "300"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, row = json.loads(lines[0]), json.loads(lines[1])
    assert "cpu" in header and header["target"] == str(tiny_model_dir)
    first, again, other = row["runs"]
    assert first["disk_tokens"] == 0 and again["disk_tokens"] == again["prompt_tokens"] - 1
    assert 0 < other["disk_tokens"] < other["prompt_tokens"] - 1
    assert row["same_answer"] and row["served_same_answer"]
    restarted = row["served"][1]
    assert restarted["disk_tokens"] == restarted["prompt_tokens"] - 1 and restarted["request_to_first_token_s"] > 0
    assert row["disk_tokens"] > 0 and row["disk_bytes_per_1k_tokens"] > 0
    assert any("from disk" in line for line in lines)
