"""Which floating-point dtype a device computes in natively: bfloat16 where it has the instructions, else float32.

Shared by model loading (``dtype="auto"``, :mod:`rapidspec.models.devices`)
and the retrieval embedder (``embedding_dtype="auto"``). CPUs count as native
with AVX512-BF16 or AMX (from ``/proc/cpuinfo``); CUDA devices when PyTorch
says they support bfloat16.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    """CPU feature flags from /proc/cpuinfo (empty where unavailable)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_supports_bf16() -> bool:
    """True when the CPU has native bfloat16 arithmetic (AVX512-BF16 or AMX)."""
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})


def native_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where ``device`` computes in it natively, else float32."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if device.type == "cpu" and cpu_supports_bf16() else torch.float32
