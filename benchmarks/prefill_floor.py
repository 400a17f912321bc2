"""The target's prefill against the machine's floor: tokens/s, and the fraction of the time its arithmetic needs.

    python -m benchmarks.prefill_floor --lengths 8192,16384,32768 --chunks 2048
    python -m benchmarks.prefill_floor --lengths 8192 --chunks 512,1024,2048,4096 --quantize auto,none

For each precision (``--quantize``: ``auto`` is the file's own low-bit layers on CPU, ``none`` transformers'
float copy), chunk size and length, the built-in long document of that many tokens is prefilled once into an
empty cache (``KVCache.prefill``, as the engine does) and timed. The floor is the prefill's arithmetic over the
machine's measured matrix-product rate: 2 x (the decoder's linear weights) per token, plus attention's
4 x layers x heads x head_dim x (the keys each token attends to, causal: the tokens before it), over the rate
``torch.mm`` reaches on the CPU in the model's dtype at the decoder's own shapes ([chunk, hidden] x [hidden,
intermediate]), measured here first. ``fraction of the floor`` is floor time over measured time (1.0 would be the
whole prefill at the matrix-product rate). One run each; the CPU, its flags and the load average head the output.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from benchmarks.document_once import cpu_line


def matmul_rate(rows: int, inner: int, outer: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of ``torch.mm`` of [rows, inner] x [inner, outer] in ``dtype`` (the best of ``repeats``)."""
    a, b = torch.randn(rows, inner).to(dtype), torch.randn(inner, outer).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * rows * inner * outer / best


def linear_weights(config) -> int:
    """Multiply-adds per token of the decoder's linear layers (q, k, v, o, gate, up, down), all layers."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    return layers * (attention + 3 * hidden * inter)


def floor_seconds(config, tokens: int, rate: float) -> float:
    """The prefill's arithmetic over ``rate``: linear layers, then attention over the tokens before each one."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    linear = 2 * linear_weights(config) * tokens
    attention = 4 * config.num_hidden_layers * heads * head_dim * tokens * (tokens + 1) / 2  # QK^T and AV
    return (linear + attention) / rate


def profile(loaded, context: int, chunk: int) -> int:
    """Print the operators one ``chunk``-token forward spends its time in, after ``context`` cached tokens (their
    keys and values random: attention's arithmetic is the same)."""
    from rapidspec.runtime import new_kv_cache

    lean = loaded.lean
    cache = new_kv_cache(loaded, chunk)
    cache.reserve(context + chunk)
    if context:
        shape = (lean.num_layers, lean.kv_heads, context, lean.head_dim)
        cache.append_kv([0] * context, torch.randn(shape).to(loaded.dtype), torch.randn(shape).to(loaded.dtype))
    ids = torch.randint(0, loaded.model.config.vocab_size, (chunk,)).tolist()
    with torch.inference_mode():
        cache.forward(ids, 1)  # warm
        cache.crop(context)
        with torch.profiler.profile() as run:
            cache.forward(ids, 1)
    print(f"one {chunk}-token chunk after {context} cached tokens ({loaded.quantization}, {loaded.dtype}):")
    print(run.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="builtin")
    parser.add_argument("--lengths", default="8192,16384,32768")
    parser.add_argument("--chunks", default="2048", help="prefill chunk sizes, comma-separated")
    parser.add_argument("--quantize", default="auto", help="comma-separated: auto (the file's precision), none")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    parser.add_argument("--profile-context", type=int, default=None, metavar="N",
                        help="instead: where one chunk's time goes (torch.profiler, by operator) after N cached tokens")
    args = parser.parse_args()
    from rapidspec.models import load_model
    from rapidspec.prompting.demo_document import demo_document
    from rapidspec.runtime import new_kv_cache

    header = {"cpu": cpu_line(), "load_average_at_start": os.getloadavg(), "target": args.target,
              "torch_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M")}
    print(json.dumps(header), flush=True)
    if args.profile_context is not None:
        return profile(load_model(args.target, quantize=args.quantize.split(",")[0]), args.profile_context,
                       int(args.chunks.split(",")[0]))
    rows = []
    for quantize in args.quantize.split(","):
        loaded = load_model(args.target, quantize=quantize)
        config = loaded.model.config
        rates = {chunk: matmul_rate(chunk, config.hidden_size, config.intermediate_size, loaded.dtype)
                 for chunk in map(int, args.chunks.split(","))}
        for length in map(int, args.lengths.split(",")):
            ids = loaded.tokenizer(demo_document(tokenizer=loaded.tokenizer, target_tokens=length).document)["input_ids"]
            for chunk, rate in rates.items():
                cache = new_kv_cache(loaded, chunk)
                cache.reserve(len(ids))
                with torch.inference_mode():
                    started = time.perf_counter()
                    cache.prefill(ids)
                    seconds = time.perf_counter() - started
                floor = floor_seconds(config, len(ids), rate)
                row = {"quantization": loaded.quantization, "dtype": str(loaded.dtype).replace("torch.", ""),
                       "runtime": loaded.runtime, "tokens": len(ids), "chunk": chunk, "seconds": round(seconds, 2),
                       "tokens_per_second": round(len(ids) / seconds, 1), "matmul_gflops": round(rate / 1e9, 1),
                       "floor_seconds": round(floor, 2), "fraction_of_floor": round(floor / seconds, 3)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "w", encoding="utf-8") as out:
                        json.dump({**header, "rows": rows}, out, indent=1)
        del loaded
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
