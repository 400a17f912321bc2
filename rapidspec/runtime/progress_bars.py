"""transformers' progress bars ("Loading weights", "Writing model shards") only where the caller asked for progress.

transformers draws a tqdm bar on stderr for every model it loads or saves: a
few lines of noise before every command's answer. rapidspec shows them only
when this module's logger is enabled for INFO (``rapidspec --verbose``, or a
program's own ``logging`` set-up); model loads run inside
:func:`loading_bars`, which otherwise hands transformers disabled bars for
that block. The one bar transformers draws with plain tqdm, the GGUF
de-quantization's on a model's first load, is taken off stderr by
:func:`plain_bar_hidden`. transformers' own switch (``disable_progress_bar``)
and huggingface_hub's download bars are left as they are.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_depth = 0  # blocks inside loading_bars() that hide the bars, on any thread
_previous_hook = None  # transformers' tqdm hook before the first of them


@contextmanager
def loading_bars() -> Iterator[None]:
    """A block whose transformers progress bars show only when :data:`logger` is enabled for INFO."""
    if logger.isEnabledFor(logging.INFO):
        yield
        return
    from transformers.utils import logging as hf_logging

    global _depth, _previous_hook
    with _lock:
        if _depth == 0:
            _previous_hook = hf_logging.set_tqdm_hook(_disabled)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                hf_logging.set_tqdm_hook(_previous_hook)


def _disabled(factory, args, kwargs):
    """transformers' tqdm hook: the bar it would make, disabled (it still iterates)."""
    kwargs = {**kwargs, "disable": True}
    return factory(*args, **kwargs) if _previous_hook is None else _previous_hook(factory, args, kwargs)


class _WithoutBar:
    """A text stream that forwards everything but the lines of one tqdm bar (named by its description)."""

    def __init__(self, stream, description: str) -> None:
        self._stream, self._description, self._dropped = stream, description, False

    def write(self, text: str) -> int:
        if self._description in text or (self._dropped and text == "\n"):  # the bar's redraws, then its closing newline
            self._dropped = text != "\n"
            return len(text)
        self._dropped = False
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextmanager
def plain_bar_hidden(description: str) -> Iterator[None]:
    """A block in which a plain tqdm bar (one transformers draws outside its tqdm hook, e.g. the GGUF
    de-quantization's) is left off stderr unless :data:`logger` is enabled for INFO; all else on stderr passes."""
    if logger.isEnabledFor(logging.INFO):
        yield
        return
    with contextlib.redirect_stderr(_WithoutBar(sys.stderr, description)):
        yield
