"""Tests of ``rapidspec models export`` (rapidspec.models.export): a model as a standard Hugging Face folder.

Fast tests export the fake GGUF of test_models.py (the tiny tied Llama as its
"de-quantization") and a tiny local folder, each in a cache of its own; the
slow test exports the real built-in model. That vLLM answers from an exported
folder as rapidspec does is tests/test_vllm_checkpoint.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from rapidspec.cli import main
from rapidspec.errors import RapidspecError
from rapidspec.models.export import EXPORT_RECORD, export_model
from rapidspec.models.loading import builtin_gguf_path
from tests.test_models import IDS, fake_gguf, logits, tiny_dir, tiny_model  # noqa: F401  (fake_gguf, tiny_dir: fixtures)


@pytest.fixture(autouse=True)
def isolated_cache(request, tmp_path, monkeypatch):
    """Every fast test gets its own rapidspec cache; slow ones use the user's."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path / "cache"))


def weight_names(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        return set(weights.keys())


def load_exported(folder):
    """The exported folder loaded by transformers, which must find every weight it expects and nothing else."""
    model, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    return model.eval()


def test_a_gguf_exports_as_a_folder_transformers_and_vllm_load(fake_gguf, tmp_path):
    path, _ = fake_gguf
    folder = export_model(str(path), tmp_path / "out", dtype="float32")
    assert folder == tmp_path / "out"
    # the tied embedding under both names: transformers ties them again, vLLM reads model.embed_tokens.weight
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= weight_names(folder)
    assert {"config.json", "generation_config.json", "tokenizer.json", EXPORT_RECORD} <= {p.name for p in folder.iterdir()}
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    model = load_exported(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(logits(model), logits(tiny_model()))
    record = json.loads((folder / EXPORT_RECORD).read_text())
    assert record == {"model": str(path.resolve()), "gguf": str(path.resolve())}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_a_local_folder_exports_with_no_gguf(tiny_dir, tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()  # an empty folder is taken
    export_model(str(tiny_dir), folder, dtype="float32")
    assert torch.equal(logits(load_exported(folder)), logits(tiny_model()))
    assert json.loads((folder / EXPORT_RECORD).read_text()) == {"model": str(tiny_dir.resolve()), "gguf": None}


def test_a_folder_that_is_not_empty_is_refused_before_anything_loads(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(RapidspecError, match="is not empty"):
        export_model("no-such-model", tmp_path / "out")  # the folder is checked first
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("name,folder,message", [
    ("no-such-model", "new", "cannot load model 'no-such-model' offline"),
    ("builtin:no-such", "new", "unknown built-in model 'builtin:no-such'"),
    ("builtin", "taken", "is not empty"),
])
def test_cli_mistakes_are_one_line(name, folder, message, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    assert main(["models", "export", name, str(tmp_path / folder)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "new").exists()


def test_cli_prints_one_line_with_what_was_written(tiny_dir, tmp_path, capsys):
    assert main(["models", "export", str(tiny_dir), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"exported {tiny_dir} to {tmp_path / 'out'} (")
    assert "model.safetensors" in out[0] and EXPORT_RECORD in out[0]


@pytest.mark.slow
def test_the_builtin_model_exports_with_its_chat_template(tmp_path, real_model):
    folder = export_model("builtin:smollm2-135m", tmp_path / "smollm2", dtype="float32")
    names = {p.name for p in folder.iterdir()}
    assert {"chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "model.embed_tokens.weight" in weight_names(folder)
    assert json.loads((folder / EXPORT_RECORD).read_text()) == {"model": "builtin:smollm2-135m", "gguf": str(builtin_gguf_path("builtin:smollm2-135m"))}
    reference = real_model(runtime="transformers")
    assert AutoTokenizer.from_pretrained(str(folder)).chat_template == reference.tokenizer.chat_template
    ids = torch.tensor([reference.tokenizer("The capital of France is")["input_ids"]])
    assert torch.equal(logits(load_exported(folder), ids), logits(reference.model, ids))
