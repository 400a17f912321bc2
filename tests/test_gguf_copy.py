"""A llama.cpp drafter reads a Q8_0 copy of a Q4_1 file (made once in the cache), or the file as it is."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

from rapidspec import Rapid
from rapidspec.errors import RapidspecError
from rapidspec.models.spec import ModelSpec
from rapidspec.retrieval import RetrievalConfig
from rapidspec.runtime.gguf_copy import copy_path, copy_type, model_name, weight_type, weights_label
from rapidspec.runtime.llama_cpp import llama_cpp_available
from tests.tiny_gguf import write_tiny_gguf
from tests.specs import spec_of

# the drafter in every round (drafter_start="first"; the default join: test_drafter_join.py)
pytestmark = pytest.mark.usefixtures("drafter_from_the_first_round")

if not llama_cpp_available() and torch.cuda.is_available():  # CUDA machines skip the llama.cpp build
    pytest.skip("llama-cpp-python is not built on CUDA machines", allow_module_level=True)

DOCUMENT = "\n\n".join(f"Paragraph {i}: the mill by the river ground {i} sacks of rye." for i in range(30))
QUESTION = "How many sacks did the mill grind in paragraph 12?"
RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=300)


@pytest.fixture(scope="module")
def q4_1_file(tiny_model, tmp_path_factory):
    import llama_cpp as ll

    folder = tmp_path_factory.mktemp("q4_1")
    source = write_tiny_gguf(tiny_model, folder / "tiny-f32.gguf")
    params = ll.llama_model_quantize_default_params()
    params.ftype = ll.LLAMA_FTYPE_MOSTLY_Q4_1
    target = folder / "tiny.Q4_1.gguf"
    assert ll.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) == 0
    return target


def test_weight_types_read_from_llama_cpp_descriptions():
    assert weight_type("llama 256M Q4_1") == "Q4_1" and weight_type("qwen2 1B Q4_K - Medium") == "Q4_K - Medium"
    assert copy_type("llama 256M Q4_1") == "Q8_0"
    assert copy_type("qwen2 1B Q4_K - Medium") is None and copy_type("llama ?B all F32") is None
    assert weights_label("llama 256M Q8_0", "llama 256M Q4_1") == "Q8_0 copy of Q4_1"


@pytest.mark.parametrize("file, name", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),  # the built-in model
    ("Qwen2.5-Coder-0.5B-Instruct.gguf", "Qwen2.5-Coder-0.5B-Instruct"),
    ("qwen2.5-0.5b-instruct-q4_k_m.gguf", "qwen2.5-0.5b-instruct"),
    ("Llama-3.2-1B-Instruct-IQ4_XS.gguf", "Llama-3.2-1B-Instruct"),
    ("tiny-f32.gguf", "tiny"),
    ("Q8_0.gguf", "Q8_0"),
])
def test_a_drafter_is_named_by_its_file_without_the_weight_type(file, name):
    assert model_name(Path(file)) == name


def test_a_q4_1_drafter_reads_its_q8_0_copy_made_once(tiny_model, q4_1_file, tmp_path, monkeypatch):
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path))
    engine = Rapid(spec_of(retrieval=RETRIEVAL, drafter_backend="llama.cpp"), target=tiny_model, drafter=str(q4_1_file))
    assert engine.drafter_label.endswith("(llama.cpp, tiny, Q8_0 copy of Q4_1)")
    copy = copy_path(q4_1_file, "Q8_0")
    assert copy.is_file() and copy.parent.parent == tmp_path
    written = copy.stat().st_mtime_ns
    lc = Rapid(spec_of(retrieval=RETRIEVAL),
               target=tiny_model).generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=24)
    out = engine.generate(DOCUMENT, QUESTION, mode="rapid", eta=0.0, gamma=4, max_new_tokens=24)
    assert out.token_ids == lc.token_ids and out.stats.drafted_tokens > 0  # greedy, eta = 0: the target's answer

    again = Rapid(spec_of(retrieval=RETRIEVAL, drafter_backend="llama.cpp"), target=tiny_model, drafter=str(q4_1_file))
    assert "Q8_0" in again.drafter_label and copy.stat().st_mtime_ns == written  # found, not written again
    assert [p.name for p in copy.parent.iterdir()] == [copy.name]  # no partial file left

    os.utime(q4_1_file, ns=(written, written + 10**9))  # the same file installed again: another modification time
    Rapid(spec_of(retrieval=RETRIEVAL, drafter_backend="llama.cpp"), target=tiny_model, drafter=str(q4_1_file))
    newer = copy_path(q4_1_file, "Q8_0")
    assert newer != copy and [p.name for p in copy.parent.iterdir()] == [newer.name]  # one copy per file name


def test_as_is_reads_the_file_itself(tiny_model, q4_1_file, tmp_path, monkeypatch):
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path))
    engine = Rapid(spec_of(retrieval=RETRIEVAL, drafter_backend="llama.cpp", drafter_gguf="as-is"),
                   target=tiny_model, drafter=str(q4_1_file))
    assert engine.drafter_label.endswith("(llama.cpp, tiny, Q4_1)")
    assert not (tmp_path / "gguf-copies").exists()


def test_a_bad_choice_is_a_clear_error(tiny_model, q4_1_file):
    with pytest.raises(RapidspecError, match="drafter_gguf must be one of auto, as-is"):
        ModelSpec(drafter_gguf="q8")
    with pytest.raises(RapidspecError, match="drafter_gguf must be one of"):
        Rapid(spec_of(retrieval=RETRIEVAL, drafter_backend="llama.cpp", drafter_gguf="q8"),
              target=tiny_model, drafter=str(q4_1_file))


def test_a_cache_that_cannot_be_written_reads_the_file_as_it_is(tiny_model, q4_1_file, tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(blocked))
    with caplog.at_level("WARNING", logger="rapidspec.drafting.backends"):
        engine = Rapid(spec_of(retrieval=RETRIEVAL, drafter_backend="llama.cpp"),
                       target=tiny_model, drafter=str(q4_1_file))
    assert engine.drafter_label.endswith("Q4_1)")
    assert "no Q8_0 copy for fast prefill" in caplog.text
    out = engine.generate(DOCUMENT, QUESTION, mode="rapid", eta=0.0, gamma=4, max_new_tokens=8)
    assert out.stats.drafted_tokens > 0
