"""A llama.cpp drafter's state on disk (rapidspec.runtime.llama_state_store): read by a later engine, checked."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save

from rapidspec import Rapid
from rapidspec.cli.cache import models
from rapidspec.retrieval import RetrievalConfig
from rapidspec.runtime.kv_store import list_files
from rapidspec.runtime.llama_cpp import LlamaCppModel, llama_cpp_available
from rapidspec.runtime.kv_blocks import checksum
from rapidspec.runtime.llama_state_store import FORMAT, for_llama_model
from tests.tiny_gguf import write_tiny_gguf
from tests.specs import spec_of

pytestmark = pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed")

DOCUMENT = "\n\n".join(f"Note {i}: the ferry left pier {i % 9} with {i} crates of pears." for i in range(30))
RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=300)
# sd: the drafter reads the whole document (about 1,900 byte tokens here), so its prefill is what a snapshot saves
ASK = dict(mode="sd", gamma=4, max_new_tokens=16, drafter_start="first")


@pytest.fixture(scope="module")
def gguf(tiny_model, tmp_path_factory):
    return str(write_tiny_gguf(tiny_model, tmp_path_factory.mktemp("gguf") / "self.gguf"))


def engine(tiny_model, gguf, folder, **options) -> Rapid:
    """An engine as a new process would have it: its own pools, the disk its only memory of earlier answers."""
    return Rapid(spec_of(retrieval=RETRIEVAL, drafter_backend="llama.cpp", kv_cache_dir=str(folder), **options),
                 target=tiny_model, drafter=gguf)


def written(rapid: Rapid):
    store = rapid.drafting.pool("llama.cpp").store
    store.flush()
    return store


def test_a_context_takes_back_its_state_exactly(gguf):
    model = LlamaCppModel(gguf, threads=1)
    first = model.new_context(1200)
    ids = [40 + i % 200 for i in range(1100)]  # more than one context quantum (1,024)
    first.prefill(ids)
    state = first.state()
    expected = first.forward([7])
    second = model.new_context(1200)
    assert second.load_state(state, ids) and second.token_ids == ids
    assert torch.equal(second.forward([7]), expected)
    assert not second.load_state(state[:-9], ids) and second.length == 0  # llama.cpp refuses a cut state
    assert not model.new_context(1000).load_state(state, ids)  # more tokens than the context has room for


def test_a_later_engine_reads_the_drafters_state_and_answers_the_same(tiny_model, gguf, tmp_path):
    first = engine(tiny_model, gguf, tmp_path)
    answer = first.generate(DOCUMENT, "Which pier did ferry 12 leave?", **ASK)
    assert answer.stats.drafter_prefill_disk_tokens == 0 and answer.stats.drafted_tokens > 0
    assert written(first).blocks_written == 1

    same = engine(tiny_model, gguf, tmp_path).generate(DOCUMENT, "Which pier did ferry 12 leave?", **ASK)
    assert same.stats.drafter_prefill_disk_tokens == same.stats.prompt_tokens_drafter - 1  # all it prefills
    assert same.token_ids == answer.token_ids

    question = "How many crates did ferry 20 carry?"
    later = engine(tiny_model, gguf, tmp_path)
    other = later.generate(DOCUMENT, question, **ASK)
    nothing = engine(tiny_model, gguf, tmp_path, kv_cache_gib=0).generate(DOCUMENT, question, **ASK)
    # the document's tokens came from disk, the question's were prefilled
    assert len(DOCUMENT) - 64 < other.stats.drafter_prefill_disk_tokens < other.stats.prompt_tokens_drafter - 1
    assert nothing.stats.drafter_prefill_reused_tokens == 0
    assert other.token_ids == nothing.token_ids
    assert len(snapshots(written(later))) == 1  # the document is not kept again with each question


def test_nothing_is_kept_without_a_bound_or_without_reuse(tiny_model, gguf, tmp_path):
    assert engine(tiny_model, gguf, tmp_path, kv_cache_gib=0).drafting.pool("llama.cpp").store is None
    assert engine(tiny_model, gguf, tmp_path, reuse_document_cache=False).drafting.pool("llama.cpp").store is None


def _snapshot(tiny_model, gguf, folder):
    """A folder holding one snapshot of the document's drafter cache, and its path."""
    first = engine(tiny_model, gguf, folder)
    first.generate(DOCUMENT, "Which pier did ferry 3 leave?", **ASK)
    store = written(first)
    (path,) = snapshots(store)
    return store, path


def _forged(path, store, state: torch.Tensor, ids: torch.Tensor, **meta) -> None:
    """Rewrite ``path`` with ``state`` and ``ids`` and a checksum that matches them."""
    prefix = path.name.split("-", 1)[0]
    fields = {"format": FORMAT, "model": store.key, "prefix": prefix, "tokens": str(len(ids)),
              "checksum": checksum(state, ids), **meta}
    path.write_bytes(save({"state": state, "token_ids": ids}, metadata=fields))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "another model", "a state llama.cpp refuses"])
def test_a_damaged_or_foreign_snapshot_is_removed_and_never_loaded(tiny_model, gguf, tmp_path, damage, caplog):
    store, path = _snapshot(tiny_model, gguf, tmp_path)
    content = bytearray(path.read_bytes())
    if damage == "flipped byte":
        content[-100] ^= 0xFF
        path.write_bytes(bytes(content))
    elif damage == "truncated":
        path.write_bytes(bytes(content[: len(content) // 2]))
    else:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as file:
            state, ids = file.get_tensor("state"), file.get_tensor("token_ids")
        if damage == "another model":
            _forged(path, store, state, ids, model="0" * 24)
        else:  # a checksum that matches bytes llama.cpp cannot read
            _forged(path, store, torch.zeros(state.numel() // 2, dtype=torch.uint8), ids)
    question = "Which pier did ferry 3 leave?"
    out = engine(tiny_model, gguf, tmp_path).generate(DOCUMENT, question, **ASK)
    fresh = engine(tiny_model, gguf, tmp_path / "empty").generate(DOCUMENT, question, **ASK)
    assert out.stats.drafter_prefill_disk_tokens == 0 and out.token_ids == fresh.token_ids
    assert "is not loaded" in caplog.text


def test_snapshots_are_listed_bounded_and_replaced_by_longer_ones(gguf, tmp_path):
    model = LlamaCppModel(gguf, threads=1)
    store = for_llama_model(model, "self", 2**30, tmp_path)
    ids = [40 + i % 200 for i in range(700)]
    context = model.new_context(1200)
    context.prefill(ids[:400])
    store.write(context).result()
    (first,) = snapshots(store)
    assert store.write(context) is None  # the folder holds it
    context.prefill(ids[400:])  # the next turn of a chat: this snapshot continues the first
    store.write(context).result()
    (second,) = snapshots(store)
    assert second != first
    (listed,) = models(tmp_path)
    assert listed["model"]["runtime"] == "llama.cpp" and listed["tokens"] == 700
    other = model.new_context(1200)
    other.prefill(ids[:300] + [7] * 50)  # 50 tokens beyond what a snapshot holds: the next process prefills them
    assert store.write(other) is None
    other.prefill([7] * 250)  # 300 beyond: a snapshot of its own
    store.write(other).result()
    assert len(snapshots(store)) == 2
    fresh = model.new_context(1200)
    assert store.extend(fresh, ids[:650] + [9] * 10) == 650  # the one sharing the most tokens, cropped there
    store.max_bytes = 1
    assert store.evict() == 2 and not snapshots(store)


def snapshots(store):
    return [path for path, _, _ in list_files(store.root) if path.parent == store.folder]
