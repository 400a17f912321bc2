"""Every cache rapidspec writes works in a read-only folder and on a full disk.

Each fault comes two ways: injected where the shared writer
(:func:`rapidspec.runtime.cache_dir.cache_write`) renames a finished temporary
file into place (so all it wrote must be removed again), and real where the
machine allows (chmod, or as root, who ignores permission bits, a read-only
bind mount; a 64 KiB tmpfs filled up). Each test checks that the answer still
comes, that no partial or temporary file is left, that one warning is logged
per cause however often the cache is asked, and that what a read-only folder
holds already is still read.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from rapidspec.drafting.calibration import CostBook
from rapidspec.errors import RapidspecError
from rapidspec.models import load_model
from rapidspec.models import store as model_store
from rapidspec.runtime import attention, cache_dir
from rapidspec.runtime.cache_dir import cache_write
from tests import test_models
from tests.test_models import fake_gguf  # noqa: F401  (a fixture)
from tests.test_retrieval_embedding_store import CountingEmbedder, embedding_files, retriever
from tests.retrieval_stand_ins import haystack
from tests.test_retrieval_retriever import tiny_tokenizer
from tests.specs import spec_of

FAULTS = {"read-only": errno.EROFS, "full": errno.ENOSPC}


def mount(*args: str) -> bool:
    """``mount args`` succeeded (False where there is no mount command or no right to mount)."""
    return shutil.which("mount") is not None and subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def undo():
    """What the test changed outside Python (mounts, modes), undone after it, the last first."""
    steps: list = []
    yield steps
    for step in reversed(steps):
        step()


def inject(monkeypatch, code: int) -> None:
    """Every cache_write fails with ``code`` once its temporary is written whole."""

    def fail(temporary, target):
        assert temporary.exists()  # written: cache_write must remove it
        raise OSError(code, os.strerror(code), str(target))

    monkeypatch.setattr(cache_dir, "_rename", fail)


def seal(folder: Path, undo) -> None:
    """Make ``folder`` read-only for real: chmod, or as root (who writes anyway) a read-only bind mount."""
    if os.geteuid() != 0:
        modes = [(path, path.stat().st_mode) for path in [folder, *folder.rglob("*")] if path.is_dir()]
        for path, mode in modes:
            path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))

        def restore():
            for path, mode in modes:
                path.chmod(mode)

        undo.append(restore)
        return
    if not mount("--bind", str(folder), str(folder)):
        pytest.skip("cannot bind-mount a folder here (root ignores permission bits)")
    undo.append(lambda: subprocess.run(["umount", "--lazy", str(folder)], capture_output=True))  # lazy: a model may still map its files
    assert mount("-o", "remount,bind,ro", str(folder))


def small_disk(folder: Path, undo) -> Path:
    """A 64 KiB tmpfs mounted at ``folder`` (made here); skipped where it cannot be mounted."""
    folder.mkdir()
    if os.geteuid() != 0 or not mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)):
        pytest.skip("cannot mount a small tmpfs here (needs root and the right to mount)")
    undo.append(lambda: subprocess.run(["umount", "--lazy", str(folder)], capture_output=True))  # lazy: a model may still map its files
    return folder


def fill(folder: Path) -> None:
    """Write ``folder/filler`` until its disk is full (a bounded loop: 64 KiB fill well before 1 MiB)."""
    with open(folder / "filler", "wb", buffering=0) as out:
        for _ in range(1024):
            try:
                out.write(b"\0" * 1024)
            except OSError as err:
                assert err.errno == errno.ENOSPC
                return
    pytest.fail(f"{folder} took 1 MiB: not a small disk")


@pytest.fixture(params=["injected", "real"])
def way(request):
    return request.param


def fault_folder(kind: str, way: str, tmp_path: Path, monkeypatch, undo, before=lambda folder: None) -> Path:
    """``tmp_path/cache`` with the fault ``kind`` made ``way``; ``before(folder)`` fills it while it can be written."""
    folder = tmp_path / "cache"
    if way == "real" and kind == "full":
        small_disk(folder, undo)
    else:
        folder.mkdir()
    before(folder)
    if way == "injected":
        inject(monkeypatch, FAULTS[kind])
    elif kind == "read-only":
        seal(folder, undo)
    else:
        fill(folder)
    return folder


def files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its content (what a failed write must leave as it was)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == cache_dir.__name__ and r.levelno == logging.WARNING]


# ---------------------------------------------------------------- the shared writer


def test_cache_write_removes_what_it_wrote_and_warns_once_per_cause(tmp_path, caplog):
    target = tmp_path / "cache" / "entry.bin"

    def fill_then_fail(code):
        def write(temporary):
            temporary.write_bytes(b"x" * 4096)
            raise OSError(code, os.strerror(code))
        return write

    with caplog.at_level(logging.WARNING):
        for code in (errno.ENOSPC, errno.ENOSPC, errno.EROFS, errno.ENOSPC):
            assert not cache_write(target, fill_then_fail(code), "test entries", "going on without them")
        assert cache_write(target, lambda temporary: temporary.write_bytes(b"kept"), "test entries", "-")
    assert files(tmp_path / "cache") == {"entry.bin": b"kept"}
    assert warnings(caplog) == [
        f"cannot store test entries in {target.parent} (No space left on device): going on without them",
        f"cannot store test entries in {target.parent} (Read-only file system): going on without them",
    ]


# ---------------------------------------------------------------- embeddings


@pytest.mark.parametrize("kind", ["read-only", "full"])
def test_embeddings_are_served_and_what_is_stored_is_read(kind, way, tmp_path, monkeypatch, undo, caplog):
    tok, stored = tiny_tokenizer(), haystack(40, seed=7)
    expected = {}

    def store_one(folder):
        result = retriever(tok, CountingEmbedder(), folder).retrieve(stored, "winter")
        expected["chunks"] = [c.index for c in result.chunks]

    folder = fault_folder(kind, way, tmp_path, monkeypatch, undo, store_one)
    before = files(folder)
    with caplog.at_level(logging.WARNING):
        for seed in range(3):  # new documents: each would be stored
            result = retriever(tok, CountingEmbedder(), folder).retrieve(haystack(20, seed=seed), "winter garden")
            assert result.chunks
        embedder = CountingEmbedder()
        again = retriever(tok, embedder, folder).retrieve(stored, "winter")
    assert embedder.texts == 1 and [c.index for c in again.chunks] == expected["chunks"]  # read, not embedded
    assert files(folder) == before and len(embedding_files(folder)) == 1
    assert len(warnings(caplog)) == 1 and "embedding without the disk store" in warnings(caplog)[0]


# ---------------------------------------------------------------- attention paths and step costs


@pytest.fixture
def fresh_attention_paths():
    attention.fastest_short_query_path.cache_clear()
    yield
    attention.fastest_short_query_path.cache_clear()


@pytest.mark.parametrize("kind", ["read-only", "full"])
def test_attention_paths_kept_are_taken_and_new_ones_default(kind, way, tmp_path, monkeypatch, undo, caplog,
                                                            fresh_attention_paths):
    shape = (torch.float32, 4, 2, 1, 256, 8, torch.get_num_threads())  # dtype, heads, kv heads, q, keys, d, threads
    default = attention.default_short_query_path(256)
    other = next(p for p in attention.SHORT_QUERY_PATHS if p != default)

    def keep_one(folder):
        monkeypatch.setenv(attention.CHOICES_FILE_ENV, str(folder / "attention_paths.json"))
        attention.fastest_short_query_path(*shape)
        content = json.loads((folder / "attention_paths.json").read_text())
        [(key, _)] = content["machines"][attention.machine_key()].items()
        content["machines"][attention.machine_key()][key] = other  # not what a measurement or the default gives
        (folder / "attention_paths.json").write_text(json.dumps(content))
        attention.fastest_short_query_path.cache_clear()

    folder = fault_folder(kind, way, tmp_path, monkeypatch, undo, keep_one)
    before = files(folder)
    with caplog.at_level(logging.WARNING):
        assert attention.fastest_short_query_path(*shape) == other  # kept: taken
        for keys in (512, 1024, 2048):
            assert attention.fastest_short_query_path(*shape[:4], keys, *shape[5:]) in attention.SHORT_QUERY_PATHS
    assert attention.fastest_short_query_path(*shape[:4], 2048, *shape[5:]) == attention.default_short_query_path(2048)
    assert files(folder) == before
    assert len(warnings(caplog)) == 1 and "default path" in warnings(caplog)[0]


@pytest.mark.parametrize("kind", ["read-only", "full"])
def test_step_costs_kept_are_read_and_new_ones_stay_in_memory(kind, way, tmp_path, monkeypatch, undo, caplog):
    def measured_already():
        raise AssertionError("a kept cost was measured again")

    def keep_one(folder):
        assert CostBook(folder / "step_costs.json").get(float, "probe a", lambda: 1.5) == 1.5

    folder = fault_folder(kind, way, tmp_path, monkeypatch, undo, keep_one)
    before, book = files(folder), CostBook(folder / "step_costs.json")
    with caplog.at_level(logging.WARNING):
        assert book.get(float, "probe a", measured_already) == 1.5
        assert book.get(float, "probe b", lambda: 2.5) == 2.5
        assert book.get(float, "probe b", measured_already) == 2.5  # kept in memory
        assert book.get(float, "probe c", lambda: 3.5) == 3.5
    assert files(folder) == before
    assert len(warnings(caplog)) == 1 and "measured again by each process" in warnings(caplog)[0]


# ---------------------------------------------------------------- GGUF conversions


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> Path:
    """The temporary folder ($TMPDIR) of the test, to see that a conversion for one load is removed."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def load(path):
    return load_model(str(path), dtype="float32", device="cpu", runtime="transformers")


@pytest.mark.parametrize("kind", ["read-only", "full"])
def test_a_gguf_file_loads_without_a_cache_that_can_take_its_conversion(kind, way, fake_gguf, tmp_path, monkeypatch,
                                                                       undo, scratch, caplog):
    path, calls = fake_gguf
    folder = fault_folder(kind, way, tmp_path, monkeypatch, undo)
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(folder))
    before = files(folder)
    reference = test_models.logits(test_models.tiny_model())
    with caplog.at_level(logging.WARNING):
        for loads in (1, 2):
            assert torch.equal(test_models.logits(load(path).model), reference)
            assert calls["model"] == loads  # converted for each load
    assert files(folder) == before and list(scratch.iterdir()) == []
    assert len(warnings(caplog)) == 1 and "temporary folder removed after loading" in warnings(caplog)[0]


def test_a_conversion_in_a_read_only_cache_is_read(way, fake_gguf, tmp_path, monkeypatch, undo, caplog):
    path, calls = fake_gguf
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path / "cache"))
    fault_folder("read-only", way, tmp_path, monkeypatch, undo, lambda folder: load(path))
    with caplog.at_level(logging.WARNING):
        load(path)
    assert calls["model"] == 1 and warnings(caplog) == []


def test_a_conversion_no_folder_can_take_is_one_line(fake_gguf, tmp_path, monkeypatch, scratch, caplog):
    path, _ = fake_gguf
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path / "cache"))

    def full(model, weights):
        weights.write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(weights))

    monkeypatch.setattr("rapidspec.models.conversion._save_weights", full)
    with pytest.raises(RapidspecError, match="neither the cache folder .* nor the temporary folder") as caught:
        load(path)
    assert "\n" not in str(caught.value) and "No space left on device" in str(caught.value)
    assert files(tmp_path / "cache") == {} and list(scratch.iterdir()) == []


# ---------------------------------------------------------------- llama.cpp fast-prefill copies


@pytest.fixture(scope="module")
def q4_1_file(tiny_model, tmp_path_factory):
    from rapidspec.runtime.llama_cpp import llama_cpp_available

    if not llama_cpp_available():
        pytest.skip("llama-cpp-python is not installed")
    import ctypes

    import llama_cpp as ll

    from tests.tiny_gguf import write_tiny_gguf

    folder = tmp_path_factory.mktemp("q4_1")
    source = write_tiny_gguf(tiny_model, folder / "tiny-f32.gguf")
    params = ll.llama_model_quantize_default_params()
    params.ftype = ll.LLAMA_FTYPE_MOSTLY_Q4_1
    assert ll.llama_model_quantize(str(source).encode(), str(folder / "tiny.Q4_1.gguf").encode(),
                                   ctypes.byref(params)) == 0
    return folder / "tiny.Q4_1.gguf"


@pytest.mark.parametrize("kind", ["read-only", "full"])
def test_a_llama_cpp_drafter_reads_its_file_as_it_is(kind, way, q4_1_file, tiny_model, tmp_path, monkeypatch,
                                                    undo, caplog, drafter_from_the_first_round):
    from rapidspec import Rapid
    from rapidspec.retrieval import RetrievalConfig
    from rapidspec.runtime.gguf_copy import fast_prefill_copy

    folder = fault_folder(kind, way, tmp_path, monkeypatch, undo)
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(folder))
    before = files(folder)
    with caplog.at_level(logging.WARNING):
        assert fast_prefill_copy(q4_1_file, "Q8_0", 1) is None
        engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25", chunk_tokens=64), drafter_backend="llama.cpp"),
                       target=tiny_model, drafter=str(q4_1_file))
        out = engine.generate(haystack(10), "winter?", mode="rapid", eta=0.0, gamma=4, max_new_tokens=8)
    assert engine.drafter_label.endswith("Q4_1)") and out.token_ids and out.stats.drafted_tokens > 0
    assert files(folder) == before
    copies = [line for line in warnings(caplog) if "Q8_0 copy" in line]  # injected faults hit the other caches too
    assert len(copies) == 1 and "the drafter reads the file as it is" in copies[0]


def test_a_copy_in_a_read_only_cache_is_read(way, q4_1_file, tmp_path, monkeypatch, undo):
    from rapidspec.runtime.gguf_copy import fast_prefill_copy

    monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path / "cache"))
    kept = {}
    fault_folder("read-only", way, tmp_path, monkeypatch, undo,
                 lambda folder: kept.setdefault("copy", fast_prefill_copy(q4_1_file, "Q8_0", 1)))
    assert kept["copy"] is not None and fast_prefill_copy(q4_1_file, "Q8_0", 1) == kept["copy"]


# ---------------------------------------------------------------- installs and builds: clear one-line errors


def test_installing_a_model_into_a_read_only_cache_is_refused_before_pip(tmp_path, monkeypatch, undo):
    folder = tmp_path / "cache"
    (folder / "models").mkdir(parents=True)
    seal(folder, undo)
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(folder))
    calls = []
    monkeypatch.setattr(model_store, "builtin_entry", lambda name: ("fake", _split_entry()))
    with pytest.raises(RapidspecError, match="cannot write Fake.gguf into .*(Read-only|Permission)") as caught:
        model_store.install_model("fake", pip=calls.append)
    assert calls == [] and "\n" not in str(caught.value)


def _split_entry():
    from rapidspec.models.loading import BuiltinModel, PartWheels

    parts = PartWheels(project_prefix="rapidspec-fake-part", count=2, version="1.0", size=10, sha256="0" * 64)
    return BuiltinModel(package="", pip_spec="", filename="Fake.gguf", description="fake", context_length=64,
                        parts=parts)


@pytest.mark.parametrize("way", ["injected", "real"])
def test_assembling_a_model_on_a_full_disk_is_one_line_and_leaves_nothing(way, tmp_path, undo):
    part = tmp_path / "part1.bin"
    part.write_bytes(b"\1" * 200_000)
    folder = tmp_path / "cache"
    if way == "real":
        small_disk(folder, undo)
        fill(folder)
    before = files(folder) if folder.exists() else {}

    def progress(done, total):
        if way == "injected":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(RapidspecError, match="No space left on device") as caught:
        model_store.assemble_parts([part], folder / "models" / "m.gguf", 200_000,
                                   hashlib.sha256(part.read_bytes()).hexdigest(), progress)
    assert "\n" not in str(caught.value) and files(folder) == before


def test_a_llama_server_build_needs_a_cache_that_can_keep_it(tmp_path, monkeypatch, undo):
    from rapidspec.bench import llama_server

    folder = tmp_path / "cache"
    folder.mkdir()
    seal(folder, undo)
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(folder))
    monkeypatch.setattr(llama_server, "installed_version", lambda: "0.0.0")
    monkeypatch.setattr(llama_server.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(llama_server, "_run", lambda *args: pytest.fail("built although the binary cannot be kept"))
    with pytest.raises(RapidspecError, match="cannot keep a llama-server build in") as caught:
        llama_server.build_llama_server()
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------- the target's key/value blocks


@pytest.mark.parametrize("kind", ["read-only", "full"])
def test_key_value_blocks_where_they_cannot_be_written(kind, way, tiny_model, tmp_path, monkeypatch, undo, caplog):
    from rapidspec import Rapid
    from rapidspec.retrieval import RetrievalConfig

    document = " ".join(f"Dock {i}: the crane lifted {i * 13} crates before dusk." for i in range(40))

    def engine(folder: Path) -> Rapid:
        return Rapid(spec_of(retrieval=RetrievalConfig(method="bm25"), kv_cache_dir=str(folder / "kv")),
                     target=tiny_model)

    def before(folder: Path) -> None:  # a first process writes the document's blocks while the folder takes them
        first = engine(folder)
        first.generate(document, "How many crates at dock 3?", mode="lc", max_new_tokens=4)
        first.disk_store.flush()

    folder = fault_folder(kind, way, tmp_path, monkeypatch, undo, before)
    held = files(folder)
    second = engine(folder)
    with caplog.at_level(logging.WARNING):
        outs = []
        for _ in range(3):
            outs.append(second.generate(document, "And at dock 30?", mode="lc", max_new_tokens=4))
            second.disk_store.flush()
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert outs[1].stats.target_prefill_reused_tokens > 0  # from memory
    if any(name.endswith(".safetensors") for name in held):  # blocks held before the fault are read (64 KiB: none)
        assert outs[0].stats.target_prefill_disk_tokens > 0
    logged = warnings(caplog)
    assert len(logged) == 1 and "cannot store key/value blocks" in logged[0], logged
    assert files(folder) == held  # nothing partial, nothing temporary
