"""vLLM's speculative decoding on long documents: no speculation, vLLM's ``ngram`` and ``draft_model``, and
RAPID's proposer (``rapidspec.vllm.RapidProposer``), offline, one request at a time.

    python benchmarks/vllm_speculation.py --target builtin --out vllm_builtin.jsonl
    python benchmarks/vllm_speculation.py --target builtin:qwen2.5-coder-0.5b --data real_documents.jsonl \\
        --out vllm_qwen.jsonl

``--data``: a ``{"document", "question"}`` JSONL file (the format of ``rapidspec bench --data``;
benchmarks/real_documents.py writes one from dev-set files); without it, the built-in document (about
7,000 tokens) and three of ``rapidspec bench serve``'s built-in questions. The target is exported once
(``rapidspec models export``) to a folder vLLM loads. Each method runs in its own vLLM (``.venv-vllm``,
``make vllm``), greedy, each document placed in the chat as rapidspec places it: first one untimed request
per document (vLLM's prefix cache, and for RAPID retrieval's index, then hold the document, as for a
user's follow-up questions), then each question alone, timed. ``draft_model`` drafts with the target's own
weights reading the whole prompt (the GGUF RAPID's proposer drafts with, de-quantized). Per method: output
tokens per second over the timed questions (tokens / wall seconds, prefill of the question included),
vLLM's draft acceptance rate and mean accepted length per drafting step (accepted / drafting steps + 1),
and whether every answer equals the answer without speculation. One JSON line per method in ``--out``, a
table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

METHODS = ("none", "ngram", "draft_model", "rapid")
WARM_UP_QUESTION = "What is this text about?"


def speculative_config(method: str, folder: str, k: int) -> dict | None:
    if method == "none":
        return None
    if method == "ngram":  # vLLM's usual prompt-lookup n-gram sizes
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if method == "draft_model":
        return {"method": "draft_model", "model": folder, "num_speculative_tokens": k}
    return {"method": "custom_class", "model": "rapidspec.vllm.RapidProposer", "num_speculative_tokens": k}


def worker(job: dict) -> None:
    """Inside vLLM's venv: one method on every record; prints ``RESULT {json}``."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from rapidspec.prompting.conversation import Message, render, with_documents

    tokenizer = AutoTokenizer.from_pretrained(job["folder"])
    llm = LLM(model=job["folder"], max_model_len=job["max_model_len"], enforce_eager=True, dtype=job["dtype"],
              speculative_config=job["speculative_config"], max_num_seqs=4, disable_log_stats=False, seed=0)
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"])

    def counters() -> dict:
        return {m.name.split("spec_decode_")[-1]: getattr(m, "value", 0) for m in llm.get_metrics()
                if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                              "vllm:spec_decode_num_accepted_tokens")}

    def ask(document: str, question: str) -> tuple[list[int], float, dict]:
        ids = render(tokenizer, with_documents([Message("user", question)], (document,)))
        before, started = counters(), time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        seconds, after = time.perf_counter() - started, counters()
        return list(out.token_ids), seconds, {k: after.get(k, 0) - before.get(k, 0) for k in after}

    rows, warmed = [], set()
    for record in job["records"]:
        if record["document"] not in warmed:
            warmed.add(record["document"])
            _, seconds, _ = ask(record["document"], WARM_UP_QUESTION)
            rows.append({"warm_up": True, "seconds": seconds})
        tokens, seconds, spec = ask(record["document"], record["question"])
        rows.append({"warm_up": False, "question": record["question"], "tokens": tokens, "seconds": seconds, **spec})
    print("RESULT " + json.dumps(rows), flush=True)


def run_method(job: dict, log: Path) -> list[dict]:
    from rapidspec.vllm.environment import run_in_vllm

    job_file = log.with_suffix(".job.json")  # a long document does not fit in a command line
    job_file.write_text(json.dumps(job), encoding="utf-8")
    with log.open("w") as handle:
        done = run_in_vllm([__file__, "--worker", str(job_file)], 3600, stderr=handle)
    job_file.unlink()
    with log.open("a") as handle:  # vLLM's own log lines (the proposer's among them) go to stdout
        handle.writelines(f"{line}\n" for line in done.stdout.splitlines() if not line.startswith("RESULT "))
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not found:
        raise SystemExit(f"vLLM failed ({job['speculative_config']}): see {log}")
    return json.loads(found[-1][len("RESULT "):])


def summary(method: str, rows: list[dict], plain: list[dict] | None) -> dict:
    timed = [r for r in rows if not r["warm_up"]]
    tokens = sum(len(r["tokens"]) for r in timed)
    steps, drafted, accepted = (sum(r.get(k, 0) for r in timed)
                                for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    same = None if plain is None else [r["tokens"] for r in timed] == [r["tokens"] for r in plain if not r["warm_up"]]
    return {"method": method, "questions": len(timed), "output_tokens": tokens,
            "tokens_per_s": tokens / sum(r["seconds"] for r in timed),
            "median_question_s": statistics.median(r["seconds"] for r in timed),
            "warm_up_s": [round(r["seconds"], 2) for r in rows if r["warm_up"]],
            "acceptance": accepted / drafted if drafted else None,
            "mean_accepted_length": accepted / steps + 1 if steps else None,
            "same_answers_as_none": same, "answers": [r["tokens"] for r in timed]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--target", default="builtin", help="rapidspec model name (default: builtin)")
    parser.add_argument("--data", help="a {document, question} JSONL file (default: the built-in document)")
    parser.add_argument("--questions", type=int, default=3, help="built-in questions (without --data)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--num-speculative-tokens", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--dtype", default="auto", help="vLLM's dtype (auto: bfloat16 on CPUs that have it)")
    parser.add_argument("--out", help="JSONL file, one line per method (required)")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(Path(args.worker).read_text(encoding="utf-8")))
        return
    if not args.out:
        parser.error("--out is required")
    from rapidspec.models.export import export_model
    from rapidspec.vllm.environment import require_vllm_python

    require_vllm_python()
    if args.data:
        records = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    else:
        from transformers import AutoTokenizer

        from rapidspec.bench.serve.dataset import BUILTIN_QUESTIONS
        from rapidspec.prompting.demo_document import demo_document

        records = None
    scratch = Path(tempfile.mkdtemp(prefix="rapidspec-vllm-bench-"))
    folder = export_model(args.target, scratch / "model")
    if records is None:
        document = demo_document(7000, AutoTokenizer.from_pretrained(folder)).document
        records = [{"document": document, "question": q} for q in BUILTIN_QUESTIONS[: args.questions]]
    results, plain = [], None
    for method in args.methods.split(","):
        job = {"folder": str(folder), "records": records, "max_tokens": args.max_tokens, "dtype": args.dtype,
               "max_model_len": args.max_model_len,
               "speculative_config": speculative_config(method, str(folder), args.num_speculative_tokens)}
        print(f"{method}: running ...", file=sys.stderr, flush=True)
        rows = run_method(job, Path(args.out).with_suffix(f".{method}.log"))
        plain = rows if method == "none" else plain
        results.append(summary(method, rows, plain if method != "none" else None))
        with open(args.out, "a", encoding="utf-8") as out:
            out.write(json.dumps({"target": args.target, "data": args.data or "builtin", **results[-1]}) + "\n")
    print(f"{'method':<12} {'tokens/s':>9} {'median s':>9} {'acceptance':>11} {'accepted/step':>14} {'same answers':>13}")
    for r in results:
        acceptance = "-" if r["acceptance"] is None else f"{r['acceptance']:.1%}"
        length = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        same = "-" if r["same_answers_as_none"] is None else str(r["same_answers_as_none"]).lower()
        print(f"{r['method']:<12} {r['tokens_per_s']:>9.2f} {r['median_question_s']:>9.2f} {acceptance:>11} "
              f"{length:>14} {same:>13}")


if __name__ == "__main__":
    main()
