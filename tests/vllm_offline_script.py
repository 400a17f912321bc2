"""Run by vLLM's venv (the ``vllm_offline`` fixture of tests/conftest.py): offline vLLM on a model folder, greedy,
once per engine configuration in one process, so that vLLM is imported once per test run.

Its one argument is a JSON job: ``folder``, ``document_tokens``, ``max_model_len`` and ``runs``, each run a
``speculative_config`` (null: vLLM's own decoding), the proposer's ``options`` (``RAPIDSPEC_VLLM_OPTIONS``; none:
its defaults) and ``batches``, each batch ``max_tokens``, ``prompts`` (a question about the built-in document, a
string, or a prompt's token ids, a list) and optionally ``ignore_eos``. A run may also name ``chat_templates``:
conversations whose token ids vLLM's tokenizer renders from the folder's chat template. Prints ``RUN i`` before
each run's engine starts (its log lines follow) and one line ``RESULT {json}``: per run, each batch's answers as
token ids, the rendered templates and vLLM's speculative decoding counters.
"""

import gc
import json
import os
import sys


def main() -> None:
    job = json.loads(sys.argv[1])
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from rapidspec.prompting.conversation import Message, render, with_documents
    from rapidspec.prompting.demo_document import demo_document

    tokenizer = AutoTokenizer.from_pretrained(job["folder"])
    document = demo_document(job["document_tokens"], tokenizer).document

    def prompt(given) -> dict:
        ids = given if isinstance(given, list) else render(tokenizer, with_documents([Message("user", given)],
                                                                                     (document,)))
        return {"prompt_token_ids": ids}

    results = []
    for index, run in enumerate(job["runs"]):
        print(f"RUN {index}", flush=True)
        os.environ["RAPIDSPEC_VLLM_OPTIONS"] = json.dumps(run.get("options", {}))  # the engine process inherits it
        llm = LLM(model=job["folder"], max_model_len=job["max_model_len"], enforce_eager=True, dtype="float32",
                  speculative_config=run["speculative_config"], max_num_seqs=4, disable_log_stats=False, seed=0)
        answers = []
        for batch in run["batches"]:
            params = SamplingParams(temperature=0, max_tokens=batch["max_tokens"],
                                    ignore_eos=batch.get("ignore_eos", False))
            outputs = llm.generate([prompt(p) for p in batch["prompts"]], params, use_tqdm=False)
            answers.append([list(out.outputs[0].token_ids) for out in outputs])
        templates = [list(llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                                                  tokenize=True, return_dict=False))
                     for messages in run.get("chat_templates", [])]
        counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                    if m.name.startswith("vllm:spec_decode")}
        results.append({"answers": answers, "templates": templates, "counters": counters})
        llm.llm_engine.engine_core.shutdown()  # its engine process ends before the next run's starts
        del llm
        gc.collect()
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":  # vLLM starts its engine with multiprocessing's spawn
    main()
