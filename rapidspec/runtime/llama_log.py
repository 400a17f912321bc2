"""llama.cpp's log, which it writes to stderr, as records of the Python logger ``llama.cpp``.

llama.cpp reports every model load and context in a hundred lines or more (the
GGUF's metadata, buffer sizes) and warns about things harmless for the models
rapidspec runs (Qwen2.5's GGUFs: "control-looking token ... this is probably
a bug in the model"). :func:`route_llama_log` hands it a callback that logs
each line instead:

=====================  =========================================
llama.cpp's level      record
=====================  =========================================
debug, info            DEBUG
warning                WARNING (INFO for :data:`HARMLESS_WARNINGS`)
error                  ERROR
a line's continuation  DEBUG (the dots of a load's progress)
=====================  =========================================

The ``rapidspec`` command shows the logger's records below ERROR only with
``--verbose``. The callback is kept in this module: llama.cpp calls it for as
long as the process lives, and a collected ctypes callback would crash it.
"""

from __future__ import annotations

import ctypes
import logging
import threading

logger = logging.getLogger("llama.cpp")

#: ggml's log levels (``enum ggml_log_level``: 0 none, 1 debug, 2 info, 3 warn, 4 error, 5 the previous line goes on).
_LEVELS = {0: logging.DEBUG, 1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR, 5: logging.DEBUG}
#: Warnings logged at INFO, and why they are harmless.
HARMLESS_WARNINGS = (
    # Qwen2.5's vocabulary holds '</s>' as an ordinary token and llama.cpp makes it a control token: that changes
    # how llama.cpp tokenizes and prints text, and a drafter on llama.cpp reads and writes token ids only.
    "control-looking token",
)

_callback = None  # llama.cpp's reference to on_log, kept alive
_lock = threading.Lock()


def route_llama_log(ll) -> None:
    """Send llama.cpp's log to :data:`logger` from now on (``ll``: the ``llama_cpp`` module; once per process)."""
    global _callback
    with _lock:
        if _callback is None:
            _callback = ll.llama_log_callback(on_log)
            ll.llama_log_set(_callback, ctypes.c_void_p(0))


def on_log(level: int, text: bytes, user_data) -> None:
    """llama.cpp's log callback: one record per line."""
    record_level = _LEVELS.get(level, logging.WARNING)
    if record_level == logging.DEBUG and not logger.isEnabledFor(logging.DEBUG):
        return  # most lines: skipped before decoding them
    message = text.decode("utf-8", "replace").rstrip()
    if not message:
        return
    if record_level == logging.WARNING and any(harmless in message for harmless in HARMLESS_WARNINGS):
        record_level = logging.INFO
    logger.log(record_level, "%s", message)
