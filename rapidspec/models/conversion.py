"""GGUF files converted once to safetensors folders in the cache, or for one load where the cache cannot take them.

transformers de-quantizes a GGUF file (the built-in model is one) in about
20 s on 2 CPU cores; the result is kept as an ordinary safetensors folder in
``<cache>/gguf/`` (:func:`gguf_cache_dir`), written to a temporary sibling
renamed into place, so an interrupted conversion never leaves a broken entry,
and later loads read it in a few seconds.

A conversion is a standard Hugging Face folder (:func:`save_checkpoint`):
safetensors weights with the input embedding under its own name even where
the output layer shares it (transformers ties the two again on load; vLLM
reads ``model.embed_tokens.weight`` and would otherwise start from an empty
embedding), the config, the generation config, the tokenizer and its chat
template (``chat_template.jinja``).

Where the cache folder cannot take it (read-only, full:
:func:`~rapidspec.runtime.cache_dir.cache_write` removes what was written and
logs one warning per folder and cause), the conversion goes to a temporary
folder (``$TMPDIR``) that the load removes once the weights are read, and the
next load converts again. Where neither can take it, the load is a one-line
:class:`~rapidspec.errors.RapidspecError`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import struct
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from rapidspec.errors import RapidspecError
from rapidspec.runtime.cache_dir import cache_root, cache_write, remove_quietly
from rapidspec.runtime.progress_bars import loading_bars, plain_bar_hidden

logger = logging.getLogger(__name__)

# Bumped when the layout of a cached conversion changes, invalidating old ones
# (2: the tied input embedding is written under its own name too).
_CACHE_FORMAT = 2
#: Bytes read from each end of a GGUF file for its conversion's cache key.
_KEY_SAMPLE_BYTES = 1 << 20


def gguf_cache_dir(gguf_path: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Cache directory of the de-quantized conversion of ``gguf_path`` to ``dtype``.

    The key hashes the file's content (its size and its first and last
    :data:`_KEY_SAMPLE_BYTES`: a GGUF's header names its tensors and their
    types, its tail holds the last weights), the dtype the weights are stored
    in (a model used in bfloat16 is cached in bfloat16: half the disk and
    memory of float32) plus the transformers version (a new converter may
    produce different weights). Not the file's modification time: a
    reinstalled package with the same weights reuses its conversion instead of
    leaving the old one behind.
    """
    import transformers

    size = gguf_path.stat().st_size
    content = hashlib.sha256(str(size).encode())
    with gguf_path.open("rb") as handle:
        content.update(handle.read(_KEY_SAMPLE_BYTES))
        handle.seek(max(0, size - _KEY_SAMPLE_BYTES))
        content.update(handle.read(_KEY_SAMPLE_BYTES))
    stored = "" if dtype == torch.float32 else f"|{dtype}"
    key_text = f"{_CACHE_FORMAT}|{gguf_path.name}|{content.hexdigest()}|{transformers.__version__}{stored}"
    digest = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{digest}"


def gguf_conversion(gguf_path: Path, dtype: torch.dtype) -> tuple[Path, Path | None]:
    """(the folder to load ``gguf_path`` converted to ``dtype`` from, a scratch folder to remove after loading).

    The folder is the cached conversion, made now when missing (scratch None);
    where the cache folder cannot take it, a temporary folder, which is also
    the scratch folder. Raises :class:`RapidspecError` for a file that is not
    a readable GGUF, or when no folder can take the conversion.
    """
    cached = gguf_cache_dir(gguf_path, dtype)
    if (cached / "model.safetensors").is_file():
        logger.info("using cached conversion of %s: %s", gguf_path.name, cached)
        return cached, None
    logger.info("converting GGUF %s to %s (once; cached in %s)", gguf_path, dtype, cached)
    start = time.perf_counter()
    model, tokenizer = _read_gguf(gguf_path, dtype)
    _remove_stale_temporaries(cached)
    if cache_write(cached, lambda folder: save_checkpoint(model, tokenizer, folder),
                   f"the conversion of {gguf_path.name}", "converting into a temporary folder removed after loading"):
        logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
        return cached, None
    return _scratch_conversion(model, tokenizer, gguf_path, cached.parent)


def _scratch_conversion(model, tokenizer, gguf_path: Path, cache_folder: Path) -> tuple[Path, Path]:
    """(the conversion saved in a new temporary folder, that folder); RapidspecError where it cannot be saved."""
    scratch: Path | None = None
    try:
        scratch = Path(tempfile.mkdtemp(prefix="rapidspec-gguf-"))
        save_checkpoint(model, tokenizer, scratch / "model")
    except OSError as err:
        _remove_scratch(scratch)
        raise RapidspecError(f"cannot convert {gguf_path.name}: neither the cache folder {cache_folder} nor the "
                             f"temporary folder {tempfile.gettempdir()} can take it ({err.strerror or err}); free some "
                             "space or set RAPIDSPEC_CACHE or TMPDIR to a writable folder") from None
    except BaseException:
        _remove_scratch(scratch)
        raise
    return scratch / "model", scratch


def _remove_scratch(scratch: Path | None) -> None:
    if scratch is not None:
        remove_quietly(scratch)


#: The description of transformers' de-quantization bar (a plain tqdm bar, hidden unless --verbose).
GGUF_BAR = "Converting and de-quantizing GGUF tensors"
#: transformers' advice to read packed GGUF weights in float32: about computing with the packed weights, which
#: rapidspec never does (it saves them de-quantized in its dtype), so it is shown only with --verbose.
PACKED_ADVICE = "weights packed is fastest in float32"


class _WithoutPackedAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return PACKED_ADVICE not in record.getMessage() or logger.isEnabledFor(logging.INFO)


@contextmanager
def without_packed_advice():
    """A block in which transformers' GGUF quantizer does not log :data:`PACKED_ADVICE` (unless --verbose)."""
    advising = logging.getLogger("transformers.quantizers.quantizer_gguf")
    quiet = _WithoutPackedAdvice()
    advising.addFilter(quiet)
    try:
        yield
    finally:
        advising.removeFilter(quiet)


def _read_gguf(gguf_path: Path, dtype: torch.dtype):
    """(model, tokenizer) de-quantized from ``gguf_path`` by transformers (its progress bar of the de-quantization
    only where logging asks for progress, :mod:`rapidspec.runtime.progress_bars`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with loading_bars(), plain_bar_hidden(GGUF_BAR), without_packed_advice():
            model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError, struct.error, EOFError) as exc:  # a truncated or foreign file
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RapidspecError(f"cannot read the GGUF file {gguf_path}: {first_line}") from None
    return model, tokenizer


def save_checkpoint(model, tokenizer, folder: Path) -> None:
    """Save ``model`` (GGUF-loaded or not) and its tokenizer as a Hugging Face folder ``folder`` (made if missing).

    ``save_pretrained`` refuses GGUF-loaded models, so the weights go through
    :func:`_save_weights` and the config is saved without its quantization
    entry; the generation config and the tokenizer (with its chat template)
    are saved beside them.
    """
    folder.mkdir(exist_ok=True)
    _save_weights(model, folder / "model.safetensors")
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(folder))
    model.generation_config.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


def _save_weights(model, path: Path) -> None:
    """Every tensor of ``model``'s state dict under its own name, in one safetensors file.

    Tied weights (the output layer sharing the input embedding) are written
    once per name: :func:`safetensors.torch.save_model` would keep one name
    only, and loaders that do not tie (vLLM reads ``model.embed_tokens.weight``
    and skips ``lm_head.weight`` when the config ties them) need the
    embedding's. transformers loads both names without a warning and ties the
    two again. I/O errors (``SafetensorError``: "... (os error 28)") are
    raised as ``OSError``, as every other write raises them.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().contiguous()
        if tensor.untyped_storage().data_ptr() in seen:  # a tied weight: its own copy, as safetensors stores no aliases
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as err:
        found = re.search(r"os error (\d+)", str(err))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


def _remove_stale_temporaries(target: Path, max_age_s: float = 3600.0) -> None:
    """Delete temporary siblings of ``target`` left by a killed conversion.

    Only those older than ``max_age_s`` go, so a conversion running in
    another process right now is left alone.
    """
    now = time.time()
    for leftover in target.parent.glob(f".{target.name}.*"):
        try:
            if now - leftover.stat().st_mtime > max_age_s:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass
