"""The models scripts/install.py installs (``make demo``) are the registry's: the default one and the small one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rapidspec.errors import RapidspecError
from rapidspec.models.builtin import BUILTIN_MODELS, DEFAULT_BUILTIN
from rapidspec.models.store import assembled_gguf_path, file_sha256

ROOT = Path(__file__).resolve().parent.parent


def install_script():
    spec = importlib.util.spec_from_file_location("install_script", ROOT / "scripts" / "install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_set_up_installs_the_default_model_and_the_small_one():
    install = install_script()
    assert install.DEFAULT_MODEL == DEFAULT_BUILTIN
    assert install.BUILTIN_MODEL == BUILTIN_MODELS["smollm2-135m"].pip_spec


def test_the_default_model_is_checked_against_its_sha256_when_installed():
    """The set-up installed the default model through the verified assembly (a corrupted part is refused:
    tests/test_model_store.py); the file it left has the registry's size and SHA-256."""
    parts = BUILTIN_MODELS[DEFAULT_BUILTIN].parts  # split across pinned wheels: `rapidspec models install` verifies it
    assert parts is not None and len(parts.sha256) == 64 and parts.size > 0
    assert all("==" in spec for spec in parts.pip_specs())
    installed = assembled_gguf_path(BUILTIN_MODELS[DEFAULT_BUILTIN])
    if not installed.is_file():
        pytest.skip("the default model is not installed here (make demo installs it)")
    assert installed.stat().st_size == parts.size and file_sha256(installed) == parts.sha256


def test_the_set_up_s_check_finds_an_installed_default_model_and_refuses_a_missing_one(monkeypatch, tmp_path):
    check = "\n".join(install_script().DEFAULT_MODEL_CHECK)
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path))
    with pytest.raises(RapidspecError, match="not installed"):
        exec(check, {})
    entry = BUILTIN_MODELS[DEFAULT_BUILTIN]
    (tmp_path / "models").mkdir()
    with open(tmp_path / "models" / entry.filename, "wb") as file:  # a sparse file of the verified size
        file.truncate(entry.parts.size)
    exec(check, {})
