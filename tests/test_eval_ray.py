"""`rapidspec eval --ray`: items answered by Ray actors write the records a local run writes, and resume across both.

Ray runs a local instance bounded to this machine (127.0.0.1: conftest's ``local_ray``, on the one worker that
runs every Ray test); the actors load the tiny model from its directory as a user's would.
"""

from __future__ import annotations

import json

from rapidspec.cli import main
from rapidspec.evaluation.runner import key_of

SMALL_RETRIEVAL = ["--retrieval", "bm25", "--chunk-tokens", "64", "--budget-tokens", "128"]


def _records(path) -> dict:
    """Key -> what a record says about the answer (its timings aside)."""
    out = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        stats = record.pop("stats")
        out[key_of(record)] = record | {"new_tokens": stats["new_tokens"], "accepted": stats["accepted_tokens"]}
    return out


def test_eval_on_ray_writes_a_local_runs_records_and_resumes_across_both(local_ray, tiny_model_dir, tmp_path, capsys):
    common = ["eval", "--target", str(tiny_model_dir), "--format", "synthetic", "--lengths", "512", "--per-task", "2",
              "--modes", "lc,rapid", "--max-new-tokens", "4", "--json-only", *SMALL_RETRIEVAL]
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert main([*common, "--results", str(local)]) == 0
    assert main([*common, "--results", str(on_ray), "--ray", "--workers", "2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["new_records"] == 12 and len(_records(on_ray)) == 12
    assert _records(on_ray) == _records(local)

    # a local run stopped after 5 records, finished on Ray: the same records, none twice
    lines = local.read_text().splitlines(keepends=True)
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_text("".join(lines[:5]))
    assert main([*common, "--results", str(resumed), "--ray", "--workers", "2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["new_records"], summary["resumed_records"]) == (7, 5)
    assert len(resumed.read_text().splitlines()) == 12 and _records(resumed) == _records(local)


def test_ray_options_are_checked(tmp_path, capsys):
    assert main(["eval", "--workers", "3", "--format", "synthetic"]) == 2
    assert "--workers and --worker-resources apply with --ray" in capsys.readouterr().err
    assert main(["eval", "--ray", "--worker-resources", "[1]", "--format", "synthetic"]) == 2
    assert "--worker-resources must be a JSON object" in capsys.readouterr().err
