"""PyTorch's low-bit CPU products against a float one, per input dtype: why the kernels compute in bfloat16.

    python benchmarks/low_bit_kernels.py
    python benchmarks/low_bit_kernels.py --shapes 9728x896,896x4864,151936x896 --rows 1,8

For each weight shape [out, in] and number of input rows, the median time
(``torch.utils.benchmark``) of: ``F.linear`` in float32 and in bfloat16;
``aten::_weight_int8pack_mm`` (int8 weights, one scale per output channel)
and ``aten::_weight_int4pack_mm_for_cpu`` (4-bit codes, a scale and zero
point per group of 32 columns) with float32 inputs and with bfloat16 inputs
(their scales in the same dtype); and where PyTorch has FBGEMM, int8 weights
times int8 activations rounded per token (``rapidspec.runtime.dynamic_int8``,
what rapidspec's int8 layers compute with). The default shapes are Qwen2.5-0.5B's fused
gate/up projection, its down projection and its output layer. Prints a
table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.utils.benchmark import Timer

from rapidspec.runtime import dynamic_int8

GROUP = 32


def median_ms(statement: str, min_run_time: float, **values) -> float:
    timer = Timer(statement, globals={"torch": torch, "F": F, **values})
    return 1e3 * timer.blocked_autorange(min_run_time=min_run_time).median


def measure(out_features: int, in_features: int, rows: int, min_run_time: float) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    int8 = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32, generator=generator)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        scales = torch.rand(out_features, generator=generator).to(dtype)
        scales_and_zeros = torch.rand(in_features // GROUP, out_features, 2, generator=generator).to(dtype)
        result[f"float {name}"] = median_ms("F.linear(x, w)", min_run_time, x=x, w=weight.to(dtype))
        result[f"int8 {name}"] = median_ms("torch.ops.aten._weight_int8pack_mm(x, w, s)", min_run_time,
                                           x=x, w=int8, s=scales)
        result[f"int4 {name}"] = median_ms("torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, g, sz)", min_run_time,
                                           x=x, w=packed, g=GROUP, sz=scales_and_zeros)
    if dynamic_int8.AVAILABLE:
        scales = torch.rand(out_features, generator=generator) / 127
        result["int8 x int8 per token"] = median_ms("product(x, p)", min_run_time,
                                                    product=dynamic_int8.dynamic_int8_product,
                                                    x=torch.randn(rows, in_features, generator=generator),
                                                    p=dynamic_int8.pack_weight(int8, scales))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="9728x896,896x4864,151936x896", help="out x in, comma-separated")
    parser.add_argument("--rows", default="1,8", help="input rows (tokens), comma-separated")
    parser.add_argument("--min-run-time", type=float, default=0.5,
                        help="seconds each product is timed for at least (torch.utils.benchmark's min_run_time)")
    args = parser.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
        rows = [int(v) for v in args.rows.split(",")]
        if any(len(s) != 2 or s[1] % GROUP for s in shapes) or any(r < 1 for r in rows) or not args.min_run_time > 0:
            raise ValueError
    except ValueError:
        Console(stderr=True).print(f"[red]error:[/red] --shapes takes OUTxIN with IN a multiple of {GROUP}, --rows numbers "
                                   ">= 1, --min-run-time a number > 0")
        return 2
    records = [{"out": out, "in": inp, "rows": n, "ms": measure(out, inp, n, args.min_run_time)}
               for out, inp in shapes for n in rows]
    columns = list(records[0]["ms"])
    table = Table(title=f"low-bit CPU products, median ms, {torch.get_num_threads()} threads, "
                        f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for column in ("weight [out, in]", "rows", *columns):
        table.add_column(column, justify="right")
    for record in records:
        table.add_row(f"{record['out']} x {record['in']}", str(record["rows"]),
                      *(f"{record['ms'][c]:.2f}" for c in columns))
    Console(width=160).print(table)
    print(json.dumps({"threads": torch.get_num_threads(), "capability": torch.backends.cpu.get_cpu_capability(),
                      "records": records}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
