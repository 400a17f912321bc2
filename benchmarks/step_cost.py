"""Per-step costs of decoding against the memory-bandwidth roofline, per runtime.

A decode step of a small model reads every weight once and the whole
key/value cache once, so its floor is (weight bytes + cache bytes) divided by
the machine's memory bandwidth. This script measures, in one process:

* the read bandwidth (median of summing a buffer much larger than the caches),
* for each context length: a target step (one token), a verify of
  ``--verify-tokens`` tokens, and a drafter step on ``--drafter-tokens``
  tokens of context (the retrieved text), each the median of ``--steps``
  forwards after two warm-ups, for each ``--runtimes`` entry (``lean`` and
  ``transformers`` side by side: the before and after of the lean forward),
  the runtimes taking turns step by step so that noise hits them alike;
* each step's bytes, its roofline time and its ratio to it;
* the verify's floor: the larger of its bytes over the bandwidth (a plain
  step's) and its arithmetic (2 x tokens x linear weights, plus 4 x tokens x
  heads x head_dim x context x layers for attention) over the machine's
  matrix-product rate (median of a [512, 4096] x [4096, 4096] product in the
  model's dtype). Where the arithmetic floor is the larger, a verify of that
  many tokens cannot cost as little as a plain step on this machine.

    python benchmarks/step_cost.py --lengths 4096,8192 --drafter-quantize int8
    python benchmarks/step_cost.py --dtype float32 --quantize gguf --drafter-quantize none --runtimes lean --lengths 8192
    python benchmarks/step_cost.py --target builtin:qwen2.5-coder-1.5b \\
        --drafter builtin:qwen2.5-coder-0.5b --drafter-quantize int4 --lengths 16384
    python benchmarks/step_cost.py --target DIR --device cuda --quantize none --drafter-quantize none \\
        --lengths 32768 --profile

On a GPU every timed forward ends with a synchronisation, the bandwidth is
that of summing a buffer in the device's memory, and ``--profile`` prints the
operators of one plain step per runtime (torch.profiler), which tells a step
bound by kernel launches and Python from one bound by memory.

Token ids are random (a step's cost does not depend on which tokens); the
target and drafter share nothing but their weights' storage where a
self-drafter is a quantised copy. Prints a table, then one JSON object as the
last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from rapidspec.engine.rounds import sync
from rapidspec.errors import RapidspecError
from rapidspec.models import load_model, low_bit_copy
from rapidspec.runtime import new_kv_cache
from rapidspec.runtime.packed import PackedLinear, packed_bytes
from rapidspec.config import TARGET_QUANTIZATIONS
from rapidspec.runtime.quantization import Int4Linear, Int8Linear

RUNTIMES = ("lean", "transformers")


def read_bandwidth(megabytes: int = 512, repeats: int = 7, device: torch.device = torch.device("cpu")) -> float:
    """Bytes per second of summing a float32 buffer on ``device`` (filled, so pages are real), median of ``repeats``."""
    buffer = torch.rand(megabytes * 2**20 // 4, device=device)
    buffer.sum()  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        buffer.sum()
        sync(device)
        times.append(time.perf_counter() - started)
    return buffer.nbytes / statistics.median(times)


def matmul_flops(dtype: torch.dtype, repeats: int = 5, device: torch.device = torch.device("cpu")) -> float:
    """Floating-point operations per second of a [512, 4096] x [4096, 4096] product in ``dtype`` on ``device``,
    median of ``repeats``."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(512, 4096, generator=generator).to(device, dtype)
    b = torch.randn(4096, 4096, generator=generator).to(device, dtype)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - started)
    return 2 * 512 * 4096 * 4096 / statistics.median(times)


def forward_flops(model: torch.nn.Module, tokens: int, length: int) -> float:
    """Arithmetic of forwarding ``tokens`` after ``length`` cached ones: the linear layers and attention's two products."""
    linear = sum(m.in_features * m.out_features for m in model.modules() if hasattr(m, "in_features")
                 and hasattr(m, "out_features") and not list(m.children()))
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 4 * tokens * config.num_attention_heads * head_dim * length * config.num_hidden_layers
    return 2 * tokens * linear + attention


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a one-token forward reads from weights: every linear layer and norm (not the embedding table)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Int8Linear):
            tensors = (module.weight_int8, module.scales, module.bias)
        elif isinstance(module, Int4Linear):
            packed = module.kernel_weight if module.kernel_weight is not None else module.codes_packed
            tensors = (packed, module.scales_and_zeros, module.bias)
        elif isinstance(module, PackedLinear):
            total += packed_bytes(module)
            continue
        elif isinstance(module, torch.nn.Linear):
            tensors = (module.weight, module.bias)
        elif type(module).__name__.endswith("RMSNorm"):
            tensors = (module.weight,)
        else:
            continue
        total += sum(t.nbytes for t in tensors if t is not None)
    return total


def cache_bytes(model: torch.nn.Module, length: int) -> int:
    """Bytes of keys and values of ``length`` positions in the model's dtype."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * length * element


def timed_step(cache, tokens: list[int]) -> float:
    """Seconds of forwarding ``tokens`` (all logits kept), then rolling the cache back."""
    length = cache.length
    sync(cache.device)
    started = time.perf_counter()
    cache.forward(tokens, num_logits=len(tokens))
    sync(cache.device)
    seconds = time.perf_counter() - started
    cache.crop(length)
    return seconds


def interleaved_medians(caches: dict, tokens: list[int], steps: int) -> dict[str, float]:
    """Median seconds per runtime of forwarding ``tokens``, the runtimes taking turns step by step
    (after two warm-ups each), so that a noisy machine slows all of them alike."""
    times = {runtime: [] for runtime in caches}
    for index in range(steps + 2):
        for runtime, cache in caches.items():
            seconds = timed_step(cache, tokens)
            if index >= 2:
                times[runtime].append(seconds)
    return {runtime: statistics.median(values) for runtime, values in times.items()}


def prefilled(models: dict, ids: list[int], chunk: int) -> tuple[dict, dict]:
    """A cache per runtime (``models``: runtime -> its loaded model) holding ``ids``, and each prefill's seconds."""
    caches, seconds = {}, {}
    for runtime, loaded in models.items():
        caches[runtime] = new_kv_cache(loaded, chunk)
        started = time.perf_counter()
        caches[runtime].prefill(ids)
        sync(caches[runtime].device)
        seconds[runtime] = time.perf_counter() - started
    return caches, seconds


def load_pair(args, runtime: str):
    """Target and drafter loaded for ``runtime`` (each runtime gets its own load: the lean one packs weights)."""
    target = load_model(args.target, dtype=args.dtype, device=args.device, quantize=args.quantize, runtime=runtime)
    if args.drafter is not None:
        return target, load_model(args.drafter, dtype=args.dtype, device=args.device, quantize=args.drafter_quantize,
                                  runtime=runtime)
    if args.drafter_quantize != "none":
        return target, low_bit_copy(target, args.drafter_quantize)
    return target, target


def measure(args, pairs: dict, bandwidth: float, flops: float, console: Console) -> list[dict]:
    """Rows of step costs; ``pairs``: runtime -> (target, drafter)."""
    target, drafter = next(iter(pairs.values()))
    targets = {runtime: pair[0] for runtime, pair in pairs.items()}
    drafters = {runtime: pair[1] for runtime, pair in pairs.items()}
    vocab = min(target.model.config.vocab_size, len(target.tokenizer))
    ids = torch.randint(0, vocab, (max(args.lengths) + 64,), generator=torch.Generator().manual_seed(0)).tolist()
    target_weights, drafter_weights = weight_bytes(target.model), weight_bytes(drafter.model)
    drafter_caches, _ = prefilled(drafters, ids[: args.drafter_tokens - 1], args.prefill_chunk_tokens)
    drafter_step = interleaved_medians(drafter_caches, ids[args.drafter_tokens - 1 : args.drafter_tokens], args.steps)
    drafter_bytes = drafter_weights + cache_bytes(drafter.model, args.drafter_tokens)
    del drafter_caches
    rows = []
    for length in args.lengths:
        console.print(f"[dim]prefill {length} tokens ({', '.join(args.runtimes)})[/dim]")
        caches, prefill = prefilled(targets, ids[: length - 1], args.prefill_chunk_tokens)
        plain = interleaved_medians(caches, ids[length - 1 : length], args.steps)
        verify = interleaved_medians(caches, ids[length - 1 : length - 1 + args.verify_tokens], args.steps)
        plain_bytes = target_weights + cache_bytes(target.model, length)
        verify_floor = max(plain_bytes / bandwidth, forward_flops(target.model, args.verify_tokens, length) / flops)
        for runtime in args.runtimes:
            rows.append({
                "runtime": runtime, "length": length, "prefill_s": prefill[runtime],
                "prefill_tok_s": (length - 1) / prefill[runtime],
                "plain_ms": 1e3 * plain[runtime], "plain_roofline_ms": 1e3 * plain_bytes / bandwidth,
                "verify_tokens": args.verify_tokens, "verify_ms": 1e3 * verify[runtime],
                "verify_per_plain": verify[runtime] / plain[runtime], "verify_floor_ms": 1e3 * verify_floor,
                "drafter_tokens": args.drafter_tokens, "drafter_ms": 1e3 * drafter_step[runtime],
                "drafter_roofline_ms": 1e3 * drafter_bytes / bandwidth,
            })
        if args.profile and length == args.lengths[-1]:
            for runtime, cache in caches.items():
                profile_step(cache, ids[length - 1 : length], f"{runtime}, one plain step after {length - 1} tokens")
                profile_step(cache, ids[length - 1 : length - 1 + args.verify_tokens],
                             f"{runtime}, one verification of {args.verify_tokens} tokens after {length - 1} tokens")
        del caches
    return rows


def profile_step(cache, tokens: list[int], title: str, row_limit: int = 15) -> None:
    """Print the operators of one forward of ``tokens`` (torch.profiler, with the device's kernels on a GPU),
    sorted by their own host time, then by device time where there is a device."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cache.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    timed_step(cache, tokens)  # warm
    with torch.profiler.profile(activities=activities) as run:
        timed_step(cache, tokens)
    averages = run.key_averages()
    print(f"{title}: host time by operator", file=sys.stderr)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=row_limit), file=sys.stderr)
    if cache.device.type == "cuda":
        print(f"{title}: device time by operator", file=sys.stderr)
        print(averages.table(sort_by="self_device_time_total", row_limit=row_limit), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="builtin")
    parser.add_argument("--drafter", default=None, help="drafter model (default: the target's weights)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantize", default="auto", choices=TARGET_QUANTIZATIONS, help="the target's weights")
    parser.add_argument("--drafter-quantize", default="int8", choices=["none", "int8", "int4"])
    parser.add_argument("--lengths", default="4096,8192", help="target context lengths (comma separated)")
    parser.add_argument("--drafter-tokens", type=int, default=528, help="drafter context (retrieved tokens)")
    parser.add_argument("--verify-tokens", type=int, default=7, help="tokens of one verify forward (gamma + 1)")
    parser.add_argument("--steps", type=int, default=20, help="timed forwards per median")
    parser.add_argument("--runtimes", default="lean,transformers")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=2048)
    parser.add_argument("--bandwidth-megabytes", type=int, default=512, help="buffer summed to measure bandwidth")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto: the GPU where there is one)")
    parser.add_argument("--profile", action="store_true",
                        help="also print the operators of one plain step and one verification per runtime at the "
                             "last length")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        args.runtimes = [x.strip() for x in args.runtimes.split(",") if x.strip()]
        if not args.lengths or min(args.lengths) <= args.verify_tokens or args.drafter_tokens < 2:
            raise RapidspecError("--lengths must be > --verify-tokens and --drafter-tokens >= 2")
        if any(r not in RUNTIMES for r in args.runtimes):
            raise RapidspecError(f"--runtimes takes {', '.join(RUNTIMES)}")
        pairs = {runtime: load_pair(args, runtime) for runtime in args.runtimes}
    except RapidspecError as error:
        console.print(f"[red]error:[/red] {error}")
        return 2
    with torch.inference_mode():
        target = next(iter(pairs.values()))[0]
        device = next(target.model.parameters()).device
        bandwidth = read_bandwidth(args.bandwidth_megabytes, device=device)
        flops = matmul_flops(target.model.dtype, device=device)
        rows = measure(args, pairs, bandwidth, flops, console)
    table = Table(title=f"step costs, medians of {args.steps} (read bandwidth {bandwidth / 1e9:.1f} GB/s, "
                        f"matrix products {flops / 1e9:.0f} GFLOP/s)")
    for column in ("runtime", "context", "plain step", "roofline", "x roofline", f"verify {args.verify_tokens}",
                   "verify/plain", "verify floor", f"drafter @{args.drafter_tokens}", "drafter roofline",
                   "prefill tok/s"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["runtime"], str(row["length"]), f"{row['plain_ms']:.1f} ms", f"{row['plain_roofline_ms']:.1f} ms",
            f"{row['plain_ms'] / row['plain_roofline_ms']:.2f}", f"{row['verify_ms']:.1f} ms",
            f"{row['verify_per_plain']:.2f}", f"{row['verify_floor_ms']:.1f} ms", f"{row['drafter_ms']:.1f} ms", f"{row['drafter_roofline_ms']:.1f} ms",
            f"{row['prefill_tok_s']:.0f}",
        )
    Console(width=160).print(table)
    print(json.dumps({
        "target": args.target, "quantize": next(iter(pairs.values()))[0].quantization, "drafter": args.drafter or "self",
        "dtype": args.dtype, "device": str(device),
        "drafter_quantize": args.drafter_quantize, "threads": torch.get_num_threads(),
        "read_bandwidth_gb_s": bandwidth / 1e9, "matmul_gflop_s": flops / 1e9, "rows": rows,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
