"""int8 weights times per-token int8 activations (rapidspec.runtime.dynamic_int8) and the int8 layers that use it."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rapidspec.runtime import dynamic_int8
from rapidspec.runtime.dynamic_int8 import dynamic_int8_product, pack_weight
from rapidspec.runtime.lean import fuse_linears
from rapidspec.runtime.quantization import Int8Linear, quantize_linears, quantize_weight
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.skipif(not dynamic_int8.AVAILABLE, reason="this PyTorch build has no FBGEMM (x86 only)")


def _weights(out_features: int = 96, in_features: int = 128, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05  # [out, in]
    weight_int8, scales = quantize_weight(weight)
    return weight_int8, scales, weight_int8.float() * scales.float()[:, None]


def _rows(count: int, in_features: int = 128, seed: int = 1) -> torch.Tensor:
    """Rows of very different magnitudes, one of them all zero and one with an outlier column."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(count, in_features, generator=generator) * torch.logspace(-3, 3, count)[:, None]  # [n, in]
    if count >= 3:
        rows[1] = 0.0
        rows[2, 5] = 400.0
    return rows


@pytest.mark.parametrize("reduce_range", [False, True])
def test_a_row_computes_the_same_alone_or_among_others(monkeypatch, reduce_range):
    # the point of the pinned grid: without it the call's range (the largest row) would set every row's rounding
    monkeypatch.setattr(dynamic_int8, "reduce_range", lambda: reduce_range)
    weight_int8, scales, _ = _weights()
    packed = pack_weight(weight_int8, scales)
    rows = _rows(7)
    together = dynamic_int8_product(rows, packed)  # [7, out]
    alone = torch.cat([dynamic_int8_product(rows[i : i + 1], packed) for i in range(7)])
    assert torch.equal(together, alone)
    assert bool((together[1] == 0).all())


@pytest.mark.parametrize(("reduce_range", "bound"), [(False, 1 / 127), (True, 1 / 63)])
def test_each_row_is_rounded_on_its_own_scale(monkeypatch, reduce_range, bound):
    monkeypatch.setattr(dynamic_int8, "reduce_range", lambda: reduce_range)
    weight_int8, scales, weight = _weights()
    rows = _rows(7)
    got = dynamic_int8_product(rows, pack_weight(weight_int8, scales)).double()  # [7, out]
    expected = F.linear(rows.double(), weight.double())
    # an activation moves by at most half a step of its row's grid (2 / 255 or 2 / 127 of the row's largest
    # magnitude), so an output by at most that times the row's largest magnitude times the weights' row sums
    limit = bound * rows.abs().amax(dim=1, keepdim=True).double() * weight.abs().sum(dim=1).double()[None, :]
    assert bool(((got - expected).abs() <= limit + 1e-6).all())
    # and not by chance: a small row is not rounded on the large rows' grid (that would zero it)
    assert float((got[0] - expected[0]).abs().max()) < 0.05 * float(expected[0].abs().max())


def test_the_int8_layer_multiplies_every_row_count_on_the_dynamic_kernel():
    weight_int8, scales, _ = _weights()
    layer = Int8Linear(weight_int8, scales, nn.Parameter(torch.randn(96)))
    packed = pack_weight(weight_int8, scales)
    for count in (1, 7, 300):  # a step, a verification, a prefill chunk
        rows = _rows(count, seed=count)
        expected = dynamic_int8_product(rows, packed) + layer.bias
        assert torch.equal(layer(rows), expected)
    bare, rows = Int8Linear(weight_int8, scales, None), _rows(4).bfloat16()
    assert torch.equal(bare(rows[None]), dynamic_int8_product(rows, packed).bfloat16()[None])  # [1, 4, out] bfloat16


def test_the_packed_copy_is_not_copied_or_saved_but_rebuilt():
    weight_int8, scales, _ = _weights()
    layer = Int8Linear(weight_int8, scales, None)
    rows = _rows(3)
    out = layer(rows)
    assert layer._packed is not None
    clone = copy.deepcopy(layer)
    assert clone._packed is None and torch.equal(clone(rows), out)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded._packed is None and torch.equal(loaded(rows), out)


def test_a_loaded_model_has_its_layers_packed_before_its_first_product(tiny_model_dir):
    from rapidspec.models import load_model

    loaded = load_model(str(tiny_model_dir), dtype="float32", quantize="int8", runtime="lean")
    fused = loaded.lean.fused_linears()  # the lean forward's q/k/v and gate/up: not modules of the model
    layers = [m for module in (loaded.model, *fused) for m in module.modules() if isinstance(m, Int8Linear)]
    dynamic = [m for m in layers if m._dynamic()]
    assert fused and all(m in dynamic for m in fused)
    assert all(m._packed is not None for m in dynamic)  # packed at load, not by the first request
    rows = _rows(3, dynamic[0].in_features)
    lazy = copy.deepcopy(dynamic[0])
    assert lazy._packed is None and torch.equal(lazy(rows), dynamic[0](rows))


def test_down_projections_keep_their_inputs_and_fusing_keeps_the_choice(byte_tokenizer):
    model = make_tiny_model(0, byte_tokenizer, hidden_size=64).model
    quantize_linears(model, "int8")
    mlp, attn = model.model.layers[0].mlp, model.model.layers[0].self_attn
    assert not mlp.down_proj.round_activations and mlp.gate_proj.round_activations and attn.q_proj.round_activations
    rows = _rows(3, in_features=mlp.down_proj.in_features)
    expected = torch.ops.aten._weight_int8pack_mm(rows.bfloat16(), mlp.down_proj.weight_int8, mlp.down_proj.scales)
    assert torch.equal(mlp.down_proj(rows), expected.float())  # the weight-only kernel on bfloat16 inputs
    fused = fuse_linears([mlp.gate_proj, mlp.up_proj])
    assert fused.round_activations
    assert fuse_linears([mlp.gate_proj, Int8Linear(mlp.up_proj.weight_int8, mlp.up_proj.scales, None, False)]) is None
