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
Each size is timed several times and the fastest kept (another process can
only add time). Every entry says when it was measured, the load average then
and the share of the machine other processes took meanwhile
(:mod:`~rapidspec.runtime.interference`); an entry measured beside a busy
process is marked ``busy`` and measured again once :data:`RECHECK_S` have
passed since it was measured or last checked, by this process or any other
(``checked_at``: a machine that stays busy pays a measurement every
:data:`RECHECK_S`, not one per process): a quiet measurement replaces it,
another busy one keeps the lower of the two. ``rapidspec calibrate`` measures
on purpose and shows what is kept.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rapidspec.drafting.gamma_schedule import StepCosts
from rapidspec.errors import RapidspecError
from rapidspec.runtime import new_kv_cache
from rapidspec.runtime.attention import machine_key
from rapidspec.runtime.batching import current_batcher, unbatched
from rapidspec.runtime.cache_dir import cache_root, keep_json
from rapidspec.runtime.interference import Watch
from rapidspec.runtime.threads import compute_threads

logger = logging.getLogger(__name__)

COSTS_FILE_NAME = "step_costs.json"
COSTS_FILE_ENV = "RAPIDSPEC_STEP_COSTS"
# 2: int8 layers multiply int8 activations (runtime.dynamic_int8); 3: the fastest of the repeats, entries say when and
# beside how busy a machine they were measured (older entries are measured again); 4: a plain step over a long cache
# costs less on the ``keys`` attention path (runtime.grouped_attention), so costs kept before it are measured again;
# 5: a verification scores the keys up to an aligned count (runtime.attention.aligned_key_rows) and costs less
COSTS_FORMAT = 5
#: Each measured size is timed at least this many times (and until :data:`MIN_SAMPLE_S` have passed, at most
#: :data:`MAX_REPEATS`); the fastest is kept.
REPEATS = 3
MIN_SAMPLE_S = 0.05
MAX_REPEATS = 16
#: A busy entry is measured again once this many seconds have passed since it was measured or last checked.
RECHECK_S = 600.0
#: Tokens a fresh drafter cache prefills to measure its prefill rate (then it steps on them).
DRAFTER_PROBE_TOKENS = 256
#: The smallest context-length bucket; buckets double from here.
MIN_BUCKET = 512
#: Verify costs are measured from forwards of 1 and of this many tokens (at most max_gamma + 1).
VERIFY_PROBE_TOKENS = 8


def _probe_tokens(config) -> int:
    """Tokens of the verification a target's costs are measured with: ``config``'s widest round, at most
    :data:`VERIFY_PROBE_TOKENS`."""
    return min(VERIFY_PROBE_TOKENS, config.max_gamma + 1)


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


def fastest(run: Callable[[], object], device: torch.device, repeats: int = REPEATS) -> float:
    """The fastest of at least ``repeats`` timed calls of ``run``, more while they add up to less than
    :data:`MIN_SAMPLE_S` (at most :data:`MAX_REPEATS`); one untimed call first warms kernels and allocators."""
    run()
    samples = []
    while len(samples) < repeats or (sum(samples) < MIN_SAMPLE_S and len(samples) < MAX_REPEATS):
        samples.append(_timed(run, device))
    return min(samples)


def measure_verify(cache, pending: Sequence[int], tokens: int, repeats: int = REPEATS) -> TargetCosts:
    """v(n) on ``cache`` from forwards of 1 and ``tokens`` tokens (``pending`` then filler), each rolled back.

    ``pending``: the tokens the next round feeds first (one at a round boundary). The cache is left as it was.
    """
    pending = list(pending)
    length, filler = cache.length, pending[-1]
    sizes = (len(pending), max(len(pending) + 1, tokens))
    seconds = {}

    def forward(fed: list[int]) -> None:
        cache.forward(fed, num_logits=len(fed))
        cache.crop(length)

    with unbatched():
        for n in sizes:
            fed = pending + [filler] * (n - len(pending))
            seconds[n] = fastest(lambda fed=fed: forward(fed), cache.device, repeats)
    return line_through(sizes[0], seconds[sizes[0]], sizes[1], seconds[sizes[1]])


def measure_drafter(new_cache: Callable[[int], object], token: int, repeats: int = REPEATS) -> DrafterCosts:
    """A drafter's step and prefill costs on a fresh cache from ``new_cache(capacity)`` (dropped afterwards).

    A first prefill and a first step run untimed (kernels, allocators and the attention paths a runtime picks
    per shape warm up on them); then prefills of :data:`DRAFTER_PROBE_TOKENS` tokens and steps after them, each
    rolled back, are timed and the fastest of each kept (:func:`fastest`; at least ``repeats`` steps).
    """
    capacity = DRAFTER_PROBE_TOKENS + 2

    def prefill() -> None:
        cache.crop(0)
        cache.prefill([token] * DRAFTER_PROBE_TOKENS)

    def step() -> None:
        cache.forward([token], 1)
        cache.crop(DRAFTER_PROBE_TOKENS)

    with unbatched():
        cache = new_cache(capacity)
        cache.reserve(capacity)
        prefill_seconds = fastest(prefill, cache.device, 1)
        step_seconds = fastest(step, cache.device, repeats)
    return DrafterCosts(step_seconds, prefill_seconds / DRAFTER_PROBE_TOKENS)


def measure_embedding(embedder, tokenizer, repeats: int = REPEATS) -> float:
    """Seconds per document token (counted by ``tokenizer``) of ``embedder.encode`` on a synthetic 512-token text."""
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 60)
    tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return fastest(lambda: embedder.encode([text]), torch.device("cpu"), repeats) / max(1, tokens)


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
    :class:`TargetCosts`, :class:`DrafterCosts` or a float) and keeps it; a busy entry is measured again as the
    module says. Thread-safe: a key is measured by one thread at a time. A file that cannot be written (a
    read-only or full folder) keeps the numbers for this process, with one warning per folder and cause
    (:func:`~rapidspec.runtime.cache_dir.cache_write`); entries already in it are read.
    """

    def __init__(self, path: Path | None = None, watch: Callable[[], Watch] = Watch) -> None:
        self.path, self.watch = path, watch
        self._memory: dict[str, dict] = {}
        self._measured_at: dict[str, float] = {}  # monotonic time this process last measured a key
        self.not_kept: dict[str, dict] = {}  # this process's last measurements that were busy and not kept, by key
        self._lock = threading.Lock()

    def file(self) -> Path:
        if self.path is not None:
            return self.path
        override = os.environ.get(COSTS_FILE_ENV)
        return Path(override).expanduser() if override else cache_root() / COSTS_FILE_NAME

    def get(self, kind: type, key: str, measure: Callable[[], object], again: bool = False):
        """The ``kind`` entry (TargetCosts, DrafterCosts or float) of ``key`` on this machine, measured when missing,
        busy and due again, or when ``again``."""
        full_key = f"{key} | {compute_threads()} threads"
        with self._lock:
            kept = self._kept(kind, full_key)
            if again or self._wanted(full_key, kept):
                kept = self._measure(kind, full_key, measure, kept)
            self._memory[full_key] = kept
            return _entry_value(kind, kept)

    def wanted(self, kind: type, key: str) -> bool:
        """Whether :meth:`get` would measure ``key`` now (missing, or busy and due again)."""
        full_key = f"{key} | {compute_threads()} threads"
        with self._lock:
            return self._wanted(full_key, self._kept(kind, full_key))

    def _kept(self, kind: type, full_key: str) -> dict | None:
        kept = self._memory.get(full_key) or self.stored().get(full_key)
        return None if _entry_value(kind, kept) is None else kept

    def _wanted(self, full_key: str, kept: dict | None) -> bool:
        return kept is None or bool(kept.get("busy") and self._due(full_key, kept))

    def _due(self, key: str, kept: dict) -> bool:
        """Whether a busy entry is measured again: :data:`RECHECK_S` after this process measured it, else after
        the entry was measured or last checked by any process (an entry of unknown age: now)."""
        measured = self._measured_at.get(key)
        if measured is not None:
            return time.monotonic() - measured >= RECHECK_S
        try:
            checked = datetime.datetime.fromisoformat(kept.get("checked_at") or kept["measured_at"])
            age = (datetime.datetime.now(datetime.timezone.utc) - checked).total_seconds()
        except (KeyError, TypeError, ValueError):
            return True
        return not 0 <= age < RECHECK_S

    def _measure(self, kind: type, key: str, measure: Callable[[], object], kept: dict | None) -> dict:
        with self.watch() as watch:
            value = measured_alone(measure)
        self._measured_at[key] = time.monotonic()
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        fresh = asdict(value) if kind is not float else {"value": float(value)}
        fresh.update(measured_at=now, load=watch.load, others=watch.others, busy=watch.busy)
        entry = fresh
        if kept is not None and watch.busy:
            if not kept.get("busy"):
                entry = kept  # a quiet measurement is not replaced by a busy one
            elif _total(kind, kept) <= _total(kind, fresh):
                entry = kept  # both busy: the lower, measured again later
        logger.info("measured %s: %s%s (kept in %s)", key, fresh,
                    "" if entry is fresh else "; beside busy processes, so the earlier entry is kept", self.file())
        if entry is fresh:
            self.not_kept.pop(key, None)
            self._write(key, entry)
        else:
            self.not_kept[key] = fresh
            if entry.get("busy"):  # checked now: the next check is RECHECK_S away for every process
                entry = {**entry, "checked_at": now}
                self._write(key, entry)
        return entry

    def stored(self) -> dict[str, dict]:
        """This machine's entries in the costs file, by key."""
        return _read(self.file()).get(machine_key(), {})

    def entries(self) -> list[dict]:
        """The entries this book has read or measured in this process: ``{"key": ..., **entry}`` each (without the
        lock, which a measurement holds: ``/health`` answers while one runs)."""
        return [{"key": key, **entry} for key, entry in list(self._memory.items())]

    def clear(self) -> int:
        """Forget this machine's entries (in the file and in memory); how many the file held."""
        with self._lock:
            path = self.file()
            content = _read(path)
            removed = len(content.pop(machine_key(), {}))
            self._memory.clear()
            self._measured_at.clear()
            if removed:
                self._keep(path, content)
            return removed

    def _write(self, key: str, entry: dict) -> None:
        path = self.file()
        content = _read(path)
        content.setdefault(machine_key(), {})[key] = entry
        self._keep(path, content)

    @staticmethod
    def _keep(path: Path, content: dict) -> None:
        keep_json(path, {"format": COSTS_FORMAT, "machines": content}, f"the measured step costs ({path.name})",
                  "they are kept in memory and measured again by each process")


def _total(kind: type, entry: dict) -> float:
    value = _entry_value(kind, entry)
    return float(value) if kind is float else sum(asdict(value).values())


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
        fields = {name: float(entry[name]) for name in kind.__dataclass_fields__}
        return kind(**fields) if all(math.isfinite(v) and v >= 0 for v in fields.values()) else None
    except (KeyError, TypeError, ValueError):
        return None


class EngineCosts:
    """The calibrated costs of one engine's models, read from (or measured into) ``book``."""

    def __init__(self, book: CostBook, target, drafting, retriever, stop_tokens) -> None:
        self.book, self.target_model, self.drafting, self.retriever = book, target, drafting, retriever
        self._token = next(iter(stop_tokens), 0)  # what a drafter's probe feeds (any token does)

    def target(self, config, cache, seq: Sequence[int], again: bool = False) -> TargetCosts:
        """v(n) of the target at the context bucket of ``seq`` (measured on ``cache``, which holds ``seq[:-1]``)."""
        return self.book.get(TargetCosts, self._target_key(config, len(seq)),
                             lambda: measure_verify(cache, seq[cache.length :], _probe_tokens(config)), again)

    def _target_key(self, config, context: int) -> str:
        model = self.target_model
        return (f"target {model.label} {model.dtype} {model.device.type} {model.runtime} | verify at "
                f"{context_bucket(context)} tokens, n = 1 and {_probe_tokens(config)}")

    def drafter(self, config, again: bool = False) -> DrafterCosts:
        """The step and prefill costs of the drafter ``config`` drafts with."""
        pool = self.drafting.pool(config.drafter_backend)
        return self.book.get(DrafterCosts, self.drafting.costs_key(config),
                             lambda: measure_drafter(pool.new_cache, self._token), again)

    def embedding(self, again: bool = False) -> float:
        """Seconds per document token the engine's retriever embeds."""
        config = self.retriever.config
        key = f"embedder {config.embedding_model} {config.embedding_dtype} on {config.device or 'auto'}"
        return self.book.get(float, key, lambda: measure_embedding(self.retriever.embedder, self.retriever.tokenizer),
                             again)

    def calibrate(self, config, contexts: Sequence[int], again: bool, embedder: bool, chunk_tokens: int,
                  progress=None, held=None) -> None:
        """What :meth:`rapidspec.Rapid.calibrate` measures: ``config``'s model drafter, the embedder (``embedder``
        and a retrieval that embeds), the target's verification at each of ``contexts`` tokens: on ``held(tokens)``,
        a (cache, sequence) pair whose cache holds the sequence but its last token (a copy of a kept cache), else on
        a cache of filler tokens prefilled ``chunk_tokens`` at a time, telling ``progress(done, total)``."""
        limit = self.target_model.max_context - VERIFY_PROBE_TOKENS - 1
        if bad := [n for n in contexts if not 2 <= n <= limit]:
            raise RapidspecError(f"a context to calibrate at must be 2 to {limit} tokens (the target's window less "
                                 f"a verification), got {bad[0]}")
        if self.drafting.drafter_kind(config) == "model":
            self.drafter(config, again)
        if embedder and self.retriever.config.method in ("dense", "hybrid", "auto"):
            self.embedding(again)
        tokenizer = self.target_model.tokenizer
        filler = tokenizer(" the river town kept its boats", add_special_tokens=False)["input_ids"] or [self._token]
        for tokens in contexts:
            if not again and not self.book.wanted(TargetCosts, self._target_key(config, tokens)):
                continue  # kept: no cache to make
            found = held(tokens) if held is not None else None
            if found is not None:
                self.target(config, *found, again)
                continue
            seq = (filler * (tokens // len(filler) + 1))[:tokens]
            cache = new_kv_cache(self.target_model, chunk_tokens)
            cache.reserve(tokens + VERIFY_PROBE_TOKENS)
            for _ in cache.prefill_chunks(seq[:-1], None, progress):
                pass
            self.target(config, cache, seq, again)

    def step_costs(self, config, cache, seq: Sequence[int]) -> StepCosts:
        """What the ``cost`` gamma schedule plans with: the drafter's step and the target's v(n)."""
        target = self.target(config, cache, seq)
        return StepCosts(self.drafter(config).step, target.base, target.per_token)
