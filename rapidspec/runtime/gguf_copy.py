"""A copy of a GGUF file in weights llama.cpp prefills fast on CPU, made once with llama.cpp's own quantizer.

llama.cpp's CPU backend multiplies a prompt's rows by blocked matrix kernels
for most weight types, but not for ``Q4_1``, whose prompt forward goes row by
row. A llama.cpp drafter prefills its prompt (the retrieved text) on every
request, so for such a file the drafter reads a ``Q8_0`` copy instead: 8 bits
hold each 4-bit weight of ``Q4_1`` within a small fraction of its step, and
the decode step costs the same. Measured on a 2-core AMD EPYC with AVX-512
(2026-11-26, the built-in SmolLM2-135M, a 420-token prompt, 2 threads):
``Q4_1`` prefilled in 0.92 s and stepped in 6.7 ms, its ``Q8_0`` copy 0.46 s
and 6.8 ms.

The copy is written by ``llama_model_quantize`` (requantizing allowed) into
``gguf-copies/`` in the rapidspec cache directory, named by the source's name, size
and modification time, and made once (a fraction of a second for the
built-in model's 98 MB); later loads find it there. Writing a copy removes
the copies of earlier versions of a file of that name (the same model
installed again has another modification time), so each name keeps one. Where it cannot be
written (a read-only or full cache folder) nothing partial is left, one
warning per folder and cause says so
(:func:`~rapidspec.runtime.cache_dir.cache_write`), and the drafter pool
reads the file as it is.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import shutil
from pathlib import Path

from rapidspec.runtime.cache_dir import cache_root, cache_write, remove_quietly

logger = logging.getLogger(__name__)

#: GGUF weight types llama.cpp prefills without blocked kernels on CPU, and the type of their copy.
FAST_PREFILL_TYPES = {"Q4_1": "Q8_0"}


def weight_type(description: str) -> str:
    """The weight type in a llama.cpp model description (architecture, size, type): ``Q4_1`` in
    ``llama 256M Q4_1``, ``Q4_K - Medium`` in ``qwen2 1B Q4_K - Medium``."""
    return description.split(" ", 2)[-1]


#: A weight type closing a GGUF file's name: ``.Q4_1`` in ``SmolLM2-135M-Instruct.Q4_1``, ``-q4_k_m``, ``-F16``.
_TYPE_IN_NAME = re.compile(r"[.\-_](?:I?Q\d\w*|B?F16|F32)$", re.IGNORECASE)


def model_name(path: Path) -> str:
    """The model a GGUF file holds, by the file's name without its weight type: ``SmolLM2-135M-Instruct`` for
    ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Not the file's ``general.name``: the built-in model's reads ``Smollm2 135M 8k Lc100K Mix1 Ep2`` (its training
    run), Qwen2.5-Coder 0.5B's ``Qwen2.5 Coder 0.5B Instruct AWQ``. Nor llama.cpp's description, which gives the
    architecture and a size it guesses from the layer count (``llama 256M`` for the 135M model, ``qwen2 1B`` for
    the 0.5B one).
    """
    return _TYPE_IN_NAME.sub("", path.stem) or path.stem


def weights_label(description: str, source_description: str | None = None) -> str:
    """The weight type of a llama.cpp model (``Q4_1``), or of its fast-prefill copy (``Q8_0 copy of Q4_1``)."""
    kind = weight_type(description)
    return kind if source_description is None else f"{kind} copy of {weight_type(source_description)}"


def copy_type(description: str) -> str | None:
    """The type a file of this description is copied to for fast prefill (None: it is read as it is)."""
    return FAST_PREFILL_TYPES.get(weight_type(description))


def copy_path(source: Path, kind: str) -> Path:
    """Where the ``kind`` copy of ``source`` lives in the cache directory."""
    stat = source.stat()
    return cache_root() / "gguf-copies" / f"{source.stem}.{stat.st_size}-{stat.st_mtime_ns}.{kind}.gguf"


def fast_prefill_copy(source: Path, kind: str, threads: int) -> Path | None:
    """The ``kind`` copy of ``source``, written now unless the cache holds it already; None where the cache
    folder cannot take it (logged once per folder and cause). ``ValueError`` when llama.cpp cannot copy it."""
    target = copy_path(source, kind)
    if target.is_file():
        return target
    logger.info("writing a %s copy of %s for fast llama.cpp prefill: %s", kind, source.name, target)
    without = f"no {kind} copy for fast prefill, the drafter reads the file as it is"
    written = cache_write(target, lambda partial: _quantize(source, partial, kind, threads),
                          f"a {kind} copy of {source.name}", without)
    if written:
        _drop_older_copies(target, source, kind)
    return target if written else None


def _drop_older_copies(target: Path, source: Path, kind: str) -> None:
    """Remove the ``kind`` copies of earlier versions of a file named as ``source`` (another size or modification
    time: the same model installed again, or replaced), so each file name keeps one copy. A process still reading
    one keeps its mapping; the next load of that version writes its copy again."""
    pattern = re.compile(rf"{re.escape(source.stem)}\.\d+-\d+\.{re.escape(kind)}\.gguf")
    for old in target.parent.iterdir():
        if old != target and pattern.fullmatch(old.name):
            logger.info("removing %s, the %s copy of an earlier %s", old, kind, source.name)
            remove_quietly(old)


def _quantize(source: Path, partial: Path, kind: str, threads: int) -> None:
    """Write the ``kind`` copy of ``source`` to ``partial`` with llama.cpp's quantizer.

    llama.cpp reports a failed write only by a status, so a folder that cannot
    take a file fails first, on creating it, and a status with less room left
    than ``source`` takes is a full disk (``OSError`` ENOSPC).
    """
    from rapidspec.runtime.llama_cpp import bindings

    ll = bindings()
    partial.touch(exist_ok=False)  # read-only or not writable: OSError here, with its errno
    params = ll.llama_model_quantize_default_params()
    params.ftype = getattr(ll, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.allow_requantize = True
    params.nthread = threads
    status = ll.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
    if status == 0:
        return
    if shutil.disk_usage(partial.parent).free < source.stat().st_size:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial.parent))
    raise ValueError(f"llama.cpp could not write a {kind} copy of {source} (status {status})")
