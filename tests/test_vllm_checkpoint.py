"""vLLM answers from an exported built-in model exactly as rapidspec does (slow: vLLM starts in about a minute).

``rapidspec models export builtin`` writes a folder; vLLM's offline ``LLM``
runs in a subprocess of vLLM's own venv (``make vllm`` makes ``.venv-vllm``;
``make test`` does too; the run's one vLLM process, the ``vllm_offline``
fixture of tests/vllm_runs.py), decodes a chat prompt's token ids greedily in float32
and must give the tokens rapidspec's ``lc`` mode gives for the same ids. Its
tokenizer must also read the exported chat template into the same prompt ids.
Before the tied embedding was written under its own name, vLLM answered token
0 forever from such a folder.
"""

from __future__ import annotations

import pytest

from rapidspec import Rapid
from rapidspec.config import DecodeConfig
from rapidspec.outputs import last_output
from tests.vllm_runs import CHAT, CHAT_MAX_TOKENS

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_vllm_answers_from_an_exported_builtin_model_as_rapidspec_does(vllm_offline, smollm2):
    engine = Rapid(target=smollm2)
    config = DecodeConfig(mode="lc", temperature=0.0, max_new_tokens=CHAT_MAX_TOKENS)
    prompts = engine.chat_prompts(CHAT, config)
    prompt_ids = list(prompts.target_ids)
    expected = last_output(engine.decode(prompts, config))

    (got,) = vllm_offline.plain["answers"][-1]  # the chat prompt's ids, decoded by vLLM
    (template_ids,) = vllm_offline.plain["templates"]
    assert template_ids == prompt_ids  # vLLM's transformers read the exported chat template
    assert got == list(expected.token_ids), expected.text
    assert len(set(got)) > 1  # not one token forever (the folder without model.embed_tokens.weight)
