"""What runs the drafter: torch (any device) or llama.cpp (CPU, a GGUF file as it is), decided once.

``auto`` (the default) is llama.cpp when all of these hold, else torch: the
target runs on the CPU, ``llama-cpp-python`` is installed, the drafter has a
GGUF file (the target's own for self-speculation), and no torch-side
quantization of the drafter was asked for. :class:`~rapidspec.models.spec.ModelSpec`
asks before loading (a drafter llama.cpp reads is not loaded by torch), the
engine's :class:`~rapidspec.drafting.factory.DrafterFactory` when it makes a
backend's pool.
"""

from __future__ import annotations

from pathlib import Path

from rapidspec.config import DRAFTER_BACKENDS
from rapidspec.errors import RapidspecError



def gguf_file(drafter) -> Path | None:
    """The GGUF file behind a drafter: a loaded model read from one, or a model name that resolves to one."""
    if drafter is None:
        return None
    if isinstance(drafter, str):
        from rapidspec.models.loading import resolve_source

        return resolve_source(drafter)[1]
    source = getattr(drafter, "source", "")
    return Path(source) if str(source).lower().endswith(".gguf") and Path(source).is_file() else None


def choose_backend(requested: str, target, drafter) -> str:
    """``torch`` or ``llama.cpp`` for ``requested`` (``auto`` resolved as the module docstring says).

    ``drafter``: None (self-speculation), a loaded model, or a model name.
    """
    from rapidspec.runtime.llama_cpp import llama_cpp_available

    if requested not in DRAFTER_BACKENDS:
        raise RapidspecError(f"drafter_backend must be one of {', '.join(DRAFTER_BACKENDS)}, got {requested!r}")
    if requested == "torch":
        return "torch"
    source = target if drafter is None else drafter
    gguf = gguf_file(source)
    quantized = getattr(source, "quantization", "none") != "none" and drafter is not None
    if requested == "auto":
        usable = target.device.type == "cpu" and gguf is not None and not quantized and llama_cpp_available()
        return "llama.cpp" if usable else "torch"
    if not llama_cpp_available():
        raise RapidspecError("drafter backend 'llama.cpp' needs llama-cpp-python: run `make install` (it builds it)")
    if gguf is None:
        raise RapidspecError(f"drafter backend 'llama.cpp' reads GGUF files; {getattr(source, 'name', source)!r} is not one")
    if quantized:
        raise RapidspecError("drafter backend 'llama.cpp' uses the GGUF's own weights; drop the drafter quantization")
    return "llama.cpp"
