"""What a key/value block on disk is: its name, its model's key, its file and its checksum.

A block holds the keys and values of up to :data:`BLOCK_TOKENS` consecutive
tokens of one model, starting at a multiple of :data:`BLOCK_TOKENS`. Its name
is ``<prefix hash>-<own hash>``: the prefix hash covers the model's key and
every token before the block (so a block is found only after exactly the
tokens it was computed after), the own hash its own tokens. A prompt that
continues the tokens before a block differently from it can still use the
block's first tokens: the blocks that share a prefix hash are its candidates
(:func:`block_prefix`), and the one sharing the most tokens with the prompt is
read up to where they differ. The last block of a cache may hold fewer tokens.

A file is safetensors: ``keys`` and ``values`` [layers, kv_heads, tokens,
head_dim] in the model's dtype and ``token_ids`` [tokens] int32, with metadata
naming the format, the model's key, the prefix hash and a BLAKE2b checksum of
the three tensors' bytes; :func:`read_block` checks them all.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

#: Tokens per block on disk.
BLOCK_TOKENS = 256
FORMAT = "rapidspec-kv/2"
SUFFIX = ".safetensors"


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


def _tokens_bytes(token_ids: Sequence[int]) -> bytes:
    return torch.tensor(list(token_ids), dtype=torch.int32).numpy().tobytes()


def prefix_hashes(key: str, token_ids: Sequence[int]) -> list[str]:
    """The prefix hash of every block of ``token_ids`` (the last may be partial): block j's covers ``key`` and
    tokens [0, j * BLOCK_TOKENS)."""
    return boundary_hashes(key, token_ids)[: -(-len(token_ids) // BLOCK_TOKENS)]


def boundary_hashes(key: str, token_ids: Sequence[int]) -> list[str]:
    """The hash covering ``key`` and tokens [0, j * BLOCK_TOKENS) for every j with j * BLOCK_TOKENS <= len(token_ids)."""
    hashes = [hashlib.sha256(key.encode()).hexdigest()[:32]]
    for start in range(0, len(token_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        block = _tokens_bytes(token_ids[start : start + BLOCK_TOKENS])
        hashes.append(hashlib.sha256(hashes[-1].encode() + block).hexdigest()[:32])
    return hashes


def block_name(prefix: str, token_ids: Sequence[int]) -> str:
    """The file name of the block holding ``token_ids`` after the tokens ``prefix`` covers."""
    return f"{prefix}-{hashlib.sha256(_tokens_bytes(token_ids)).hexdigest()[:16]}{SUFFIX}"


def block_prefix(path: Path) -> str:
    """The prefix hash in a block file's name."""
    return path.name.split("-", 1)[0]


def checksum(*tensors: torch.Tensor) -> str:
    """BLAKE2b of the tensors' bytes (a block's keys, values and token ids; read as bytes, whatever their dtype)."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        digest.update(tensor.contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()


def save_block(path: Path, key: str, prefix: str, keys: torch.Tensor, values: torch.Tensor,
               token_ids: Sequence[int]) -> None:
    """Write one block file at ``path`` (keys and values on the CPU, [layers, kv_heads, tokens, head_dim])."""
    ids = torch.tensor(list(token_ids), dtype=torch.int32)
    meta = {"format": FORMAT, "model": key, "prefix": prefix, "tokens": str(len(ids)),
            "checksum": checksum(keys, values, ids)}
    data = save({"keys": keys, "values": values, "token_ids": ids}, metadata=meta)
    with open(path, "xb") as out:  # Python's file: a read-only or full folder is an OSError (cache_write's case)
        out.write(data)


def block_token_count(path: Path) -> int:
    """How many tokens a block file says it holds (its header alone is read; nothing is checked)."""
    with safe_open(str(path), framework="pt") as file:
        return int((file.metadata() or {}).get("tokens", 0))


def block_tokens(path: Path) -> list[int]:
    """The token ids a block file holds (its header and those ids alone are read; nothing is checked)."""
    with safe_open(str(path), framework="pt") as file:
        return file.get_tensor("token_ids").tolist()


def read_block(path: Path, key: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Keys, values and token ids of a block file, checked; ValueError (or the reader's error) when any check fails."""
    with safe_open(str(path), framework="pt") as file:
        meta = file.metadata() or {}
        if meta.get("format") != FORMAT or meta.get("model") != key or meta.get("prefix") != block_prefix(path):
            raise ValueError("another format, model or place")
        keys, values, ids = (file.get_tensor(name) for name in ("keys", "values", "token_ids"))
    count = ids.numel()
    if not 0 < count <= BLOCK_TOKENS or keys.shape != values.shape or keys.dim() != 4 or keys.shape[2] != count:
        raise ValueError("shapes that are not a block's")
    if checksum(keys, values, ids) != meta.get("checksum"):
        raise ValueError("a checksum that does not match")
    return keys, values, ids.tolist()
