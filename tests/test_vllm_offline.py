"""vLLM's offline ``LLM`` with RAPID's proposer on the built-in model (slow; vLLM's venv comes from `make vllm`,
which `make test` runs).

vLLM runs once per test run for this module and tests/test_vllm_checkpoint.py (the ``vllm_offline`` fixture,
tests/vllm_runs.py). The proposer's own logic is tested without vLLM in tests/test_vllm_proposer.py.
"""

from __future__ import annotations

import json
import re

import pytest
from tests.vllm_runs import LONG_BATCH, QUESTION_BATCHES

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_greedy_answers_with_rapids_proposer_equal_vllms_own(vllm_offline):
    """Three questions at once, then one more: the answers equal vLLM's without speculation token for token,
    vLLM accepted drafts, and the first three requests' drafters were let go when the fourth ran. The drafters
    are prepared inline, so that every answer gets drafts however busy the machine (prepared beside vLLM's
    steps, a short answer may end before its drafter is ready)."""
    questions = len(vllm_offline.rapid["answers"])  # the question batches; the plain run has the chat prompt after
    assert vllm_offline.rapid["answers"] == vllm_offline.plain["answers"][:questions]
    assert all(len(answer) > 0 for batch in vllm_offline.plain["answers"] for answer in batch)
    counters = vllm_offline.rapid["counters"]
    assert counters["vllm:spec_decode_num_drafts"] > 0
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0, counters
    log = vllm_offline.logs[1]
    assert ", prepared inline" in log
    ended = [json.loads(m) for m in re.findall(r"a request ended .*; totals (\{.*\})", log)]
    assert ended and ended[-1]["finished"] == 3 and ended[-1]["requests"] == 4, log[-3000:]
    assert "gets no drafts" not in log and "drafter stopped" not in log


def test_a_drafter_prepared_beside_vllms_steps_joins_a_long_answer(vllm_offline):
    """RAPID's proposer as a user runs it (``prepare: beside``, the default): the request decodes without drafts
    while its drafter is prepared on the proposer's thread, then gets drafts that vLLM accepts; the answer equals
    vLLM's own token for token."""
    long_answer = vllm_offline.plain["answers"][len(QUESTION_BATCHES)]
    assert vllm_offline.beside["answers"] == [long_answer] and len(long_answer[0]) == LONG_BATCH["max_tokens"]
    counters = vllm_offline.beside["counters"]
    assert counters["vllm:spec_decode_num_drafts"] > 0, counters  # the drafter joined the answer
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0, counters
    log = vllm_offline.logs[2]
    assert ", prepared beside" in log and "gets no drafts" not in log and "drafter stopped" not in log
