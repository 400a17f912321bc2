"""What a run loads, decided once: :class:`ModelSpec`.

The command line builds one from its model options, one to one, inside the
:class:`~rapidspec.engine.spec.EngineSpec` that every surface passes to
:class:`rapidspec.Rapid` (which calls :meth:`ModelSpec.load`), so a
process on another machine loads exactly what the command named. Invalid values raise
:class:`~rapidspec.errors.RapidspecError` on construction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rapidspec.config import (DRAFTER_BACKENDS, DRAFTER_GGUF_CHOICES, DRAFTER_PREFILLS,
                              DTYPE_NAMES, QUANTIZATIONS, ROUNDED_QUANTIZATIONS, RUNTIMES, TARGET_QUANTIZATIONS)
from rapidspec.errors import RapidspecError


@dataclass(frozen=True)
class ModelSpec:
    """The target and drafter of a run and how to load them.

    ``quantize``: the target's linear layers (``auto``: the GGUF file's own
    low-bit weights on the CPU, else the float copy;
    :func:`rapidspec.models.load_model`). ``drafter``: None drafts with the
    target's weights (a low-bit copy when ``drafter_quantize`` is another
    precision than the target's); a name that runs on
    llama.cpp (``drafter_backend`` auto or llama.cpp, a GGUF file, no torch
    quantization) is read there as it is and loaded by torch only if a request
    asks for torch. ``drafter_threads``: llama.cpp's threads (None: torch's);
    ``drafter_prefill``: when a llama.cpp drafter prefills (``auto``: beside the
    target's prefill where the CPU has cores to spare, ``beside``, ``after``);
    ``drafter_gguf``: ``auto`` reads a Q8_0 copy of a Q4_1 drafter file (it
    prefills 2x faster, :mod:`rapidspec.runtime.gguf_copy`), ``as-is`` the file.
    """

    target: str = "builtin"
    drafter: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    drafter_device: str | None = None
    quantize: str = "auto"
    drafter_quantize: str = "none"
    runtime: str = "auto"
    drafter_backend: str = "auto"
    drafter_threads: int | None = None
    drafter_prefill: str = "auto"
    drafter_gguf: str = "auto"

    def __post_init__(self) -> None:
        for name, allowed in (("dtype", DTYPE_NAMES), ("quantize", TARGET_QUANTIZATIONS), ("drafter_quantize", QUANTIZATIONS),
                              ("runtime", RUNTIMES), ("drafter_backend", DRAFTER_BACKENDS)):
            if getattr(self, name) not in allowed:
                raise RapidspecError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if not self.target or not str(self.target).strip():
            raise RapidspecError("the target model name is empty")
        if self.drafter_prefill not in DRAFTER_PREFILLS:
            raise RapidspecError(f"drafter_prefill must be one of {', '.join(DRAFTER_PREFILLS)}, got {self.drafter_prefill!r}")
        if self.drafter_gguf not in DRAFTER_GGUF_CHOICES:
            raise RapidspecError(f"drafter_gguf must be one of {', '.join(DRAFTER_GGUF_CHOICES)}, got {self.drafter_gguf!r}")
        if self.drafter_threads is not None and self.drafter_threads < 1:
            raise RapidspecError(f"drafter_threads must be >= 1, got {self.drafter_threads}")

    def load(self):
        """(target, drafter): loaded models, the drafter None (self) or a name when llama.cpp reads it."""
        from rapidspec import models  # looked up at call time: tests replace models.load_model

        for name in (self.target, self.drafter):  # a bad name is refused before anything loads
            if name is not None:
                models.check_loadable(name)
        target = models.load_model(self.target, dtype=self.dtype, device=self.device, quantize=self.quantize,
                                   runtime=self.runtime)
        if self.drafter is not None and self._drafter_on_llama_cpp(target):
            return target, self.drafter
        if self.drafter is not None:
            return target, models.load_model(self.drafter, dtype=self.dtype, device=self.drafter_device or self.device,
                                             quantize=self.drafter_quantize, runtime=self.runtime)
        if self.drafter_quantize in ("none", target.quantization):
            return target, None
        # a self-drafter with other weights: a copy of the float target, or the target loaded again
        if target.quantization == "none" and self.drafter_quantize in ROUNDED_QUANTIZATIONS:
            return target, models.low_bit_copy(target, self.drafter_quantize, name="self")
        again = models.load_model(self.target, dtype=self.dtype, device=self.device, quantize=self.drafter_quantize,
                                  runtime=self.runtime)
        return target, replace(again, name="self")

    def _drafter_on_llama_cpp(self, target) -> bool:
        from rapidspec.models.backend import choose_backend

        return self.drafter_quantize == "none" and choose_backend(self.drafter_backend, target, self.drafter) == "llama.cpp"
