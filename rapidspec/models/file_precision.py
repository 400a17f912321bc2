"""A GGUF target's low-bit layers, built from the file once and kept beside its conversion.

Building the layers (:mod:`rapidspec.runtime.gguf_linears`) reads the file's
metadata (a 150K-token vocabulary parsed in Python), de-quantises the blocks
that become int8 and rounds them again: seconds on every load. The layers'
tensors are therefore written to ``file-precision.safetensors`` in the
conversion's cache folder (:func:`~rapidspec.models.conversion.gguf_cache_dir`,
whose key hashes the file, the dtype and the transformers version) and later
loads read them back. Written by a rename (:func:`~rapidspec.runtime.cache_dir.cache_write`),
so a reader never sees half a file; one that cannot be read (corrupt,
truncated, another layout) is logged, removed and built again; a cache folder
that cannot take it only costs the next load the build again.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from rapidspec.models.conversion import gguf_cache_dir
from rapidspec.runtime.cache_dir import cache_write, remove_quietly
from rapidspec.runtime.gguf_linears import file_layers, layer_from_tensors, layer_tensors, replace_layers

logger = logging.getLogger(__name__)

FILE_NAME = "file-precision.safetensors"
#: Bumped when what the file holds changes; a file of another format is built again.
FORMAT = "1"


def _cached(model: nn.Module, path: Path) -> dict[str, nn.Module | None] | None:
    """The layers kept in ``path`` for ``model``, or None (missing, or unreadable: then removed)."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as kept:
            meta = kept.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, not {FORMAT}")
            names = set(kept.keys())
            layers = {}
            for module_path in json.loads(meta["layers"]):
                prefix = f"{module_path}."
                # cloned: PyTorch's int8 kernel crashed (a segmentation fault) on tensors read straight from the file
                own = {name[len(prefix):]: kept.get_tensor(name).clone() for name in names if name.startswith(prefix)}
                layers[module_path] = layer_from_tensors(own, model.get_submodule(module_path).bias) if own else None
        return layers
    except Exception as err:  # noqa: BLE001 - any unreadable file is built again
        logger.warning("the kept low-bit layers in %s cannot be read (%s): building them again", path, err)
        remove_quietly(path)
        return None


def _keep(layers: dict[str, nn.Module | None], path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {f"{module_path}.{name}": tensor.contiguous() for module_path, layer in layers.items() if layer is not None
               for name, tensor in layer_tensors(layer).items()}
    meta = {"format": FORMAT, "layers": json.dumps(list(layers))}
    cache_write(path, lambda temporary: save_file(tensors, str(temporary), metadata=meta),
                f"the low-bit layers of {path.parent.name}", "building them on every load")


def file_precision(model: nn.Module, gguf_path: Path, dtype: torch.dtype) -> dict[str, int]:
    """Give ``model`` (loaded from ``gguf_path`` in ``dtype``) its layers at the file's precision, kept or built.

    Returns the counts of :func:`~rapidspec.runtime.gguf_linears.replace_layers`;
    :class:`~rapidspec.runtime.errors.QuantizationError` as :func:`~rapidspec.runtime.gguf_linears.file_layers`.
    """
    path = gguf_cache_dir(gguf_path, dtype) / FILE_NAME
    layers = _cached(model, path)
    if layers is None:
        layers = file_layers(model, gguf_path)
        if path.parent.is_dir():
            _keep(layers, path)
    counts = replace_layers(model, layers)
    logger.info("%s at the file's precision: %s", gguf_path.name, counts)
    return counts
