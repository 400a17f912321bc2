"""vLLM answers from an exported built-in model exactly as rapidspec does (slow: vLLM starts in about a minute).

``rapidspec models export builtin`` writes a folder; vLLM's offline ``LLM``
runs in a subprocess of vLLM's own venv (``make vllm`` makes ``.venv-vllm``;
``make test`` does too), decodes a chat prompt's token ids greedily in float32
and must give the tokens rapidspec's ``lc`` mode gives for the same ids. Its
tokenizer must also read the exported chat template into the same prompt ids.
Before the tied embedding was written under its own name, vLLM answered token
0 forever from such a folder.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from rapidspec import Rapid, load_model
from rapidspec.config import DecodeConfig
from rapidspec.models.export import export_model
from rapidspec.outputs import last_output
from rapidspec.vllm.environment import vllm_env, vllm_python

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
MAX_TOKENS = 24
#: vLLM imports and starts its engine in about 55 s on 2 idle cores; busy ones take longer.
TIMEOUT_S = 600

# Runs in vLLM's venv: the spawned engine core needs the __main__ guard.
VLLM_SCRIPT = textwrap.dedent("""
    import json
    import sys


    def main() -> None:
        from vllm import LLM, SamplingParams

        folder, request, answer = sys.argv[1:4]
        request = json.loads(open(request).read())
        llm = LLM(model=folder, max_model_len=2048, enforce_eager=True, dtype="float32")
        template_ids = llm.get_tokenizer().apply_chat_template(request["messages"], add_generation_prompt=True,
                                                               tokenize=True, return_dict=False)
        params = SamplingParams(temperature=0, max_tokens=request["max_tokens"])
        out = llm.generate([{"prompt_token_ids": request["prompt_ids"]}], params, use_tqdm=False)[0].outputs[0]
        with open(answer, "w") as handle:
            json.dump({"template_ids": list(template_ids), "token_ids": list(out.token_ids), "text": out.text}, handle)


    if __name__ == "__main__":
        main()
""")


def test_vllm_answers_from_an_exported_builtin_model_as_rapidspec_does(tmp_path):
    python = vllm_python()
    if python is None:
        pytest.skip("no vLLM venv (.venv-vllm): `make vllm` makes it")
    folder = export_model("builtin:smollm2-135m", tmp_path / "smollm2", dtype="float32")
    loaded = load_model("builtin:smollm2-135m", dtype="float32")
    engine = Rapid(loaded)
    config = DecodeConfig(mode="lc", temperature=0.0, max_new_tokens=MAX_TOKENS)
    prompts = engine.chat_prompts(MESSAGES, config)
    prompt_ids = list(prompts.target_ids)
    expected = last_output(engine.decode(prompts, config))

    script, request, answer = tmp_path / "run_vllm.py", tmp_path / "request.json", tmp_path / "answer.json"
    script.write_text(VLLM_SCRIPT)
    request.write_text(json.dumps({"messages": MESSAGES, "prompt_ids": prompt_ids, "max_tokens": MAX_TOKENS}))
    log = tmp_path / "vllm.log"
    with open(log, "w") as out:
        try:
            completed = subprocess.run([str(python), str(script), str(folder), str(request), str(answer)],
                                       cwd=tmp_path, env=vllm_env(), stdout=out, stderr=subprocess.STDOUT,
                                       timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"vLLM did not answer within {TIMEOUT_S} s; the end of its log:\n{tail(log)}")
    assert completed.returncode == 0, f"vLLM failed; the end of its log:\n{tail(log)}"
    got = json.loads(answer.read_text())
    assert got["template_ids"] == prompt_ids  # vLLM's transformers read the exported chat template
    assert got["token_ids"] == list(expected.token_ids), (got["text"], expected.text)
    assert len(set(got["token_ids"])) > 1  # not one token forever (the folder without model.embed_tokens.weight)


def tail(log, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
