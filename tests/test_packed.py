"""Prepacked linear weights (rapidspec.runtime.packed): same products, no second copy, quantisable."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from rapidspec.models import load_model, low_bit_copy
from rapidspec.runtime import new_kv_cache
from rapidspec.runtime.cache import KVCache
from rapidspec.runtime.packed import (
    PackedLinear,
    ProductSlice,
    pack_fused,
    pack_linears,
    packed_bytes,
    packing_available,
)
from rapidspec.runtime.quantization import Int8Linear

pytestmark = pytest.mark.skipif(not packing_available(torch.float32), reason="this PyTorch build has no oneDNN packing")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (2, 5, 64), (300, 64)])
def test_packed_product_equals_linear(dtype, bias, shape):
    if not packing_available(dtype):
        pytest.skip(f"no packing for {dtype}")
    generator = torch.Generator().manual_seed(len(shape) + shape[0])
    linear = torch.nn.Linear(64, 48, bias=bias).to(dtype)
    torch.nn.init.normal_(linear.weight, generator=generator)
    x = torch.randn(*shape, generator=generator).to(dtype)
    expected = F.linear(x, linear.weight, linear.bias)
    packed = PackedLinear.from_linear(linear)
    assert torch.equal(packed.weight, linear.weight)  # the plain layout comes back exactly
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(packed(x), expected, atol=tolerance, rtol=tolerance)
    assert packed_bytes(packed) == linear.weight.nbytes + (linear.bias.nbytes if bias else 0)


def tied_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


@torch.inference_mode()
def test_pack_linears_replaces_plain_layers_and_keeps_the_tied_embedding():
    model = tied_llama()
    ids = torch.randint(0, 257, (1, 40), generator=torch.Generator().manual_seed(1))
    expected = model(ids).logits
    embedding = model.model.embed_tokens.weight
    layers = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert pack_linears(model) == layers == 2 * 7 + 1
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert model.model.embed_tokens.weight is embedding  # the lookup table stays plain; the head has its own copy
    torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)
    assert pack_linears(model) == 0  # nothing left to pack


def test_pack_linears_leaves_other_dtypes_and_quantised_layers():
    half = torch.nn.Sequential(torch.nn.Linear(32, 16).half())
    assert pack_linears(half) == 0 and type(half[0]) is torch.nn.Linear
    int8 = torch.nn.Sequential(Int8Linear.from_linear(torch.nn.Linear(32, 16)))
    assert pack_linears(int8) == 0 and type(int8[0]) is Int8Linear


@torch.inference_mode()
def test_lean_runtime_packs_and_transformers_runtime_does_not(tiny_model_dir):
    lean = load_model(str(tiny_model_dir), dtype="float32")
    stock = load_model(str(tiny_model_dir), dtype="float32", runtime="transformers")
    assert lean.runtime == "lean" and any(isinstance(m, PackedLinear) for m in lean.model.modules())
    assert not any(isinstance(m, PackedLinear) for m in stock.model.modules())
    ids = torch.randint(0, 250, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    caches = [new_kv_cache(lean), KVCache(lean.model), new_kv_cache(stock)]  # lean, transformers on packed, stock
    first = [cache.prefill(ids[:100]) for cache in caches]
    verify = [cache.forward(ids[100:107], 7) for cache in caches]
    for got in (first[:2], verify[:2]):
        for logits in got:
            torch.testing.assert_close(logits, got[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(verify[0], verify[2], atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_low_bit_copy_of_a_packed_model_quantises_its_layers(tiny_model_dir):
    packed = load_model(str(tiny_model_dir), dtype="float32")
    stock = load_model(str(tiny_model_dir), dtype="float32", runtime="transformers")
    copies = [low_bit_copy(packed, "int8"), low_bit_copy(stock, "int8")]
    for copy in copies:
        assert not any(isinstance(m, PackedLinear) or type(m) is torch.nn.Linear for m in copy.model.modules())
        assert sum(isinstance(m, Int8Linear) for m in copy.model.modules()) == 2 * 7 + 1
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules())  # the original is untouched
    ids = torch.randint(0, 250, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = [new_kv_cache(copy).prefill(ids) for copy in copies]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)  # same int8 weights either way


@torch.inference_mode()
def test_fused_products_are_shared_by_the_slices_that_stand_in_for_the_layers():
    generator = torch.Generator().manual_seed(4)
    fused = torch.nn.Linear(32, 48, bias=True)
    torch.nn.init.normal_(fused.weight, generator=generator)
    parent = torch.nn.Module()
    for name, width in (("q", 16), ("k", 16), ("v", 16)):
        setattr(parent, name, torch.nn.Linear(32, width))
    packed = pack_fused(fused, parent, ["q", "k", "v"])
    assert isinstance(packed, PackedLinear) and all(isinstance(getattr(parent, n), ProductSlice) for n in "qkv")
    calls = []
    original = packed.forward
    packed.forward = lambda x: calls.append(1) or original(x)
    x, y = torch.randn(3, 32, generator=generator), torch.randn(3, 32, generator=generator)
    expected = F.linear(x, fused.weight, fused.bias)
    parts = [parent.q(x), parent.k(x), parent.v(x)]
    assert len(calls) == 1  # one product for the three layers
    torch.testing.assert_close(torch.cat(parts, -1), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(parent.k(y), F.linear(y, fused.weight[16:32], fused.bias[16:32]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(parent.k(x), expected[:, 16:32], atol=1e-5, rtol=1e-5)  # another input: computed afresh
    assert len(calls) == 3
    assert torch.equal(parent.v.weight, fused.weight[32:]) and torch.equal(parent.v.bias, fused.bias[32:])
    assert pack_fused(None, parent, ["q"]) is None


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_a_packed_model_keeps_no_mapping_of_its_checkpoint(tiny_model_dir, tmp_path):
    import gc
    import shutil

    def mapped(path) -> bool:
        gc.collect()
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return any(str(path) in line for line in maps)

    for runtime in ("transformers", "lean"):
        directory = shutil.copytree(tiny_model_dir, tmp_path / runtime)
        loaded = load_model(str(directory), dtype="float32", runtime=runtime)
        checkpoint = directory / "model.safetensors"
        # transformers' forward reads the weights from the mapped file; packed weights are copies, and the
        # parameters left (embedding, norms) get their own memory, so the file's pages can go.
        assert mapped(checkpoint) == (runtime == "transformers")
        del loaded
