"""The vLLM set-up of scripts/install.py (``make vllm``) agrees with the code it sets up, without running it.

Its vLLM pin is rapidspec.vllm.environment's; what it installs for RAPID's
proposer covers every third-party import of the proposer's modules (function
level too), apart from what vLLM's venv has already and must keep.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest

from rapidspec.vllm import environment

ROOT = Path(__file__).resolve().parent.parent
#: Packages vLLM's venv has from vLLM itself (kept at vLLM's versions), and llama-cpp-python (its own step).
FROM_VLLM = {"torch", "transformers", "llguidance", "huggingface-hub", "tokenizers", "llama-cpp-python"}


@pytest.fixture(scope="module")
def install():
    spec = importlib.util.spec_from_file_location("install_script", ROOT / "scripts" / "install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_vllm_pin_is_environment_py_s(install):
    assert install.vllm_requirement() == environment.VLLM_REQUIREMENT


def test_the_proposer_requirements_are_rapidspec_s_and_leave_vllm_s_pins_alone(install):
    requirements = install.proposer_requirements()
    assert len(requirements) == len(install.PROPOSER_DEPENDENCIES)
    names = {requirement.split(">")[0].split("=")[0].split("<")[0].lower() for requirement in requirements}
    assert names.isdisjoint({"torch", "transformers", "llguidance"})


def test_the_proposer_requirements_cover_its_modules_imports(install):
    distributions = importlib.metadata.packages_distributions()
    covered = {name.lower() for name in install.PROPOSER_DEPENDENCIES} | FROM_VLLM
    roots = [name for name in install.PROPOSER_MODULES if name.startswith("rapidspec")]
    missing = {}
    for top, importers in third_party_imports(roots).items():
        for dist in distributions.get(top, [top]):
            if dist.lower().replace("_", "-") not in covered:
                missing[dist] = sorted(importers)[:3]
    assert missing == {}, f"add to PROPOSER_DEPENDENCIES in scripts/install.py: {missing}"


def third_party_imports(roots: list[str]) -> dict[str, set[str]]:
    """{top-level module: the rapidspec modules importing it} over the rapidspec modules ``roots`` import."""
    found: dict[str, set[str]] = {}
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        path = module_path(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        todo.extend(".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1))  # its packages
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [node.module or ""])
                        if node.level else node.module)
                modules = [base.rstrip(".")] + [f"{base.rstrip('.')}.{alias.name}" for alias in node.names]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top == "rapidspec":
                    todo.append(module)
                elif top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, set()).add(name)
    return found


def module_path(name: str) -> Path | None:
    path = ROOT.joinpath(*name.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None
