"""``rapidspec cache``: what the key/value cache on disk holds, and clearing it.

    rapidspec cache ls [--kv-cache-dir DIR] [--json]
    rapidspec cache rm [KEY ...] [--kv-cache-dir DIR]

``ls`` (also ``rapidspec cache`` alone) prints one row per model whose blocks
the folder holds (:mod:`rapidspec.runtime.kv_store`): its key, name, dtype
and runtime, the blocks, the tokens they cover, the bytes and when a block
was last used. ``rm`` removes the blocks of the models named by key (or a
prefix of one), or of every model when none is named.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rapidspec.errors import RapidspecError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "cache",
        help="list or clear the key/value cache on disk (documents read once)",
        description="The target's keys and values of long prompts, kept on disk by generate, chat and serve so a "
                    "later process does not read the same document again: list them per model, or remove them.",
    )
    folder = argparse.ArgumentParser(add_help=False)
    folder.add_argument("--kv-cache-dir", default=None, metavar="DIR",
                        help="the folder (default: $RAPIDSPEC_KV_CACHE, else $RAPIDSPEC_CACHE/kv)")
    parser.add_argument("--kv-cache-dir", default=None, metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    actions = parser.add_subparsers(dest="cache_command", metavar="ACTION")
    listing = actions.add_parser("ls", parents=[folder], help="one row per model: blocks, tokens, bytes, last used")
    listing.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    remove = actions.add_parser("rm", parents=[folder], help="remove the blocks of some models, or of all")
    remove.add_argument("keys", nargs="*", metavar="KEY", help="model keys as `ls` shows them (their first 12 "
                        "characters; any prefix will do), none: all")
    parser.set_defaults(handler=run)


def models(root: Path) -> list[dict]:
    """One entry per model folder under ``root``: its key, what ``model.json`` says, blocks, bytes, last use."""
    from rapidspec.runtime.kv_blocks import block_token_count
    from rapidspec.runtime.kv_store import MODEL_FILE, list_files

    by_model: dict[str, list] = {}
    for path, size, used in list_files(root):
        try:
            tokens = block_token_count(path)
        except Exception:  # noqa: BLE001 - a damaged file: counted without tokens (the next read removes it)
            tokens = 0
        by_model.setdefault(path.parent.name, []).append((size, used, tokens))
    found = []
    for key, files in sorted(by_model.items()):
        try:
            described = json.loads((root / key / MODEL_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            described = {}
        found.append({"key": key, "model": described, "blocks": len(files), "tokens": sum(f[2] for f in files),
                      "bytes": sum(f[0] for f in files), "last_used": max(f[1] for f in files)})
    return found


def run(args: argparse.Namespace) -> int:
    from rapidspec.runtime.cache_dir import remove_quietly
    from rapidspec.runtime.kv_store import directory

    root = directory(args.kv_cache_dir or None)
    held = models(root)
    if args.cache_command == "rm":
        chosen = [m for m in held if not args.keys or any(m["key"].startswith(k) for k in args.keys)]
        unknown = [k for k in args.keys if not any(m["key"].startswith(k) for m in held)]
        if unknown:
            raise RapidspecError(f"no model in {root} has the key {', '.join(unknown)} (see `rapidspec cache ls`)")
        for entry in chosen:
            remove_quietly(root / entry["key"])
        freed = sum(m["bytes"] for m in chosen)
        Console().print(f"removed the blocks of {len(chosen)} model(s) from {root}: {freed / 2**20:.1f} MiB")
        return 0
    if args.json:
        print(json.dumps({"folder": str(root), "models": held}))
        return 0
    if not held:
        Console().print(f"{root} holds no key/value blocks")
        return 0
    table = Table(title=f"key/value cache: {root}")
    table.add_column("key", no_wrap=True, min_width=12)
    for column in ("model", "dtype", "runtime", "blocks", "tokens", "MiB", "last used"):
        table.add_column(column, justify="right" if column in ("blocks", "tokens", "MiB") else "left")
    for m in held:
        described = m["model"]
        used = datetime.datetime.fromtimestamp(m["last_used"]).strftime("%Y-%m-%d %H:%M")
        table.add_row(m["key"][:12], described.get("name", "?"), described.get("dtype", "?").replace("torch.", ""),
                      described.get("runtime", "?"), str(m["blocks"]), str(m["tokens"]), f"{m['bytes'] / 2**20:.1f}",
                      used)
    Console().print(table)
    return 0
