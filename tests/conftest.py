"""Tiny models built from configs, shared by the fast tests.

* ``byte_tokenizer``: a byte-level tokenizer (one token per byte, 256 + EOS),
  so any text works and token counts are predictable.
* ``tiny_model`` / ``make_tiny_model(seed)``: random 2-layer Llama models on
  that vocabulary (hidden 32, grouped-query attention 4/2 heads), as
  transformers' own assisted-generation tests use.
* ``MarkovLM``: a model whose next-token logits depend only on the last token,
  from a fixed table, so that exact output distributions can be computed.
* ``attention_choices_file``, ``step_costs_file`` (autouse): attention paths
  and step costs measured during the session are kept in temporary files, not
  in the user's cache directory.
* ``real_model`` / ``smollm2``: real models (the built-in ones), each loaded
  once per run for each name, dtype and runtime; ``vllm_offline``: the run's
  one offline vLLM process (tests/vllm_runs.py). A test that uses them is
  marked ``slow`` (and ``vllm``) at collection (:func:`pytest_collection_modifyitems`),
  so ``make test-fast`` (``-m "not slow and not vllm and not browser"``) leaves it out.
* ``drafter_from_the_first_round``: tests of the rounds' math (invariants,
  distributions, the drafter backends) decode with ``drafter_start="first"``,
  the drafter in every round from the first; how it joins by default is
  tested in test_drafter_join.py and test_determinism.py.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # workers share the CPUs: one computing thread each, subprocesses too
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from rapidspec.models import LoadedModel  # noqa: E402
from tests.byte_tokenizer import build_byte_tokenizer  # noqa: E402  (tests import it from here too)


def make_tiny_model(seed: int = 0, tokenizer=None, max_context: int = 4096, hidden_size: int = 32) -> LoadedModel:
    tokenizer = tokenizer or build_byte_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_context,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.eos_token_id,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=f"tiny-{seed}",
        device=model.device,
        dtype=model.dtype,
        max_context=max_context,
        source="config",
    )


@pytest.fixture(scope="session", autouse=True)
def embedding_store_folder(tmp_path_factory):
    """Chunk embeddings stored by tests go to a folder of this session, not the user's cache (subprocesses too)."""
    path = tmp_path_factory.mktemp("embeddings")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAPIDSPEC_EMBEDDING_STORE", str(path))
        yield path


@pytest.fixture(scope="session", autouse=True)
def attention_choices_file(tmp_path_factory):
    """Attention paths measured by tests are kept in a file of this session, not the user's cache (subprocesses too)."""
    path = tmp_path_factory.mktemp("attention") / "attention_paths.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAPIDSPEC_ATTENTION_PATHS", str(path))
        yield path


@pytest.fixture(scope="session", autouse=True)
def step_costs_file(tmp_path_factory):
    """Step costs calibrated by tests are kept in a file of this session, not the user's cache (subprocesses too)."""
    path = tmp_path_factory.mktemp("costs") / "step_costs.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAPIDSPEC_STEP_COSTS", str(path))
        yield path


@pytest.fixture
def drafter_from_the_first_round(monkeypatch):
    """Every generation of the test prepares its drafter before the first round (``drafter_start="first"``)."""
    from rapidspec import Rapid

    decode = Rapid.decode

    def first(self, prompts, config, **options):
        return decode(self, prompts, config.with_(drafter_start="first"), **options)

    monkeypatch.setattr(Rapid, "decode", first)


#: Markers that a test gets from the fixtures it uses, directly or through other fixtures (``smollm2`` uses
#: ``real_model``): ``make test-fast`` leaves out what loads a real model or runs vLLM.
FIXTURE_MARKERS = {"real_model": ("slow",), "vllm_offline": ("slow", "vllm")}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        for fixture in FIXTURE_MARKERS.keys() & fixtures:
            for name in FIXTURE_MARKERS[fixture]:
                item.add_marker(name)
        if "local_ray" in fixtures and _group(item) != RAY_GROUP:
            item.add_marker(pytest.mark.xdist_group(RAY_GROUP))  # one worker runs the Ray tests, one after the other
        if "vllm_offline" in fixtures:  # `pytest -n N --dist loadgroup`: one worker starts the run's vLLM process
            item.add_marker(pytest.mark.xdist_group("vllm-offline"))
        elif item.get_closest_marker("xdist_group") is None and _uses_module_fixtures(item):
            # one worker runs the module: its fixtures (a server, an engine, a browser) are built once, and its
            # tests run in the order they are written
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    items[:] = _long_work_first(items)


def _long_work_first(items):
    """``items`` with the groups and tests that run vLLM first (each starts vLLM's engines: minutes), then those
    that load real models, then the other groups (a module's shared fixtures), then the rest, each group's tests
    in their order: the workers (``make test`` passes ``--no-loadscope-reorder``, which keeps this order) start the
    long work at once and the short tests fill the end, where pytest-xdist would start groups by their count of
    tests and the longest ones could come last (vLLM's 3-minute group once started last and ran 82 s alone)."""
    item_scopes = [_scope(item) for item in items]
    scopes: dict[str, tuple[int, int]] = {}  # scope -> (class: 0 vLLM, 1 real model, 2 grouped, 3 other; first index)
    for index, (item, scope) in enumerate(zip(items, item_scopes)):
        kind = (0 if item.get_closest_marker("vllm") else 1 if item.get_closest_marker("slow")
                else 2 if scope != item.nodeid else 3)
        known = scopes.get(scope)
        scopes[scope] = (min(kind, known[0]), known[1]) if known else (kind, index)
    order = sorted(range(len(items)), key=lambda index: (*scopes[item_scopes[index]], index))
    return [items[index] for index in order]


def _group(item) -> str | None:
    group = item.get_closest_marker("xdist_group")
    return group.args[0] if group is not None and group.args else None


def _scope(item) -> str:
    return _group(item) or item.nodeid


#: Set on a worker whose grouped tests lost their group: every test there fails with it (a worker's collection error
#: would reach the terminal as an INTERNALERROR without the reason).
UNGROUPED = pytest.StashKey[str]()


def pytest_collection_finish(session):
    """Under ``--dist loadgroup`` a worker's grouped tests carry their group in their ids (pytest-xdist adds it):
    where they do not, the groups were silently split across workers (pytest 9 with pytest-xdist 3.8), and
    every module's fixtures and the run's vLLM process would be built once per worker."""
    if os.environ.get("PYTEST_XDIST_WORKER") and session.config.getvalue("loadgroup"):
        split = [item.nodeid for item in session.items
                 if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid]
        if split:
            session.config.stash[UNGROUPED] = (f"pytest-xdist did not group {len(split)} tests (first: {split[0]}); "
                                               "install the pytest release pyproject.toml pins")


def pytest_runtest_setup(item):
    if UNGROUPED in item.config.stash:
        pytest.fail(item.config.stash[UNGROUPED], pytrace=False)


def _uses_module_fixtures(item) -> bool:
    definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any(defs and defs[-1].scope in ("module", "class") for defs in definitions.values())


@pytest.fixture(scope="session", autouse=True)
def session_kv_cache_folder(tmp_path_factory):
    """Key/value blocks written before a test's own folder is set (by a module's fixtures) go to a folder of this
    session, not the user's cache (subprocesses too)."""
    path = tmp_path_factory.mktemp("kv-session")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAPIDSPEC_KV_CACHE", str(path))
        yield path


@pytest.fixture(autouse=True)
def kv_cache_folder(tmp_path_factory, monkeypatch):
    """Key/value blocks written by a test go to a folder of its own (subprocesses too): a prefill never reads
    what another test wrote. An engine shared by a module keeps the folder of the test that first used it."""
    path = tmp_path_factory.getbasetemp() / "kv" / uuid.uuid4().hex[:12]
    monkeypatch.setenv("RAPIDSPEC_KV_CACHE", str(path))
    return path


@pytest.fixture(scope="session")
def real_model():
    """``real_model(name, dtype="float32", runtime="auto", quantize="none")``: a real model on the CPU, loaded once
    per run for each name, resolved dtype (``auto`` is float32 or bfloat16 by the CPU), runtime and weights
    (``none``: transformers' float copy, what the float32 invariants are checked on; ``gguf``: the file's own
    low-bit blocks, the default of ``load_model``).

    Tests only read what it holds (weights, tokenizer); the engines they build on it keep their own caches.
    """
    from rapidspec.models import load_model
    from rapidspec.models.devices import resolve_dtype

    loaded: dict[tuple[str, torch.dtype, str, str], LoadedModel] = {}

    def load(name: str = "builtin:smollm2-135m", dtype: str = "float32", runtime: str = "auto",
             quantize: str = "none") -> LoadedModel:
        key = (name, resolve_dtype(dtype, torch.device("cpu")), runtime, quantize)
        if key not in loaded:
            loaded[key] = load_model(name, dtype=key[1], device="cpu", runtime=runtime, quantize=quantize)
        return loaded[key]

    return load


@pytest.fixture(scope="session")
def smollm2(real_model) -> LoadedModel:
    """SmolLM2-135M-Instruct (``builtin:smollm2-135m``) in float32 on its default (lean) runtime."""
    return real_model()


@pytest.fixture(scope="session")
def byte_tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(byte_tokenizer):
    return make_tiny_model(0, byte_tokenizer)


@pytest.fixture(scope="session")
def other_tiny_model(byte_tokenizer):
    return make_tiny_model(1, byte_tokenizer)


#: The pytest-xdist group of every test that uses ``local_ray``.
RAY_GROUP = "ray"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Ray stops once its worker's last Ray test is torn down, its module's fixtures (a Serve app) first: its daemons
    and Serve's controller would otherwise take CPU from every later test of that worker until the session ends."""
    result = yield
    if "local_ray" in getattr(item, "fixturenames", ()) and (nextitem is None or _group(nextitem) != RAY_GROUP):
        import ray

        ray.shutdown()
    return result


@pytest.fixture(scope="session")
def local_ray():
    """The run's local Ray (127.0.0.1, no dashboard), started once for the Ray tests (their worker's, under
    ``--dist loadgroup``), with the proxy callback ``rapidspec serve --replicas`` sets for its own Ray. 4 logical
    CPUs: a module's Serve replicas and another's eval actors are placed whatever ran before."""
    import ray

    from rapidspec.scale.proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
        ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()


@pytest.fixture(scope="session")
def vllm_offline(smollm2, tmp_path_factory):
    """The run's one offline vLLM process (tests/vllm_runs.py) on SmolLM2-135M; skipped without vLLM's venv."""
    from rapidspec import Rapid
    from rapidspec.config import DecodeConfig
    from rapidspec.models.export import export_model
    from rapidspec.vllm.environment import vllm_python
    from tests.vllm_runs import CHAT, CHAT_MAX_TOKENS, run_offline

    if vllm_python() is None:
        pytest.skip("vLLM's venv is not set up here (`make vllm`; `make test` runs it)")
    folder = export_model("builtin:smollm2-135m", tmp_path_factory.mktemp("vllm") / "smollm2", dtype="float32")
    config = DecodeConfig(mode="lc", temperature=0.0, max_new_tokens=CHAT_MAX_TOKENS)
    prompt_ids = list(Rapid(target=smollm2).chat_prompts(CHAT, config).target_ids)
    return run_offline(folder, prompt_ids)


def train_bpe_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts`` in milliseconds (emoji/CJK = several tokens)."""
    from tokenizers import trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model, tmp_path_factory):
    """The tiny model saved as a local Hugging Face directory (for CLI commands run as users run them)."""
    path = tmp_path_factory.mktemp("models") / "tiny"
    tiny_model.model.save_pretrained(path)
    tiny_model.tokenizer.save_pretrained(path)
    return path
