"""Key/value blocks on disk, so a document read once is read from disk by every later process.

After a generation the engine hands its target cache to :meth:`DiskKVStore.write`;
a thread of the store writes the keys and values of every block
(:mod:`~rapidspec.runtime.kv_blocks`: up to 256 tokens each, named by the
tokens before them and their own) that the folder does not hold yet, one file
per block. A longer prompt reuses a shorter one's blocks, so a new question
about a document writes only the blocks after the document. Before a prefill
the engine asks :meth:`DiskKVStore.extend` to append to its cache the blocks
that continue it along the prompt: whole ones while they match, then the
first tokens of the block that matches longest where the prompt goes on
differently (the question after a document), so only the prompt's own tail is
prefilled.

Reading checks each file's format, model key, place and checksum; a partial,
corrupt, foreign or stale file is logged (the first one per folder at WARNING),
removed and never loaded, and the prompt is prefilled from there. Writes go
to a temporary name and are renamed
(:func:`~rapidspec.runtime.cache_dir.cache_write`), so two processes writing
the same block leave one good file; a read-only or full folder is logged once
and the engine goes on from memory. Beyond ``max_bytes`` (all models
together) the least recently used files, by modification time (touched on
every read), are removed.

Layout: ``<folder>/<model key>/<block>.safetensors``, and ``model.json`` naming
the model there (what ``rapidspec cache ls`` shows); ``<folder>`` is
``$RAPIDSPEC_KV_CACHE`` if set, else ``<cache>/kv`` (:func:`directory`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from rapidspec.runtime.cache import common_prefix_length
from rapidspec.runtime.cache_dir import cache_root, cache_write, keep_json, remove_quietly
from rapidspec.runtime.kv_blocks import (BLOCK_TOKENS, FORMAT, SUFFIX, block_name, block_tokens, model_key,
                                         prefix_hashes, read_block, save_block)
from rapidspec.runtime.protocol import KVCacheProtocol
from rapidspec.runtime.quantization import int8_numerics
from rapidspec.runtime.threads import helper_thread

logger = logging.getLogger(__name__)

#: Caches shorter than this are neither written nor looked up (their prefill is cheaper than the files).
MIN_TOKENS = 1024
#: The fewest tokens beyond what a cache holds that are worth reading (a shared template's first tokens are not).
MIN_READ_TOKENS = 64
MODEL_FILE = "model.json"
#: Writes that may wait for the writer thread; beyond them a cache is not written (each holds a cache in memory).
MAX_PENDING_WRITES = 2

_warned: set[str] = set()
_warned_lock = threading.Lock()


def directory(folder: Path | str | None = None) -> Path:
    """``folder`` when given, else ``$RAPIDSPEC_KV_CACHE`` if set, else ``<cache>/kv`` (read on every call)."""
    if folder is not None:
        return Path(folder).expanduser()
    if os.environ.get("RAPIDSPEC_KV_CACHE"):
        return Path(os.environ["RAPIDSPEC_KV_CACHE"]).expanduser()
    return cache_root() / "kv"


def for_model(loaded, max_bytes: int, folder: Path | str | None = None) -> DiskKVStore:
    """The store of ``loaded`` (a :class:`~rapidspec.models.LoadedModel`: its model, name, source, dtype, runtime,
    quantisation and device name what its keys and values are computed with)."""
    describe = {what: str(getattr(loaded, what, None)) for what in ("name", "source", "dtype", "runtime", "quantization")}
    describe.update(device=loaded.model.device.type, block=BLOCK_TOKENS, format=FORMAT, int8=int8_numerics())
    return DiskKVStore(model_key(loaded.model, describe), max_bytes, folder, describe)


class DiskKVStore:
    """Blocks of one model's keys and values in ``folder`` (None: :func:`directory`'s default), at most
    ``max_bytes`` for all models; ``key`` is the model's :func:`~rapidspec.runtime.kv_blocks.model_key`."""

    def __init__(self, key: str, max_bytes: int, folder: Path | str | None = None, describe: dict | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"the key/value cache's bound must be >= 0, got {max_bytes} bytes")
        self.key, self.max_bytes, self.describe = key, int(max_bytes), describe or {}
        self.root = directory(folder)
        self.folder = self.root / key
        # helper_thread: a thread of its own that copied with torch's threads would give the process a second
        # OpenMP team, and every later decode step would wait for sleeping threads (2x on 2 cores,
        # benchmarks/thread_teams.py; rapidspec.runtime.threads)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rapidspec-kv-write",
                                          initializer=helper_thread)
        self._pending, self._pending_lock = 0, threading.Lock()  # writes handed over and not done
        self.blocks_read = self.blocks_written = 0

    # ------------------------------------------------------------------ read
    def extend(self, cache: KVCacheProtocol, token_ids: Sequence[int]) -> int:
        """Append to ``cache`` what the folder holds beyond it along ``token_ids``; how many tokens were read.

        ``cache`` holds a prefix of ``token_ids``. Where the folder continues it further, the cache is cropped to
        its last block boundary and the blocks are appended (each checked whole), never past ``token_ids``.
        """
        held, first = cache.length, cache.length // BLOCK_TOKENS
        if len(token_ids) < max(MIN_TOKENS, held + MIN_READ_TOKENS) or not hasattr(cache, "append_kv") \
                or not self.folder.is_dir():
            return 0
        prefixes = prefix_hashes(self.key, token_ids)
        waiting, end, cropped = [], first * BLOCK_TOKENS, False  # blocks read but not appended yet, where they reach
        for j in range(first, len(prefixes)):
            wanted = token_ids[j * BLOCK_TOKENS : (j + 1) * BLOCK_TOKENS]
            block = self._best_block(prefixes[j], wanted)
            if block is None:
                break
            waiting.append((wanted, block))
            end += block[2]
            if end >= held + MIN_READ_TOKENS:  # worth it: the cache goes back to its block boundary and on from there
                if not cropped:
                    cache.crop(first * BLOCK_TOKENS)
                    cropped = True
                for ids, (keys, values, count) in waiting:
                    cache.append_kv(ids[:count], keys[:, :, :count].to(cache.device), values[:, :, :count].to(cache.device))
                    self.blocks_read += 1
                waiting.clear()
            if block[2] < BLOCK_TOKENS:  # the prompt goes on differently, or ends, inside this block
                break
        return max(0, cache.length - held)

    def _best_block(self, prefix: str, wanted: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The block after ``prefix`` sharing the most first tokens with ``wanted`` (read and checked), with that
        count; the block named by ``wanted`` itself first."""
        exact = self.folder / block_name(prefix, wanted)
        if len(wanted) == BLOCK_TOKENS and exact.is_file():
            block = self._read(exact, wanted)
            if block is not None:
                return block
        best, best_count = None, 0
        for path in self.folder.glob(f"{prefix}-*{SUFFIX}"):
            try:
                count = common_prefix_length(block_tokens(path), wanted)
            except Exception as err:  # noqa: BLE001 - whatever is wrong with the file, it is not loaded
                self._drop(path, err)
                continue
            if count > best_count:
                best, best_count = path, count
        return None if best is None else self._read(best, wanted)

    def _read(self, path: Path, wanted: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        try:
            keys, values, ids = read_block(path, self.key)
        except Exception as err:  # noqa: BLE001 - whatever is wrong with the file, it is not loaded
            self._drop(path, err)
            return None
        count = common_prefix_length(ids, wanted)
        if not count:
            return None
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        return keys, values, count

    def _drop(self, path: Path, err: Exception) -> None:
        with _warned_lock:
            first = str(self.folder) not in _warned
            _warned.add(str(self.folder))
        (logger.warning if first else logger.debug)(
            "key/value cache: %s is not loaded (%s); removed, the prompt is prefilled from there", path, err)
        remove_quietly(path)

    # ----------------------------------------------------------------- write
    def write(self, cache: KVCacheProtocol) -> Future | None:
        """Write the blocks of ``cache`` that the folder lacks, in the store's thread (the caller must not change
        ``cache`` before the returned future is done; the engine hands over caches it keeps unchanged)."""
        if cache.length < MIN_TOKENS or self.max_bytes == 0 or not hasattr(cache, "held_kv"):
            return None
        with self._pending_lock:
            if self._pending >= MAX_PENDING_WRITES:  # a slow disk: skipped, not queued (a later answer's write
                logger.debug("key/value cache: %d writes pending, one skipped", self._pending)  # has the blocks)
                return None
            self._pending += 1
        return self._writer.submit(self._write_logged, cache)

    def _write_logged(self, cache: KVCacheProtocol) -> int:
        """:meth:`_write`, whose unexpected errors are logged (a thread's future would keep them to itself)."""
        try:
            return self._write(cache)
        except Exception:  # noqa: BLE001 - the blocks are a saving, never a reason for an answer to fail
            logger.exception("key/value cache: writing blocks to %s failed", self.folder)
            return 0
        finally:
            with self._pending_lock:
                self._pending -= 1

    def _write(self, cache: KVCacheProtocol) -> int:
        token_ids = cache.token_ids
        if not (self.folder / MODEL_FILE).is_file():  # what `rapidspec cache ls` shows of the model
            keep_json(self.folder / MODEL_FILE, self.describe, "key/value blocks", "documents are prefilled again")
        written = 0
        for j, prefix in enumerate(prefix_hashes(self.key, token_ids)):
            start = j * BLOCK_TOKENS
            ids = token_ids[start : start + BLOCK_TOKENS]
            path = self.folder / block_name(prefix, ids)
            if path.is_file():
                continue
            held = cache.held_kv(start, start + len(ids))
            if held is None:  # a cache whose layers cannot be written (sliding windows, ...)
                return written
            keys, values = (t.detach().to("cpu").contiguous() for t in held)

            def save(temporary: Path, prefix=prefix, keys=keys, values=values, ids=ids) -> None:
                save_block(temporary, self.key, prefix, keys, values, ids)

            if not cache_write(path, save, "key/value blocks", "documents are prefilled again by later processes"):
                return written
            written += 1
            self.blocks_written += 1
            if len(ids) < BLOCK_TOKENS:
                self._drop_shorter_siblings(path, prefix, ids)
        if written:
            self.evict()
        return written

    def _drop_shorter_siblings(self, path: Path, prefix: str, ids: Sequence[int]) -> None:
        """Remove the partial blocks after ``prefix`` whose tokens the new block ``path`` starts with."""
        for sibling in self.folder.glob(f"{prefix}-*{SUFFIX}"):
            try:
                tokens = block_tokens(sibling) if sibling != path else None
            except Exception:  # noqa: BLE001 - a bad file: the next read removes it
                continue
            if tokens is not None and len(tokens) < len(ids) and common_prefix_length(tokens, ids) == len(tokens):
                remove_quietly(sibling)

    def writing(self) -> bool:
        """Whether writes handed over are not done (their caches may still be read)."""
        return self._pending > 0

    def flush(self) -> None:
        """Wait for the writes handed over so far."""
        self._writer.submit(lambda: None).result()

    # ------------------------------------------------------------ the bound
    def evict(self) -> int:
        """Remove the least recently used files of every model until the folder fits ``max_bytes``; how many."""
        files = list_files(self.root)
        total = sum(size for _, size, _ in files)
        removed = 0
        for path, size, _ in sorted(files, key=lambda f: f[2]):
            if total <= self.max_bytes:
                break
            remove_quietly(path)
            total -= size
            removed += 1
        return removed


def list_files(root: Path) -> list[tuple[Path, int, float]]:
    """(path, bytes, modification time) of every block file under ``root``."""
    found = []
    if not root.is_dir():
        return found
    for folder in root.iterdir():
        if not folder.is_dir():
            continue
        for entry in os.scandir(folder):
            if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                try:
                    stat = entry.stat()
                except OSError:
                    continue
                found.append((Path(entry.path), stat.st_size, stat.st_mtime))
    return found
