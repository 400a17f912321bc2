"""A llama.cpp drafter's key/value state on disk, so a later process skips the drafter's prefill too.

The target's keys and values go to disk in blocks (:mod:`~rapidspec.runtime.kv_store`);
a llama.cpp context hands its memory out only whole, through llama.cpp's
state API (:meth:`~rapidspec.runtime.llama_cpp.LlamaCppContext.state`). So a
drafter cache that closes is written as one *snapshot*: the state of every
token it holds, in the same folder, bound and least-recently-used order as the
target's blocks, under a key of the GGUF file (:func:`gguf_key`). A snapshot is
named by the hash of its first 256 tokens and of all of them, so the snapshots
a prompt may continue are those named by its own first 256 tokens (a prompt
template's header and the start of a document). Before the drafter prefills,
:meth:`LlamaStateStore.extend` loads the one sharing the most tokens with the
prompt and crops it to where they differ: another question about the same
document keeps the document's tokens (modes whose drafter reads the
document), the same question all of them. A snapshot is written only where
it holds at least :data:`MIN_NEW_TOKENS` tokens beyond the one sharing most
with it (so a document's tokens are not kept again with every question about
it: the next process prefills the difference), and a snapshot that a newer
one continues (a chat's next turns) is removed when the newer one is written.

Reading checks the file's format, key, place and a BLAKE2b checksum of the
state and its tokens, and llama.cpp checks the state itself; a file failing
any check is logged (the first per folder at WARNING), removed and never used.
Writes go through a temporary name and a rename; the state is copied out of
the context before the cache goes back to its pool, the file is written on
the store's thread.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from rapidspec.runtime.cache import common_prefix_length
from rapidspec.runtime.cache_dir import cache_write, keep_json
from rapidspec.runtime.kv_blocks import (BLOCK_TOKENS, SUFFIX, block_name, block_prefix, block_tokens, boundary_hashes,
                                         checksum)
from rapidspec.runtime.kv_store import MAX_PENDING_WRITES, MIN_READ_TOKENS, MODEL_FILE, DiskKVStore, logger

FORMAT = "rapidspec-llama-state/1"
#: Drafter caches shorter than this are neither written nor looked up (a drafter's prompt is the retrieved text,
#: often under 1,024 tokens, and llama.cpp prefills a few hundred tokens a second on a CPU).
MIN_TOKENS = BLOCK_TOKENS
#: A snapshot is written only where it holds this many tokens beyond every snapshot on disk (what it shares with
#: the one sharing most): fewer are prefilled by the next process in less than a second.
MIN_NEW_TOKENS = BLOCK_TOKENS
#: Bytes of the GGUF file hashed into its key: this many evenly spaced samples of 4 KiB (with its size).
KEY_SAMPLES = 64


def gguf_key(path: Path, describe: dict) -> str:
    """A short hash naming what a llama.cpp context of ``path`` computes its state with: ``describe`` (what llama.cpp
    says of the model, its version, flash attention), the file's size and :data:`KEY_SAMPLES` samples of its bytes."""
    digest = hashlib.sha256(json.dumps(describe, sort_keys=True, default=str).encode())
    size = path.stat().st_size
    digest.update(str(size).encode())
    with open(path, "rb") as file:
        for index in range(KEY_SAMPLES):
            file.seek(index * max(0, size - 4096) // max(1, KEY_SAMPLES - 1))
            digest.update(file.read(4096))
    return digest.hexdigest()[:24]


def for_llama_model(model, label: str, max_bytes: int, folder: Path | str | None = None) -> LlamaStateStore:
    """The store of the contexts of ``model`` (a :class:`~rapidspec.runtime.llama_cpp.LlamaCppModel`)."""
    import llama_cpp

    describe = {"name": label, "source": str(model.path), "dtype": model.description, "runtime": "llama.cpp",
                "quantization": "gguf", "device": "cpu", "format": FORMAT, "llama_cpp": llama_cpp.__version__,
                "flash_attention": model.flash_attention}
    return LlamaStateStore(gguf_key(model.path, describe), max_bytes, folder, describe)


class LlamaStateStore(DiskKVStore):
    """Snapshots of one GGUF file's llama.cpp contexts in the key/value folder (module docstring)."""

    def extend(self, context, token_ids: Sequence[int]) -> int:
        """Load into ``context`` (holding a prefix of ``token_ids``) the snapshot that continues it furthest along
        ``token_ids``, cropped to where they differ; how many tokens it added (0: none worth reading)."""
        held = context.length
        if len(token_ids) < max(MIN_TOKENS, held + MIN_READ_TOKENS) or not self.folder.is_dir():
            return 0
        candidates = [(shared, path) for shared, path, size in self._sharing(token_ids) if size <= context.capacity]
        for shared, path in sorted(candidates, reverse=True):
            if shared < held + MIN_READ_TOKENS:
                break
            if self._load(context, path, shared):
                return context.length - held
        return 0

    def _sharing(self, token_ids: Sequence[int]) -> list[tuple[int, Path, int]]:
        """(tokens shared with ``token_ids``, path, tokens held) of each snapshot a prompt of ``token_ids`` may
        continue (a file whose tokens cannot be read is removed)."""
        found = []
        if self.folder.is_dir():
            for path in self.folder.glob(f"{self._prefix(token_ids)}-*{SUFFIX}"):
                try:
                    ids = block_tokens(path)
                except Exception as err:  # noqa: BLE001 - whatever is wrong with the file, it is not loaded
                    self._drop(path, err)
                    continue
                found.append((common_prefix_length(ids, token_ids), path, len(ids)))
        return found

    def _prefix(self, token_ids: Sequence[int]) -> str:
        """What the snapshots a prompt of ``token_ids`` may continue are named after: its first 256 tokens."""
        return boundary_hashes(self.key, token_ids[:BLOCK_TOKENS])[-1]

    def _load(self, context, path: Path, shared: int) -> bool:
        """Load ``path`` into ``context`` and keep its first ``shared`` tokens; False when a check fails (the file is
        removed, the context then holds nothing)."""
        try:
            state, ids = self._read(path)
            if not context.load_state(state, ids):
                raise ValueError("llama.cpp did not take the state")
        except Exception as err:  # noqa: BLE001 - whatever is wrong with the file, it is not loaded
            self._drop(path, err)
            return False
        context.crop(shared)
        self.blocks_read += 1
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        return True

    def _read(self, path: Path) -> tuple[bytes, list[int]]:
        with safe_open(str(path), framework="pt") as file:
            meta = file.metadata() or {}
            if meta.get("format") != FORMAT or meta.get("model") != self.key or meta.get("prefix") != block_prefix(path):
                raise ValueError("another format, model or place")
            state, ids = file.get_tensor("state"), file.get_tensor("token_ids")
        if checksum(state, ids) != meta.get("checksum"):
            raise ValueError("a checksum that does not match")
        return state.numpy().tobytes(), ids.tolist()

    def write(self, context) -> Future | None:
        """Copy the state of ``context`` now and write it on the store's thread, unless a snapshot on disk holds all
        but fewer than :data:`MIN_NEW_TOKENS` of its tokens."""
        token_ids = context.token_ids
        if len(token_ids) < MIN_TOKENS or self.max_bytes == 0:
            return None
        if max((shared for shared, _, _ in self._sharing(token_ids)), default=0) > len(token_ids) - MIN_NEW_TOKENS:
            return None
        prefix = self._prefix(token_ids)
        path = self.folder / block_name(prefix, token_ids)
        with self._pending_lock:
            if self._pending >= MAX_PENDING_WRITES:
                logger.debug("llama.cpp state: %d writes pending, one skipped", self._pending)
                return None
            self._pending += 1
        return self._writer.submit(self._write_logged, (path, prefix, context.state(), token_ids))

    def _write(self, snapshot: tuple[Path, str, bytes, list[int]]) -> int:
        path, prefix, data, token_ids = snapshot
        if not (self.folder / MODEL_FILE).is_file():
            keep_json(self.folder / MODEL_FILE, self.describe, "key/value blocks", "documents are prefilled again")
        state = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        ids = torch.tensor(token_ids, dtype=torch.int32)
        meta = {"format": FORMAT, "model": self.key, "prefix": prefix, "tokens": str(len(token_ids)),
                "checksum": checksum(state, ids)}

        def save_snapshot(temporary: Path) -> None:
            with open(temporary, "xb") as out:  # Python's file: a read-only or full folder is an OSError
                out.write(save({"state": state, "token_ids": ids}, metadata=meta))

        if not cache_write(path, save_snapshot, "llama.cpp drafter state", "the drafter prefills again"):
            return 0
        self.blocks_written += 1
        self._drop_shorter_siblings(path, prefix, token_ids)  # a snapshot whose tokens this one continues
        self.evict()
        return 1
