"""Run by vLLM's venv (tests/test_vllm_offline.py): offline vLLM on a model folder, greedy, on the built-in
document's questions in batches; prints one line ``RESULT {json}`` (each answer's tokens, vLLM's speculative
decoding counters)."""

import json
import sys


def main() -> None:
    job = json.loads(sys.argv[1])
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from rapidspec.conversation import Message, render, with_documents
    from rapidspec.demo_document import demo_document

    tokenizer = AutoTokenizer.from_pretrained(job["folder"])
    document = demo_document(job["document_tokens"], tokenizer).document
    llm = LLM(model=job["folder"], max_model_len=job["max_model_len"], enforce_eager=True, dtype="float32",
              speculative_config=job["speculative_config"], max_num_seqs=4, disable_log_stats=False, seed=0)
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"])
    answers = []
    for batch in job["batches"]:
        prompts = [{"prompt_token_ids": render(tokenizer, with_documents([Message("user", q)], (document,)))}
                   for q in batch]
        answers += [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    print("RESULT " + json.dumps({"answers": answers, "counters": counters}), flush=True)


if __name__ == "__main__":  # vLLM starts its engine with multiprocessing's spawn
    main()
