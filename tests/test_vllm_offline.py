"""vLLM's offline ``LLM`` with RAPID's proposer on the built-in model (slow; vLLM's venv comes from `make vllm`,
which `make test` runs).

The proposer's own logic is tested without vLLM in tests/test_vllm_proposer.py.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from rapidspec.bench.serve.dataset import BUILTIN_QUESTIONS
from rapidspec.vllm.environment import run_in_vllm, vllm_python

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("vllm_offline_script.py")
RAPID = {"method": "custom_class", "model": "rapidspec.vllm.RapidProposer", "num_speculative_tokens": 6}
TIMEOUT_S = 900


@pytest.fixture(scope="module", autouse=True)
def vllm_installed():
    if vllm_python() is None:
        pytest.skip("vLLM's venv is not set up here (`make vllm`; `make test` runs it)")


@pytest.fixture(scope="module")
def builtin_folder(tmp_path_factory):
    from rapidspec.models.export import export_model

    return export_model("builtin:smollm2-135m", tmp_path_factory.mktemp("vllm") / "builtin")


def run_vllm(folder: Path, speculative_config, batches, max_tokens: int = 40) -> tuple[dict, str]:
    """(the script's RESULT, vLLM's log) of one offline run."""
    job = {"folder": str(folder), "speculative_config": speculative_config, "batches": batches,
           "max_tokens": max_tokens, "document_tokens": 3000, "max_model_len": 4096}
    done = run_in_vllm([str(SCRIPT), json.dumps(job)], TIMEOUT_S, stderr=subprocess.PIPE)
    log = done.stdout + done.stderr
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and found, log[-3000:]
    return json.loads(found[-1][len("RESULT "):]), log


def test_greedy_answers_with_rapids_proposer_equal_vllms_own(builtin_folder, monkeypatch):
    """Three questions at once, then one more: the answers equal vLLM's without speculation token for token,
    vLLM accepted drafts, and the first three requests' drafters were let go when the fourth ran. The drafters
    are prepared inline, so that every answer gets drafts however busy the machine (prepared beside vLLM's
    steps, a short answer may end before its drafter is ready)."""
    monkeypatch.setenv("RAPIDSPEC_VLLM_OPTIONS", '{"prepare": "inline"}')
    batches = [list(BUILTIN_QUESTIONS[:3]), [BUILTIN_QUESTIONS[3]]]
    plain, _ = run_vllm(builtin_folder, None, batches)
    rapid, log = run_vllm(builtin_folder, RAPID, batches)
    assert rapid["answers"] == plain["answers"]
    assert all(len(answer) > 0 for answer in plain["answers"])
    counters = rapid["counters"]
    assert counters["vllm:spec_decode_num_drafts"] > 0
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0, counters
    ended = [json.loads(m) for m in re.findall(r"a request ended .*; totals (\{.*\})", log)]
    assert ended and ended[-1]["finished"] == 3 and ended[-1]["requests"] == 4, log[-3000:]
    assert "gets no drafts" not in log and "drafter stopped" not in log
