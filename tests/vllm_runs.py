"""The run's one offline vLLM process (the ``vllm_offline`` fixture of tests/conftest.py), shared by
tests/test_vllm_offline.py and tests/test_vllm_checkpoint.py: vLLM imports and starts its engine in about a
minute on 2 idle cores, so it is started once per run for what both check.

SmolLM2-135M is exported in float32 (``rapidspec models export``) and decoded greedily in float32 by
tests/vllm_offline_script.py three times: with vLLM's own decoding, on the built-in document's questions (three
at once, then one more), on one question answered at length and on a chat prompt whose token ids rapidspec
rendered; with RAPID's proposer on the short questions, its drafters prepared inline (every answer gets drafts
however busy the machine); and with RAPID's proposer as a user runs it, its drafter prepared beside vLLM's steps
(the default), on the long answer, which outlasts the preparation.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rapidspec.bench.serve.dataset import BUILTIN_QUESTIONS
from rapidspec.vllm.environment import run_in_vllm

SCRIPT = Path(__file__).with_name("vllm_offline_script.py")
RAPID = {"method": "custom_class", "model": "rapidspec.vllm.RapidProposer", "num_speculative_tokens": 6}
QUESTION_BATCHES = [list(BUILTIN_QUESTIONS[:3]), [BUILTIN_QUESTIONS[3]]]
QUESTION_MAX_TOKENS = 40
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
CHAT_MAX_TOKENS = 24
#: One question answered at length (past its end of text): the drafter, prepared beside vLLM's steps, is ready
#: well within it.
LONG_BATCH = {"max_tokens": 192, "prompts": [BUILTIN_QUESTIONS[0]], "ignore_eos": True}
#: Both engines, each started in about a minute on 2 idle cores, with their answers; busy cores take longer.
TIMEOUT_S = 1200


@dataclass(frozen=True)
class OfflineRuns:
    plain: dict  # vLLM's own decoding: answers (per batch: the questions, the long answer, the chat) and templates
    rapid: dict  # RAPID's proposer, prepared inline: answers to the questions, vLLM's speculative decoding counters
    beside: dict  # RAPID's proposer with its defaults (prepared beside): the long answer, the counters
    logs: tuple[str, str, str]  # each run's output (vLLM's and the proposer's log lines)


def run_offline(folder: Path, chat_prompt_ids: list[int]) -> OfflineRuns:
    questions = [{"max_tokens": QUESTION_MAX_TOKENS, "prompts": batch} for batch in QUESTION_BATCHES]
    chat = {"max_tokens": CHAT_MAX_TOKENS, "prompts": [chat_prompt_ids]}
    job = {"folder": str(folder), "document_tokens": 3000, "max_model_len": 4096,
           "runs": [{"speculative_config": None, "batches": [*questions, LONG_BATCH, chat], "chat_templates": [CHAT]},
                    {"speculative_config": RAPID, "batches": questions, "options": {"prepare": "inline"}},
                    {"speculative_config": RAPID, "batches": [LONG_BATCH]}]}
    done = run_in_vllm([str(SCRIPT), json.dumps(job)], TIMEOUT_S, stderr=subprocess.STDOUT)
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and found, done.stdout[-3000:]
    plain, rapid, beside = json.loads(found[-1][len("RESULT "):])
    logs = tuple(re.split(r"^RUN \d+$", done.stdout, flags=re.M)[1:])
    assert len(logs) == 3, done.stdout[-3000:]
    return OfflineRuns(plain, rapid, beside, logs)
