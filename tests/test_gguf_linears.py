"""The target at its GGUF file's precision: the file's blocks as int4 / int8 layers (rapidspec.runtime.gguf_linears)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from rapidspec import Rapid
from rapidspec.errors import RapidspecError
from rapidspec.models import load_model
from rapidspec.runtime.gguf_linears import FILE_INT4_GROUP, GGUFLayoutError, file_layer, four_bit_groups, rotary_rows
from rapidspec.runtime.quantization import KERNEL_DTYPE, Int4Linear, Int8Linear
from tests.test_models import fake_gguf  # noqa: F401  (a fixture)
from tests.tiny_gguf import write_tiny_gguf
from tests.specs import spec_of

T = gguf.GGMLQuantizationType


def grouped_values(codes, scales, zeros) -> np.ndarray:
    """(code - 8) * scale + zero per group of 32 columns, in float32."""
    rows = codes.shape[0]
    grouped = (codes.astype(np.float32).reshape(rows, -1, FILE_INT4_GROUP) - 8) * scales[..., None] + zeros[..., None]
    return grouped.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_four_bit_blocks_give_the_files_values(kind):
    weight = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)
    blocks = quantize(weight, T[kind])
    codes, scales, zeros = four_bit_groups(kind, blocks)
    assert codes.shape == (16, 256) and codes.max() <= 15 and scales.shape == zeros.shape == (16, 8)
    np.testing.assert_allclose(grouped_values(codes, scales, zeros), dequantize(blocks, T[kind]), rtol=0, atol=1e-6)
    if kind == "Q4_0":  # d * (c - 8): nothing rounded
        assert np.array_equal(grouped_values(codes, scales, zeros), dequantize(blocks, T[kind]))


def test_q4_k_super_blocks_give_the_files_values():
    """Random Q4_K bytes (finite half-precision d and dmin): the 8 sub-blocks' scales, mins and codes as llama.cpp reads them."""
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(4, 2, 144), dtype=np.uint8)
    blocks[..., 0:4] = np.frombuffer(rng.uniform(0.001, 0.01, size=(4, 2, 2)).astype(np.float16).tobytes(),
                                     np.uint8).reshape(4, 2, 4)
    blocks = blocks.reshape(4, 288)
    codes, scales, zeros = four_bit_groups("Q4_K", blocks)
    assert codes.shape == (4, 512) and scales.shape == (4, 16)
    np.testing.assert_allclose(grouped_values(codes, scales, zeros), dequantize(blocks, T.Q4_K), rtol=0, atol=1e-6)


def test_other_formats_are_not_four_bit():
    with pytest.raises(Exception, match="not a 4-bit"):
        four_bit_groups("Q5_0", np.zeros((1, 22), np.uint8))


def test_rotary_rows_undo_the_converters_order():
    weight = torch.arange(16.0)[:, None].repeat(1, 4)  # row i holds i
    from tests.tiny_gguf import _rotary_permute

    in_file = torch.from_numpy(_rotary_permute(weight, heads=2))
    assert torch.equal(in_file[rotary_rows(16, 2)], weight)


@pytest.fixture(scope="module")
def quantized_files(tiny_model, tmp_path_factory):
    """The tiny model in each block format; one unused byte token becomes the merge's result, so transformers
    can build the file's tokenizer."""
    folder = tmp_path_factory.mktemp("gguf-kinds")
    tokens = tiny_model.tokenizer.convert_ids_to_tokens(list(range(len(tiny_model.tokenizer))))
    tokens[-2] = "ĠĠ"
    return {kind: write_tiny_gguf(tiny_model, folder / f"{kind}.gguf", tokens, kind=kind)
            for kind in ("Q4_0", "Q4_1", "Q8_0", "Q5_0")}


@pytest.mark.parametrize(("kind", "layer"), [("Q4_0", Int4Linear), ("Q4_1", Int4Linear), ("Q8_0", Int8Linear),
                                             ("Q5_0", Int8Linear)])
def test_a_gguf_target_computes_with_the_files_blocks(quantized_files, kind, layer):
    """4-bit blocks become int4 layers whose weights are the file's values; other blocks int8 within half a step."""
    low = load_model(str(quantized_files[kind]), dtype="float32", quantize="gguf")
    copy = load_model(str(quantized_files[kind]), dtype="float32", quantize="none")
    assert low.quantization == "gguf" and copy.quantization == "none"
    attn, float_attn = low.model.model.layers[0].self_attn, copy.model.model.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        module, reference = getattr(attn, name), getattr(float_attn, name).weight
        assert isinstance(module, layer), (name, type(module))
        weight = module.dequantized(torch.float32)
        if layer is Int4Linear:  # the file's values, scales and zeros rounded to bfloat16 for the kernel
            assert torch.allclose(weight, reference, rtol=0, atol=2e-2 * reference.abs().max().item())
        else:  # half an int8 step of the row (its scale), plus bfloat16's rounding of that scale
            step = module.scales.float()[:, None]
            assert ((weight - reference).abs() <= 0.51 * step + 1e-7).all()
    ids = torch.tensor([[5, 17, 42, 9, 77, 3]])
    low_logits = low.model(input_ids=ids).logits[0]  # short inputs: the kernels in bfloat16
    float_logits = copy.model(input_ids=ids).logits[0]
    assert (low_logits - float_logits).abs().max() < 0.05 * float_logits.abs().max()


def test_int8_layers_round_their_inputs_except_the_down_projections(quantized_files):
    low = load_model(str(quantized_files["Q8_0"]), dtype="float32", quantize="gguf")
    layers = {name: m for name, m in low.model.named_modules() if isinstance(m, Int8Linear)}
    assert len(layers) == 7 * len(low.model.model.layers) + 1  # q, k, v, o, gate, up, down; the output layer
    assert {name for name, m in layers.items() if not m.round_activations} == {
        f"model.layers.{i}.mlp.down_proj" for i in range(len(low.model.model.layers))}


def test_auto_is_the_files_precision_on_cpu_and_none_for_other_models(quantized_files, tiny_model_dir):
    assert load_model(str(quantized_files["Q4_0"]), dtype="float32").quantization == "gguf"
    assert load_model(str(tiny_model_dir), dtype="float32").quantization == "none"


def test_gguf_needs_a_gguf_file(tiny_model_dir):
    with pytest.raises(RapidspecError, match="GGUF file's own weights"):
        load_model(str(tiny_model_dir), quantize="gguf")


def test_a_tensor_that_is_not_the_layers_is_refused(quantized_files):
    """A misread name or layout never computes: the sampled rows must equal the loaded float weights."""
    copy = load_model(str(quantized_files["Q8_0"]), dtype="float32", quantize="none")
    tensors = {t.name: t for t in gguf.GGUFReader(str(quantized_files["Q8_0"])).tensors}
    layer = copy.model.model.layers[0].self_attn.o_proj
    with pytest.raises(GGUFLayoutError, match="blk.1.attn_output"):
        file_layer(tensors["blk.1.attn_output.weight"], layer, torch.float32)
    assert isinstance(file_layer(tensors["blk.0.attn_output.weight"], layer, torch.float32), Int8Linear)


def test_rapid_equals_lc_token_for_token_at_the_files_precision(quantized_files):
    """With eta = 0 the low-bit target's greedy answer is lc's, whatever the drafter drafts."""
    target = load_model(str(quantized_files["Q4_0"]), dtype="float32", quantize="gguf")
    rapid = Rapid(spec_of(drafter_backend="torch"),
                  target=target, drafter=None)  # the self-drafter shares the low-bit layers
    document = "\n\n".join(f"Note {i}: the gate code is {i * 7 % 10}." for i in range(40))
    lc = rapid.generate(document, "What is the gate code?", mode="lc", max_new_tokens=24, ignore_eos=True)
    out = rapid.generate(document, "What is the gate code?", mode="rapid", eta=0.0, max_new_tokens=24,
                         ignore_eos=True, drafter_start="first")
    assert out.token_ids == lc.token_ids and out.stats.drafted_tokens > 0


def test_the_kernel_computes_in_bfloat16_for_a_float32_model(quantized_files):
    low = load_model(str(quantized_files["Q4_1"]), dtype="float32", quantize="gguf")
    layer = low.model.model.layers[0].mlp.gate_proj
    assert layer.scales_and_zeros.dtype == KERNEL_DTYPE
    rows = torch.randn(3, layer.in_features)
    kernel = layer(rows)  # 3 rows: the int4 kernel
    reference = rows @ layer.dequantized(torch.float32).T
    assert kernel.dtype == torch.float32 and torch.allclose(kernel, reference, rtol=0, atol=0.02 * reference.abs().max())


def test_auto_keeps_the_float_copy_where_the_files_blocks_cannot_be_read(fake_gguf, caplog):
    """auto never fails a load that the float copy serves (one warning); gguf asked for by name is one error."""
    path, _ = fake_gguf  # a GGUF header without tensors; transformers' load is faked
    with caplog.at_level("WARNING"):
        assert load_model(str(path), dtype="float32", device="cpu").quantization == "none"
    assert [r.getMessage() for r in caplog.records if "keeps its float weights" in r.getMessage()]
    with pytest.raises(RapidspecError, match="cannot read the tensors of tiny.Q4_0.gguf"):
        load_model(str(path), dtype="float32", device="cpu", quantize="gguf")


def test_the_layers_are_kept_beside_the_conversion_and_read_back(quantized_files, tmp_path, monkeypatch, caplog):
    """The second load reads the kept layers (the same weights, no GGUF parse); a corrupt file is built again."""
    import rapidspec.models.file_precision as file_precision

    monkeypatch.setenv("RAPIDSPEC_CACHE", str(tmp_path / "cache"))
    first = load_model(str(quantized_files["Q4_1"]), dtype="float32", quantize="gguf")
    kept = list((tmp_path / "cache").rglob(file_precision.FILE_NAME))
    assert len(kept) == 1
    built = []
    real = file_precision.file_layers
    monkeypatch.setattr(file_precision, "file_layers", lambda *args: built.append(1) or real(*args))
    second = load_model(str(quantized_files["Q4_1"]), dtype="float32", quantize="gguf")
    assert built == []  # read back, not built
    for a, b in zip(first.model.modules(), second.model.modules()):
        if isinstance(a, (Int4Linear, Int8Linear)):
            assert type(a) is type(b) and torch.equal(a.dequantized(torch.float32), b.dequantized(torch.float32))
            assert getattr(a, "round_activations", None) == getattr(b, "round_activations", None)
    ids = torch.tensor([[5, 17, 42]])
    assert torch.equal(first.model(input_ids=ids).logits, second.model(input_ids=ids).logits)
    kept[0].write_bytes(b"not a safetensors file")
    with caplog.at_level("WARNING"):
        third = load_model(str(quantized_files["Q4_1"]), dtype="float32", quantize="gguf")
    assert built == [1] and "cannot be read" in caplog.text and third.quantization == "gguf"
    assert kept[0].stat().st_size > 100  # written again, whole
