"""Int8 and int4 weight-only linear layers and low-bit drafters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rapidspec import Rapid, load_model, low_bit_copy
from rapidspec.errors import RapidspecError
from rapidspec.runtime import dynamic_int8
from rapidspec.runtime.errors import QuantizationError
from rapidspec.runtime.quantization import (
    INT4_GROUP,
    KERNEL_DTYPE,
    KERNEL_MAX_ROWS,
    Int4Linear,
    Int8Linear,
    check_quantization,
    quantize_linears,
    quantize_weight,
    quantize_weight_int4,
    quantized_copy,
)
from tests.conftest import make_tiny_model
from tests.test_engine import DOCUMENT, QUESTION, engine


@pytest.fixture(scope="module")
def wide_tiny_model(byte_tokenizer):
    """Hidden size 64: its blocks' layers have widths int4 takes (the 32-wide tiny model's do not)."""
    return make_tiny_model(0, byte_tokenizer, hidden_size=64)


def test_quantize_weight_rounds_each_channel_to_half_a_step():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 40, generator=generator) * torch.linspace(0.01, 5.0, 24)[:, None]  # [out, in]
    weight[3] = 0.0  # an all-zero channel must not divide by zero
    weight_int8, scales = quantize_weight(weight)
    assert weight_int8.dtype == torch.int8 and weight_int8.shape == weight.shape and scales.shape == (24,)
    assert int(weight_int8.abs().max()) == 127  # the largest entry of a channel uses the full range
    error = (weight_int8.float() * scales[:, None] - weight).abs()
    assert bool((error <= scales[:, None] / 2 + 1e-7).all())
    assert bool((weight_int8[3] == 0).all())


# (layer, input width): the int8 kernel width, a width that takes int8's dequantised path, int4
LAYERS = [(Int8Linear, 64), (Int8Linear, 40), (Int4Linear, 2 * INT4_GROUP)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("layer", "in_features"), LAYERS)
@pytest.mark.parametrize("rows", [1, 3, KERNEL_MAX_ROWS + 9])  # the kernels, and the dequantised product
@pytest.mark.parametrize("bias", [True, False])
def test_low_bit_linear_equals_the_dequantised_product(dtype, layer, in_features, rows, bias):
    generator = torch.Generator().manual_seed(rows + in_features)
    linear = nn.Linear(in_features, 48, bias=bias).to(dtype)
    quantized = layer.from_linear(linear)
    x = torch.randn(2, rows, in_features, generator=generator).to(dtype)  # [batch, rows, in]
    dequantised = quantized.dequantized(torch.float64)  # [out, in]
    expected = F.linear(x.double(), dequantised, None if linear.bias is None else linear.bias.double())
    got = quantized(x)
    assert got.shape == (2, rows, 48) and got.dtype == dtype
    # the kernels: int4 rounds its inputs to bfloat16 (KERNEL_DTYPE), int8 to 8 bits per row (dynamic_int8)
    int8_dynamic = layer is Int8Linear and dynamic_int8.AVAILABLE
    kernel = in_features % 32 == 0 and (rows <= KERNEL_MAX_ROWS or int8_dynamic)
    tolerance = 1e-5 if dtype == torch.float32 and not kernel else 3e-2
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize("layer", [Int8Linear, Int4Linear])
def test_kernel_and_dequantised_paths_agree_row_by_row(layer):
    generator = torch.Generator().manual_seed(3)
    quantized = layer.from_linear(nn.Linear(2 * INT4_GROUP, 80))
    x = torch.randn(KERNEL_MAX_ROWS + 4, 2 * INT4_GROUP, generator=generator)  # [rows, in]
    whole = F.linear(x, quantized.dequantized(torch.float32), quantized.bias)  # the dequantised product
    by_row = torch.cat([quantized(x[i : i + 1]) for i in range(x.shape[0])])  # one row at a time: the kernel
    # the same weights; the kernels round their inputs (to bfloat16 or 8 bits), a wrong layout would be off by ~100%
    torch.testing.assert_close(by_row, whole, rtol=0, atol=2e-2 * whole.abs().max().item())


def _logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()  # [len, V]


def test_quantize_linears_replaces_every_linear_and_stays_close(tiny_model):
    ids = list(range(40, 90))
    clone = quantized_copy(tiny_model.model)
    layers = tiny_model.model.config.num_hidden_layers
    assert sum(isinstance(m, Int8Linear) for m in clone.modules()) == layers * 7 + 1  # q k v o gate up down + head
    assert not any(type(m) is nn.Linear for m in clone.modules())
    reference, got = _logits(tiny_model.model, ids), _logits(clone, ids)
    assert (got - reference).abs().max() < 0.02 * reference.abs().max()
    assert quantize_linears(nn.Sequential(nn.ReLU())) == 0


def test_quantized_copy_leaves_the_original_alone_and_shares_other_tensors(tiny_model):
    ids = list(range(50, 70))
    before = _logits(tiny_model.model, ids)
    clone = quantized_copy(tiny_model.model)
    assert torch.equal(_logits(tiny_model.model, ids), before)
    assert type(tiny_model.model.lm_head) is nn.Linear
    original_embedding = tiny_model.model.get_input_embeddings().weight
    assert clone.get_input_embeddings().weight.data_ptr() == original_embedding.data_ptr()
    norms = [(a.weight.data_ptr(), b.weight.data_ptr()) for a, b in zip(tiny_model.model.modules(), clone.modules())
             if "Norm" in type(a).__name__]
    assert norms and all(a == b for a, b in norms)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_low_bit_self_drafter_keeps_greedy_output_equal_to_lc(wide_tiny_model, method):
    other = make_tiny_model(1, wide_tiny_model.tokenizer, hidden_size=64)
    lc = engine(wide_tiny_model).generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=40)
    for drafter in (low_bit_copy(wide_tiny_model, method, name="self"), low_bit_copy(other, method)):
        if method == "int4":
            assert any(isinstance(m, Int4Linear) for m in drafter.model.modules())
        out = engine(wide_tiny_model, drafter).generate(
            DOCUMENT, QUESTION, mode="ragsd", eta=0.0, gamma=4, max_new_tokens=40, drafter_start="first"
        )
        assert out.token_ids == lc.token_ids
        assert out.stats.rounds > 0
    self_drafter = low_bit_copy(wide_tiny_model, method, name="self")
    rapid = engine(wide_tiny_model, self_drafter).generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=20)
    assert len(rapid.token_ids) > 0


def test_labels_and_validation(tiny_model):
    assert tiny_model.label == tiny_model.name
    assert low_bit_copy(tiny_model, name="self").label == "self int8"
    assert low_bit_copy(tiny_model, "int4", name="self").label == "self int4"
    assert check_quantization("int4") == "int4"
    # the runtime raises its own ValueError; the user's options (load_model, low_bit_copy) get RapidspecError
    with pytest.raises(QuantizationError, match="auto, none, int8, int4, gguf"):
        check_quantization("int3")
    with pytest.raises(RapidspecError, match="^quantize must be one of auto, none, int8, int4, gguf, got 'int3'$"):
        load_model("builtin", quantize="int3")
    with pytest.raises(RapidspecError, match="already has int8 weights"):
        low_bit_copy(low_bit_copy(tiny_model))
    with pytest.raises(QuantizationError, match="cannot quantize"):
        quantize_linears(nn.Sequential(nn.Linear(64, 16)), "none")
    with pytest.raises(RapidspecError, match="^cannot quantize linear layers with 'none'; use one of int8, int4$"):
        low_bit_copy(tiny_model, "none")


def test_engine_reads_the_vocabulary_of_a_low_bit_head(tiny_model):
    rapid = Rapid(target=tiny_model, drafter=low_bit_copy(tiny_model))
    assert rapid.vocab_size == tiny_model.model.config.vocab_size


# ------------------------------------------------------------------ int4


def test_quantize_weight_int4_rounds_each_group_to_half_a_step():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(16, 3 * INT4_GROUP, generator=generator) * torch.linspace(0.01, 5.0, 16)[:, None] + 0.3
    weight[2, :INT4_GROUP] = 0.7  # a constant group must be exact and not divide by zero
    codes, scales, zeros = quantize_weight_int4(weight, torch.float32)
    assert codes.dtype == torch.uint8 and codes.shape == weight.shape and scales.shape == zeros.shape == (16, 3)
    assert int(codes.max()) == 15 and int(codes.min()) == 0  # a group's extremes use the full range
    grouped = codes.reshape(16, 3, INT4_GROUP).float()
    restored = ((grouped - 8) * scales[..., None] + zeros[..., None]).reshape(weight.shape)
    error = (restored - weight).abs().reshape(16, 3, INT4_GROUP)
    assert bool((error <= scales[..., None] / 2 + 1e-6).all())
    assert torch.allclose(restored[2, :INT4_GROUP], weight[2, :INT4_GROUP])


def test_int4_linear_unpacks_its_codes():
    linear = nn.Linear(2 * INT4_GROUP, 32)
    codes, scales, zeros = quantize_weight_int4(linear.weight, KERNEL_DTYPE)
    layer = Int4Linear.from_linear(linear)
    scales, zeros = scales.float(), zeros.float()
    expected = ((codes.reshape(32, 2, INT4_GROUP).float() - 8) * scales[..., None] + zeros[..., None]).reshape(32, -1)
    assert torch.equal(layer.dequantized(torch.float32), expected)
    assert layer.codes_packed.shape == (32, INT4_GROUP) and layer.kernel_weight is not None


def test_int4_quantize_linears_keeps_int8_where_widths_do_not_fit(wide_tiny_model):
    ids = list(range(40, 90))
    clone = quantized_copy(wide_tiny_model.model, "int4")
    layers = wide_tiny_model.model.config.num_hidden_layers
    assert sum(isinstance(m, Int4Linear) for m in clone.modules()) == layers * 7  # every block layer
    vocab = wide_tiny_model.model.config.vocab_size
    assert isinstance(clone.lm_head, Int4Linear if vocab % 16 == 0 else Int8Linear)
    assert not any(type(m) is nn.Linear for m in clone.modules())
    reference, got = _logits(wide_tiny_model.model, ids), _logits(clone, ids)
    # 4-bit codes of Gaussian weights carry ~9% noise each; a wrong layout would be off by ~100%
    assert (got - reference).abs().max() < 0.25 * reference.abs().max()


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "mps"])
def test_low_bit_weights_off_the_cpu_are_refused_pointing_at_bfloat16(device):
    from rapidspec.errors import RapidspecError
    from rapidspec.models import check_low_bit_device

    with pytest.raises(RapidspecError, match="bfloat16"):
        check_low_bit_device("int8", torch.device(device))
    check_low_bit_device("none", torch.device(device))
    check_low_bit_device("int4", torch.device("cpu"))
