"""Step costs measured once per machine and kept: what the drafter's start and the gamma schedule decide from.

The choices of a generation (whether the drafter is worth preparing, how many
tokens a round drafts, whether a round is a plain step) come from these
numbers and from the answer's own acceptance, never from a round's wall-clock
time, so a greedy request gets the same answer alone, in a batch, or on a busy
machine. Each number is measured the first time an engine needs it and kept
in ``step_costs.json`` in the rapidspec cache directory (or
``$RAPIDSPEC_STEP_COSTS``), under the machine (:func:`~rapidspec.runtime.attention.machine_key`),
the model and its threads; later engines on the machine read it. Delete the
file to measure again (after a hardware or software change).

* ``target``: verifying n tokens costs ``v(n) = base + per_token * n`` seconds,
  per context-length bucket (:func:`context_bucket`): measured on the
  generation's own cache at its first round boundary (a few forwards over
  n = 1 and n = gamma + 1 filler tokens, rolled back; the median of
  :data:`REPEATS`), so a bucket costs its first answer those forwards once.
* ``drafter``: seconds per drafter step and per prefilled token: a fresh
  drafter cache prefills :data:`DRAFTER_PROBE_TOKENS` tokens, then steps.
* ``embedder``: seconds per embedded document token (the retriever's dense
  index of a document not embedded yet).

Measurements run outside any batched tick (alone, on the calling thread's
torch threads), so a server's first requests measure what one request costs.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rapidspec.drafting.gamma_schedule import StepCosts
from rapidspec.runtime.attention import machine_key
from rapidspec.runtime.batching import current_batcher, unbatched
from rapidspec.runtime.cache_dir import cache_root, keep_json
from rapidspec.runtime.threads import compute_threads

logger = logging.getLogger(__name__)

COSTS_FILE_NAME = "step_costs.json"
COSTS_FILE_ENV = "RAPIDSPEC_STEP_COSTS"
COSTS_FORMAT = 2  # 2: int8 layers multiply int8 activations (runtime.dynamic_int8); costs measured before are stale
#: Each measured size is timed this many times; the median is kept.
REPEATS = 3
#: Tokens a fresh drafter cache prefills to measure its prefill rate (then it steps on them).
DRAFTER_PROBE_TOKENS = 256
#: The smallest context-length bucket; buckets double from here.
MIN_BUCKET = 512
#: Verify costs are measured from forwards of 1 and of this many tokens (at most max_gamma + 1).
VERIFY_PROBE_TOKENS = 8


def context_bucket(tokens: int) -> int:
    """The bucket of a context of ``tokens`` tokens: the power of two at or above it, at least :data:`MIN_BUCKET`.

    Example: 300 -> 512, 7000 -> 8192, 8192 -> 8192.
    """
    return max(MIN_BUCKET, 1 << max(0, tokens - 1).bit_length())


@dataclass(frozen=True)
class TargetCosts:
    """Seconds to verify n tokens at one context bucket: ``verify(n) = base + per_token * n`` (both >= 0)."""

    base: float
    per_token: float

    def verify(self, tokens: int) -> float:
        return self.base + self.per_token * tokens


@dataclass(frozen=True)
class DrafterCosts:
    """Seconds of one drafter step (one token after a short context) and per token of its prefill."""

    step: float
    prefill_per_token: float


def line_through(n1: int, s1: float, n2: int, s2: float) -> TargetCosts:
    """The line through (n1, s1) and (n2, s2) with a slope and a base kept >= 0.

    Example: (1, 0.05), (8, 0.12) -> base 0.04, per_token 0.01.
    """
    per_token = max(0.0, (s2 - s1) / (n2 - n1)) if n2 != n1 else 0.0
    return TargetCosts(max(0.0, s1 - per_token * n1), per_token)


def _timed(run: Callable[[], object], device: torch.device) -> float:
    started = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def measure_verify(cache, pending: Sequence[int], tokens: int, repeats: int = REPEATS) -> TargetCosts:
    """v(n) on ``cache`` from forwards of 1 and ``tokens`` tokens (``pending`` then filler), each rolled back.

    ``pending``: the tokens the next round feeds first (one at a round boundary). The cache is left as it was.
    """
    pending = list(pending)
    length, filler = cache.length, pending[-1]
    sizes = (len(pending), max(len(pending) + 1, tokens))
    seconds = {}
    with unbatched():
        for n in sizes:
            fed = pending + [filler] * (n - len(pending))
            samples = []
            for _ in range(repeats + 1):  # the first call warms kernels and allocators: not kept
                samples.append(_timed(lambda fed=fed, n=n: cache.forward(fed, num_logits=n), cache.device))
                cache.crop(length)
            seconds[n] = statistics.median(samples[1:])
    return line_through(sizes[0], seconds[sizes[0]], sizes[1], seconds[sizes[1]])


def measure_drafter(new_cache: Callable[[int], object], token: int, repeats: int = REPEATS) -> DrafterCosts:
    """A drafter's step and prefill costs on a fresh cache from ``new_cache(capacity)`` (dropped afterwards).

    A first prefill and steps at the measured lengths run untimed first (kernels, allocators and the attention
    paths a runtime picks per shape warm up on them); then a prefill of :data:`DRAFTER_PROBE_TOKENS` tokens and
    ``repeats`` steps after it are timed.
    """
    capacity = DRAFTER_PROBE_TOKENS + 2 * repeats + 2
    with unbatched():
        cache = new_cache(capacity)
        cache.reserve(capacity)
        cache.prefill([token] * DRAFTER_PROBE_TOKENS)
        for _ in range(repeats):
            cache.forward([token], 1)
        cache.crop(0)
        prefill = _timed(lambda: cache.prefill([token] * DRAFTER_PROBE_TOKENS), cache.device)
        steps = [_timed(lambda: cache.forward([token], 1), cache.device) for _ in range(repeats)]
    return DrafterCosts(statistics.median(steps), prefill / DRAFTER_PROBE_TOKENS)


def measure_embedding(embedder, tokenizer, repeats: int = REPEATS) -> float:
    """Seconds per document token (counted by ``tokenizer``) of ``embedder.encode`` on a synthetic 512-token text."""
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 60)
    tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    embedder.encode([text])  # warm-up
    seconds = [_timed(lambda: embedder.encode([text]), torch.device("cpu")) for _ in range(repeats)]
    return statistics.median(seconds) / max(1, tokens)


def measured_alone(measure: Callable[[], object]):
    """``measure()`` alone: inside a server's batched tick on the thread with torch's threads
    (:meth:`~rapidspec.runtime.batching.ForwardBatcher.call`), never as a row of the tick's forwards."""
    batcher = current_batcher()
    if batcher is None:
        return measure()

    def alone():
        with unbatched():
            return measure()

    return batcher.call(alone)


class CostBook:
    """The kept costs of one machine: read from and written to the costs file, one entry per key.

    ``get(kind, key, measure)`` returns the kept entry or measures it (``measure()`` returns a
    :class:`TargetCosts`, :class:`DrafterCosts` or a float) and keeps it. Thread-safe: a key is measured once.
    A file that cannot be written (a read-only or full folder) keeps the numbers for this process, with one
    warning per folder and cause (:func:`~rapidspec.runtime.cache_dir.cache_write`); entries already in it are read.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._memory: dict[str, dict] = {}
        self._lock = threading.Lock()

    def file(self) -> Path:
        if self.path is not None:
            return self.path
        override = os.environ.get(COSTS_FILE_ENV)
        return Path(override).expanduser() if override else cache_root() / COSTS_FILE_NAME

    def get(self, kind: type, key: str, measure: Callable[[], object]):
        """The ``kind`` entry (TargetCosts, DrafterCosts or float) of ``key`` on this machine, measured when missing."""
        full_key = f"{key} | {compute_threads()} threads"
        with self._lock:
            entry = self._memory.get(full_key) or _read(self.file()).get(machine_key(), {}).get(full_key)
            value = _entry_value(kind, entry)
            if value is None:
                value = measured_alone(measure)
                entry = asdict(value) if kind is not float else {"value": float(value)}
                logger.info("measured %s: %s (kept in %s)", full_key, entry, self.file())
                self._write(full_key, entry)
            self._memory[full_key] = entry
            return value

    def _write(self, key: str, entry: dict) -> None:
        path = self.file()
        content = _read(path)
        content.setdefault(machine_key(), {})[key] = entry
        keep_json(path, {"format": COSTS_FORMAT, "machines": content}, f"the measured step costs ({path.name})",
                  "they are kept in memory and measured again by each process")


def _read(path: Path) -> dict[str, dict[str, dict]]:
    """{machine: {key: entry}} of the costs file; {} when missing, unreadable or of another format."""
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(content, dict) or content.get("format") != COSTS_FORMAT or not isinstance(content.get("machines"), dict):
        return {}
    return {m: v for m, v in content["machines"].items() if isinstance(v, dict)}


def _entry_value(kind: type, entry: object):
    """The entry as ``kind``, or None when it is missing or malformed (then it is measured again)."""
    if not isinstance(entry, dict):
        return None
    try:
        if kind is float:
            value = float(entry["value"])
            return value if math.isfinite(value) and value >= 0 else None
        value = kind(**{name: float(entry[name]) for name in kind.__dataclass_fields__})
    except (KeyError, TypeError, ValueError):
        return None
    return value if all(math.isfinite(v) and v >= 0 for v in asdict(value).values()) else None


class EngineCosts:
    """The calibrated costs of one engine's models, read from (or measured into) ``book``."""

    def __init__(self, book: CostBook, target, drafting, retriever, stop_tokens) -> None:
        self.book, self.target_model, self.drafting, self.retriever = book, target, drafting, retriever
        self._token = next(iter(stop_tokens), 0)  # what a drafter's probe feeds (any token does)

    def target(self, config, cache, seq: Sequence[int]) -> TargetCosts:
        """v(n) of the target at the context bucket of ``seq`` (measured on ``cache``, which holds ``seq[:-1]``)."""
        tokens = min(VERIFY_PROBE_TOKENS, config.max_gamma + 1)
        model = self.target_model
        key = (f"target {model.label} {model.dtype} {model.device.type} {model.runtime} | verify at "
               f"{context_bucket(len(seq))} tokens, n = 1 and {tokens}")
        return self.book.get(TargetCosts, key, lambda: measure_verify(cache, seq[cache.length :], tokens))

    def drafter(self, config) -> DrafterCosts:
        """The step and prefill costs of the drafter ``config`` drafts with."""
        pool = self.drafting.pool(config.drafter_backend)
        return self.book.get(DrafterCosts, self.drafting.costs_key(config),
                             lambda: measure_drafter(pool.new_cache, self._token))

    def embedding(self) -> float:
        """Seconds per document token the engine's retriever embeds."""
        config = self.retriever.config
        key = f"embedder {config.embedding_model} {config.embedding_dtype} on {config.device or 'auto'}"
        return self.book.get(float, key, lambda: measure_embedding(self.retriever.embedder, self.retriever.tokenizer))

    def step_costs(self, config, cache, seq: Sequence[int]) -> StepCosts:
        """What the ``cost`` gamma schedule plans with: the drafter's step and the target's v(n)."""
        target = self.target(config, cache, seq)
        return StepCosts(self.drafter(config).step, target.base, target.per_token)
