"""A rapidspec model written out as a standard Hugging Face folder, for vLLM and transformers.

Contract:

* :func:`export_model` loads a model by any name :func:`~rapidspec.models.loading.load_model`
  accepts (``builtin``, ``builtin:<key>``, a GGUF file, a local folder, a
  cached Hugging Face id; a GGUF is converted once into the cache, as every
  load converts it) and saves it with
  :func:`~rapidspec.models.conversion.save_checkpoint`: ``model.safetensors``
  (the input embedding under its own name even where the output layer shares
  it), ``config.json``, ``generation_config.json``, the tokenizer and its
  chat template.
* Beside them, :data:`EXPORT_RECORD` (``rapidspec.json``) says where the
  folder came from: ``{"model": ..., "gguf": ...}``, the name as given (the
  absolute path for files and folders) and the absolute path of the GGUF
  file it was converted from, or null. RAPID's proposer inside vLLM reads it
  to find its llama.cpp drafter.
* The folder is refused when it exists and is not empty (nothing is
  loaded then); the export is written to a hidden sibling renamed into place,
  so an interrupted one leaves no half folder. Problems the user can fix are
  one-line :class:`~rapidspec.errors.RapidspecError`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from rapidspec.errors import RapidspecError
from rapidspec.models.conversion import save_checkpoint
from rapidspec.models.loading import load_model, resolve_source
from rapidspec.runtime.cache_dir import temporary_path

logger = logging.getLogger(__name__)

__all__ = ["EXPORT_RECORD", "export_model"]

#: The file in an exported folder that names the rapidspec model and GGUF file it came from.
EXPORT_RECORD = "rapidspec.json"


def export_model(name: str, folder: str | Path, dtype: str | torch.dtype = "auto") -> Path:
    """Write model ``name`` to ``folder`` (made here, or empty) as a Hugging Face folder; return its path.

    ``dtype`` is the dtype of the saved weights (``auto``: as
    :func:`~rapidspec.models.devices.resolve_dtype` decides for this machine,
    the dtype rapidspec loads the model in, so a GGUF's cached conversion is
    reused). Raises :class:`RapidspecError` for an unknown name, a folder that
    is not empty, or a folder that cannot be written.
    """
    target = Path(folder).expanduser().absolute()
    _check_target(target)
    source, gguf = resolve_source(name)
    start = time.perf_counter()
    loaded = load_model(name, dtype=dtype, device="cpu", attention="sdpa", quantize="none", runtime="transformers")
    builtin = name.strip().lower() == "builtin" or name.strip().lower().startswith("builtin:")
    record = {"model": name.strip() if builtin or not Path(source).exists() else source,
              "gguf": None if gguf is None else str(gguf)}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = temporary_path(target)  # its writer's pid in its name (rapidspec.runtime.cache_dir)
        temporary.mkdir(mode=0o700)
    except OSError as err:
        raise _cannot_write(target, err) from None
    try:
        save_checkpoint(loaded.model, loaded.tokenizer, temporary)
        (temporary / EXPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        mask = _umask()  # the folder is made 0700, safetensors its file 0600: make them like any others
        for written in temporary.iterdir():
            os.chmod(written, 0o666 & ~mask)
        os.chmod(temporary, 0o777 & ~mask)
        os.replace(temporary, target)  # replaces an empty folder too
    except OSError as err:
        raise _cannot_write(target, err) from None
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    logger.info("exported %s (%s) to %s in %.1f s", name, loaded.dtype, target, time.perf_counter() - start)
    return target


def _check_target(target: Path) -> None:
    """A RapidspecError unless ``target`` is missing or an empty folder."""
    if target.is_dir():
        if any(target.iterdir()):
            raise RapidspecError(f"{target} is not empty: export into a new or empty folder")
    elif target.exists():
        raise RapidspecError(f"{target} is a file: export into a new or empty folder")


def _cannot_write(target: Path, err: OSError) -> RapidspecError:
    return RapidspecError(f"cannot write the exported model to {target} ({err.strerror or err}): nothing was "
                          "written; free some space there or choose another folder")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
