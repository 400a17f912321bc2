"""Which device and dtype a model runs on: ``auto`` resolution and validation.

``auto`` device is CUDA when available, else CPU; ``auto`` dtype is bfloat16
where the CPU (AVX512-BF16 / AMX) or GPU computes it natively, else float32.
"""

from __future__ import annotations

import torch

from rapidspec.errors import RapidspecError
from rapidspec.runtime.native_dtype import cpu_supports_bf16, native_dtype

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Turn ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` into a device.

    ``auto`` is CUDA when available, else CPU. Asking for a CUDA device that
    does not exist raises :class:`RapidspecError`.
    """
    if isinstance(device, torch.device):
        device = str(device)
    name = str(device).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        index_text = name.partition(":")[2]
        if index_text and not index_text.isdigit():
            raise RapidspecError(f"invalid device {device!r}: use cpu, cuda, cuda:N or auto")
        if not torch.cuda.is_available():
            raise RapidspecError(f"device {device!r} requested but CUDA is not available")
        index = int(index_text) if index_text else 0
        if index >= torch.cuda.device_count():
            raise RapidspecError(
                f"device {device!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
        return torch.device(name)
    raise RapidspecError(f"invalid device {device!r}: use cpu, cuda, cuda:N or auto")


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None) -> torch.dtype:
    """Turn ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"`` into a dtype.

    ``auto`` is bfloat16 where the hardware computes in it natively (CPUs with
    AVX512-BF16/AMX, CUDA devices with bf16 support) and float32 elsewhere.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
        raise RapidspecError(f"invalid dtype {dtype}: use one of auto, {', '.join(_DTYPES)}")
    name = str(dtype).strip().lower()
    if name in _DTYPES:
        return _DTYPES[name]
    if name != "auto":
        raise RapidspecError(f"invalid dtype {dtype!r}: use one of auto, {', '.join(_DTYPES)}")
    device = device if device is not None else resolve_device("auto")
    if device.type == "cpu":  # cpu_supports_bf16 looked up in this module: tests replace it
        return torch.bfloat16 if cpu_supports_bf16() else torch.float32
    return native_dtype(device)

