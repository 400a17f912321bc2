"""The package's shape: one folder per concern, nothing importing upward, no import circles, one way to build an
engine, a light load client."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "rapidspec"
#: Folder -> the folders (or root modules) it must never import, at module level or inside a function.
FORBIDDEN = {
    "verification": {"engine", "drafting", "models", "runtime", "retrieval", "prompting", "server", "scale",
                     "evaluation", "bench", "cli"},
    "runtime": {"engine", "drafting", "models", "retrieval", "prompting", "server", "scale", "evaluation", "bench",
                "cli"},
    "retrieval": {"engine", "drafting", "models", "prompting", "server", "scale", "evaluation", "bench", "cli"},
    "models": {"engine", "drafting", "prompting", "server", "scale", "evaluation", "bench", "cli"},
    "drafting": {"engine", "prompting", "server", "scale", "evaluation", "bench", "cli"},
    "prompting": {"engine", "server", "scale", "evaluation", "bench", "cli"},
    "engine": {"server", "scale", "evaluation", "bench", "cli"},
    "grammar": {"engine", "drafting", "models", "runtime", "retrieval", "prompting", "verification", "server",
                "scale", "evaluation", "bench", "cli"},
    "server": {"scale", "evaluation", "bench", "cli"},
    "evaluation": {"server", "scale", "bench", "cli"},
    "scale": {"bench", "cli"},
    "bench": {"server", "cli"},
}


#: The root modules: the bottom layer (config, errors) imports only the grammar's spec; the others are shared
#: types and text helpers that the engine and every surface read, so they never import those.
ROOT_ALLOWED = {"config": {"errors", "grammar"}, "errors": set()}
ROOT_FORBIDDEN = {"engine", "prompting", "server", "scale", "evaluation", "bench", "cli"}


def imports(path: Path, module_level_only: bool = False) -> set[str]:
    """The rapidspec modules ``path`` imports (``rapidspec.x.y``), optionally only those at module level."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if module_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "rapidspec":
            base = node.module
            out |= {f"{base}.{a.name}" if (PACKAGE / "/".join(base.split(".")[1:]) / a.name).exists()
                    or (PACKAGE / "/".join(base.split(".")[1:]) / f"{a.name}.py").exists() else base
                    for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "rapidspec"}
    return out


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_folder_imports_upward():
    offences = []
    for path in files():
        parts = path.relative_to(PACKAGE).parts
        if len(parts) < 2 or parts[0] not in FORBIDDEN:
            continue
        for target in imports(path):
            top = target.split(".")[1] if "." in target else ""
            if top in FORBIDDEN[parts[0]]:
                offences.append(f"{path.relative_to(PACKAGE)} imports {target}")
    assert not offences, offences


def test_root_modules_import_downward_only():
    offences = []
    for path in PACKAGE.glob("*.py"):
        if path.stem in ("__init__", "__main__"):
            continue
        for target in imports(path):
            top = target.split(".")[1] if "." in target else ""
            allowed = ROOT_ALLOWED.get(path.stem)
            if (top in ROOT_FORBIDDEN) if allowed is None else (top not in allowed):
                offences.append(f"{path.name} imports {target}")
    assert not offences, offences


def test_one_constructor_builds_every_engine():
    """``Rapid(spec, target=..., drafter=..., template=...)`` is the one way an engine is made, in the package,
    the benchmarks and the tests: no other constructor, at most the spec positionally, models passed as what they
    are (never a spec naming other models around them)."""
    from rapidspec.engine import Rapid

    assert not any(isinstance(v, (classmethod, staticmethod)) for v in vars(Rapid).values())
    offences, calls = [], 0
    for path in [*files(), *sorted((PACKAGE.parent / "benchmarks").glob("*.py")), *sorted((PACKAGE.parent / "tests").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Rapid":
                calls += 1
                if len(node.args) > 1 or any(k.arg not in ("target", "drafter", "template") for k in node.keywords):
                    offences.append(f"{path.name}:{node.lineno}")
            elif isinstance(node, ast.Attribute) and node.attr == "from_spec":
                offences.append(f"{path.name}:{node.lineno} from_spec")
    assert calls > 100 and not offences, offences


def test_only_the_command_line_imports_the_command_line():
    users = [module_name(p) for p in files() if any(t.startswith("rapidspec.cli") for t in imports(p))
             and not module_name(p).startswith("rapidspec.cli") and module_name(p) != "rapidspec.__main__"]
    assert users == []


def test_no_import_circles_at_module_level():
    graph = {module_name(p): {t for t in imports(p, module_level_only=True)} for p in files()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    circles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(graph.get(name, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    # A package importing its own submodules in __init__ is the one allowed loop shape.
    circles = [c for c in circles if not all(part.startswith(c.split(" -> ")[0]) for part in c.split(" -> "))]
    assert not circles, circles


def test_small_root_and_short_engine_modules():
    """The root keeps the public surface and the types every layer shares; prompt building, verification math
    and the rest live in folders by concern."""
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 10, root
    for path in (PACKAGE / "engine").glob("*.py"):
        assert len(path.read_text(encoding="utf-8").splitlines()) < 400, path.name


def test_the_load_client_imports_neither_torch_nor_fastapi():
    code = ("import sys, rapidspec.bench.serve.load, rapidspec.bench.serve.client, rapidspec.bench.serve.dataset, "
            "rapidspec.bench.serve.process, rapidspec.bench.serve.stats; "
            "print(sorted(m for m in ('torch', 'fastapi', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_the_spec_and_every_option_list_import_no_torch():
    """A spec is built, checked and sent to another process without torch: every option list and default sits
    in rapidspec.config, and the packages on the way load their heavy parts on first use."""
    code = ("import sys, rapidspec.config, rapidspec.engine.spec, rapidspec.models.spec, rapidspec.engine.defaults; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_the_runtime_keeps_the_options_of_rapidspec_config():
    """The runtime imports nothing above it, so it keeps its own copies: the chunk of a cache made without an
    engine, and the quantizations it loads; every dtype name a user may give resolves."""
    from rapidspec import config
    from rapidspec.models import devices
    from rapidspec.runtime import cache, quantization

    assert config.DTYPE_NAMES == ("auto", *devices._DTYPES)
    assert cache.PREFILL_CHUNK_TOKENS == config.DEFAULT_PREFILL_CHUNK_TOKENS
    for name in ("QUANTIZATIONS", "TARGET_QUANTIZATIONS", "ROUNDED_QUANTIZATIONS"):
        assert getattr(quantization, name) == getattr(config, name), name


def test_each_option_list_and_default_is_written_once():
    """User-facing enumerations and defaults live in rapidspec.config; no other module assigns them again but the
    runtime, which stands alone and keeps copies (checked equal above)."""
    names = {"QUANTIZATIONS", "TARGET_QUANTIZATIONS", "ROUNDED_QUANTIZATIONS", "DRAFTER_BACKENDS", "DRAFTER_PREFILLS",
             "DRAFTER_GGUF_CHOICES", "RUNTIMES", "DTYPE_NAMES", "MODES"}
    offences = []
    for path in files():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                if isinstance(target, ast.Name) and target.id in names and path.name != "config.py" \
                        and path.parent.name != "runtime":
                    offences.append(f"{path.relative_to(PACKAGE)}: {target.id}")
    numbers = [p.relative_to(PACKAGE) for p in files() if "= 2048\n" in p.read_text(encoding="utf-8")]
    assert not offences and [str(p) for p in numbers] == ["config.py", "runtime/cache.py"], (offences, numbers)


def test_evaluation_holds_no_http_or_ray_code():
    for path in (PACKAGE / "evaluation").glob("*.py"):
        source = path.read_text(encoding="utf-8")
        for name in ("import ray", "from ray", "import httpx", "from fastapi", "import fastapi"):
            assert name not in source, f"{path.name}: {name}"


def _function_lengths() -> dict[str, int]:
    out = {}
    for path in files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[f"{module_name(path)}.{node.name}:{node.lineno}"] = node.end_lineno - node.lineno + 1
    return out


def test_no_function_over_80_lines_and_a_round_on_one_screen():
    """Lines from ``def`` to the end, docstring included: one round (draft, one forward, verify, bonus) and the
    loop over rounds read at a glance."""
    lengths = _function_lengths()
    assert {name: n for name, n in lengths.items() if n > 80} == {}
    loop = {name.split(":")[0]: n for name, n in lengths.items() if name.startswith("rapidspec.engine.rounds.run_round")}
    assert set(loop) == {"rapidspec.engine.rounds.run_round", "rapidspec.engine.rounds.run_rounds"}
    assert all(n <= 50 for n in loop.values()), loop


def test_bench_logic_lives_in_bench_and_the_command_line_only_parses_and_prints():
    """One module per bench command in cli/; the runs, the peers and the tables are rapidspec.bench's."""
    assert sorted(p.name for p in (PACKAGE / "cli").glob("bench*.py")) == ["bench.py", "bench_serve.py"]
    for path in (PACKAGE / "cli").glob("bench*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert not {"Table", "Peer"} & {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call)
                                          and isinstance(n.func, ast.Name)}, path.name
        assert defined <= {"register", "run", "_requests", "_max_tokens", "_launch_config", "_result_file"}, defined


def test_drafter_pools_are_made_in_one_place():
    """An engine's factory and RAPID's proposer inside vLLM make their drafter pools with the same function, so the
    backend choice and the drafter options apply alike."""
    makers = sorted(str(p.relative_to(PACKAGE)) for p in files() for node in ast.walk(ast.parse(p.read_text("utf-8")))
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("LlamaCppDrafters", "TorchDrafters"))
    callers = sorted(str(p.relative_to(PACKAGE)) for p in files() if "new_pool(" in p.read_text("utf-8"))
    assert makers == ["drafting/factory.py", "drafting/factory.py"]
    assert callers == ["drafting/factory.py", "vllm/drafter_source.py"]
