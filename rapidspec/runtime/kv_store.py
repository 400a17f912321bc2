"""Key/value blocks on disk, so a document read once is read from disk by every later process.

After a generation the engine hands its target cache to :meth:`DiskKVStore.write`;
a thread of the store writes the keys and values of every whole block of
:data:`BLOCK_TOKENS` tokens that the folder does not hold yet, one file per
block. A block's name is a chain hash: the model's key (:func:`model_key`)
and every token up to the block's end, so a block is found only by a prompt
that starts with exactly the tokens it was computed over, and a longer prompt
reuses a shorter one's blocks (a new question about a document writes only
the blocks after the document). Before a prefill the engine asks
:meth:`DiskKVStore.extend` to append to its cache the longest run of blocks
that the folder holds for the prompt.

Files are safetensors (``keys`` and ``values`` [layers, kv_heads, block,
head_dim] in the model's dtype, ``token_ids`` [block] int32) whose metadata
holds the format, the model's key, the chain hash and a BLAKE2b checksum of
the three tensors' bytes. Reading checks all four and the file's tensor
shapes; a partial, corrupt, foreign or stale file is logged once, removed and
never loaded (the prompt is prefilled from there). Writes go to a temporary
name and are renamed (:func:`~rapidspec.runtime.cache_dir.cache_write`), so
two processes writing the same block leave one good file; a read-only or
full folder is logged once and the engine goes on from memory. Beyond
``max_bytes`` the least recently used files (by modification time, touched
on every read) are removed.

Layout: ``<folder>/<model key>/<chain hash>.safetensors``, and ``model.json`` naming the model there (what
``rapidspec cache ls`` shows); ``<folder>`` is
``$RAPIDSPEC_KV_CACHE`` if set, else ``<cache>/kv`` (:func:`default_directory`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rapidspec.runtime.cache_dir import cache_root, cache_write, keep_json, remove_quietly
from rapidspec.runtime.protocol import KVCacheProtocol

logger = logging.getLogger(__name__)

#: Tokens per block on disk: a prompt's tail after its last whole block (fewer than this) is prefilled.
BLOCK_TOKENS = 256
#: Caches shorter than this are neither written nor looked up (their prefill is cheaper than the files).
MIN_TOKENS = 1024
FORMAT = "rapidspec-kv/1"
SUFFIX = ".safetensors"
MODEL_FILE = "model.json"
GIB = 1024**3

_warned: set[str] = set()
_warned_lock = threading.Lock()


def default_directory() -> Path:
    """``$RAPIDSPEC_KV_CACHE`` if set, else ``<cache>/kv`` (read on every call)."""
    if os.environ.get("RAPIDSPEC_KV_CACHE"):
        return Path(os.environ["RAPIDSPEC_KV_CACHE"]).expanduser()
    return cache_root() / "kv"


def model_key(model: torch.nn.Module, describe: dict) -> str:
    """A short hash naming what ``model`` computes keys and values with: ``describe`` (source, dtype, runtime,
    quantisation, device type), its configuration, and for every parameter and buffer its name, shape, dtype and
    up to 1,024 evenly spaced values (another file, precision or conversion of the weights is another key)."""
    digest = hashlib.sha256(json.dumps(describe, sort_keys=True, default=str).encode())
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        digest.update(config.to_json_string(use_diff=False).encode())
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        try:
            flat = tensor.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 1024)][:1024].contiguous().cpu()
            digest.update(sample.view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError, NotImplementedError):  # a tensor subclass without these views
            pass
    return digest.hexdigest()[:24]


def for_model(loaded, max_bytes: int, folder: Path | str | None = None) -> DiskKVStore:
    """The store of ``loaded`` (a :class:`~rapidspec.models.LoadedModel`: its model, name, source, dtype, runtime,
    quantisation and device name what its keys and values are computed with)."""
    describe = {what: str(getattr(loaded, what, None)) for what in ("name", "source", "dtype", "runtime", "quantization")}
    describe.update(device=loaded.model.device.type, block=BLOCK_TOKENS, format=FORMAT)
    return DiskKVStore(model_key(loaded.model, describe), max_bytes, folder, describe)


def chain_hashes(key: str, token_ids: Sequence[int], blocks: int) -> list[str]:
    """The names of the first ``blocks`` blocks of ``token_ids``: block j's covers the key and tokens [0, (j+1)B)."""
    names, previous = [], key
    for j in range(blocks):
        block = torch.tensor(list(token_ids[j * BLOCK_TOKENS : (j + 1) * BLOCK_TOKENS]), dtype=torch.int32)
        previous = hashlib.sha256(previous.encode() + block.numpy().tobytes()).hexdigest()[:32]
        names.append(previous)
    return names


def checksum(keys: torch.Tensor, values: torch.Tensor, token_ids: torch.Tensor) -> str:
    """BLAKE2b of the three tensors' bytes (keys and values read as bytes, whatever their dtype)."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in (keys, values, token_ids):
        digest.update(tensor.contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()


class DiskKVStore:
    """Blocks of one model's keys and values in ``folder`` (None: :func:`default_directory`), at most
    ``max_bytes`` for all models; ``key`` is the model's :func:`model_key`."""

    def __init__(self, key: str, max_bytes: int, folder: Path | str | None = None, describe: dict | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"the key/value cache's bound must be >= 0, got {max_bytes} bytes")
        self.key, self.max_bytes, self.describe = key, int(max_bytes), describe or {}
        self.root = Path(folder).expanduser() if folder is not None else default_directory()
        self.folder = self.root / key
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rapidspec-kv-write")
        self.blocks_read = self.blocks_written = 0

    # ------------------------------------------------------------------ read
    def extend(self, cache: KVCacheProtocol, token_ids: Sequence[int]) -> int:
        """Append to ``cache`` the blocks on disk that continue it along ``token_ids``; how many tokens were read.

        ``cache`` holds a prefix of ``token_ids``; where the folder holds blocks beyond it, the cache is cropped
        to its last whole block and the blocks are appended while each one reads back whole.
        """
        whole = len(token_ids) // BLOCK_TOKENS
        first = cache.length // BLOCK_TOKENS
        if len(token_ids) < MIN_TOKENS or whole <= first or not hasattr(cache, "append_kv") or not self.folder.is_dir():
            return 0
        names = chain_hashes(self.key, token_ids, whole)
        if not (self.folder / f"{names[first]}{SUFFIX}").is_file():
            return 0
        cropped, read = False, 0
        for j in range(first, whole):
            block = self._read(names[j], token_ids[j * BLOCK_TOKENS : (j + 1) * BLOCK_TOKENS])
            if block is None:
                break
            if not cropped:
                cache.crop(first * BLOCK_TOKENS)
                cropped = True
            keys, values, ids = block
            cache.append_kv(ids, keys.to(cache.device), values.to(cache.device))
            self.blocks_read += 1
            read += BLOCK_TOKENS
        return read

    def _read(self, name: str, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
        path = self.folder / f"{name}{SUFFIX}"
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as file:
                meta = file.metadata() or {}
                if meta.get("format") != FORMAT or meta.get("model") != self.key or meta.get("chain") != name:
                    raise ValueError("another format, model or block")
                keys, values, ids = (file.get_tensor(n) for n in ("keys", "values", "token_ids"))
            if ids.tolist() != list(token_ids) or keys.shape != values.shape or keys.shape[2] != BLOCK_TOKENS:
                raise ValueError("tokens or shapes that are not the block's")
            if checksum(keys, values, ids) != meta.get("checksum"):
                raise ValueError("a checksum that does not match")
        except Exception as err:  # noqa: BLE001 - whatever is wrong with the file, it is not loaded
            self._drop(path, err)
            return None
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        return keys, values, ids.tolist()

    def _drop(self, path: Path, err: Exception) -> None:
        with _warned_lock:
            first = str(self.folder) not in _warned
            _warned.add(str(self.folder))
        (logger.warning if first else logger.debug)(
            "key/value cache: %s is not loaded (%s); removed, the prompt is prefilled from there", path, err)
        remove_quietly(path)

    # ----------------------------------------------------------------- write
    def write(self, cache: KVCacheProtocol) -> Future | None:
        """Write the whole blocks of ``cache`` that the folder lacks, in the store's thread (the caller must not
        change ``cache`` before the returned future is done; the engine hands over caches it keeps unchanged)."""
        if cache.length < MIN_TOKENS or self.max_bytes == 0 or not hasattr(cache, "held_kv"):
            return None
        return self._writer.submit(self._write, cache)

    def _write(self, cache: KVCacheProtocol) -> int:
        token_ids = cache.token_ids
        whole = len(token_ids) // BLOCK_TOKENS
        if not (self.folder / MODEL_FILE).is_file():  # what `rapidspec cache ls` shows of the model
            keep_json(self.folder / MODEL_FILE, self.describe, "key/value blocks", "documents are prefilled again")
        names = chain_hashes(self.key, token_ids, whole)
        written = 0
        for j, name in enumerate(names):
            path = self.folder / f"{name}{SUFFIX}"
            if path.is_file():
                continue
            held = cache.held_kv(j * BLOCK_TOKENS, (j + 1) * BLOCK_TOKENS)
            if held is None:  # a cache whose layers cannot be written (sliding windows, ...)
                return written
            keys, values = (t.detach().to("cpu").contiguous() for t in held)
            ids = torch.tensor(token_ids[j * BLOCK_TOKENS : (j + 1) * BLOCK_TOKENS], dtype=torch.int32)
            meta = {"format": FORMAT, "model": self.key, "chain": name, "checksum": checksum(keys, values, ids)}

            def save(temporary: Path, keys=keys, values=values, ids=ids, meta=meta) -> None:
                save_file({"keys": keys, "values": values, "token_ids": ids}, str(temporary), metadata=meta)

            if not cache_write(path, save, "key/value blocks", "documents are prefilled again by later processes"):
                return written
            written += 1
            self.blocks_written += 1
        if written:
            self.evict()
        return written

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
