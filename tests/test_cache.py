"""The KV cache owner and its growable layers."""

from __future__ import annotations

import torch
from transformers import DynamicLayer

from rapidspec.runtime.cache import KVCache, GrowableLayer


def _states(generator, length, batch=1, heads=2, dim=4):
    return (torch.randn(batch, heads, length, dim, generator=generator),
            torch.randn(batch, heads, length, dim, generator=generator))


def test_growable_layer_equals_concatenation_through_appends_and_crops():
    generator = torch.Generator().manual_seed(0)
    growable, reference = GrowableLayer(), DynamicLayer()
    for step, (append, remove) in enumerate([(300, 0), (1, 0), (7, 5), (1, 0), (400, 2), (3, 3), (9, 0)]):
        keys, values = _states(generator, append)
        got = growable.update(keys, values)
        expected = reference.update(keys, values)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        if remove:
            growable.crop(-remove)
            reference.crop(-remove)
        assert growable.get_seq_length() == reference.get_seq_length(), step


def test_steps_within_the_room_do_not_reallocate():
    generator = torch.Generator().manual_seed(1)
    layer = GrowableLayer()
    layer.update(*_states(generator, 10))
    pointer = layer.keys.data_ptr()
    for _ in range(200):  # the first reservation is 256 positions
        layer.update(*_states(generator, 1))
    assert layer.keys.data_ptr() == pointer and layer.get_seq_length() == 210


def test_replaced_keys_rebuild_the_room():
    generator = torch.Generator().manual_seed(2)
    layer, reference = GrowableLayer(), DynamicLayer()
    for target in (layer, reference):
        target.update(*_states(torch.Generator().manual_seed(3), 5, batch=2))
        target.batch_select_indices(torch.tensor([1]))
    keys, values = _states(generator, 3)
    torch.testing.assert_close(layer.update(keys, values)[0], reference.update(keys, values)[0], rtol=0, atol=0)


def test_clones_are_independent(tiny_model):
    ids = list(range(40, 140))
    with torch.inference_mode():
        cache = KVCache(tiny_model.model, prefill_chunk_tokens=32)
        cache.prefill(ids[:90])
        twin = cache.clone()
        twin.crop(50)
        twin.forward(ids[60:75], num_logits=1)  # overwrites positions 50.. of the twin's room only
        from_original = cache.forward(ids[90:91], num_logits=1)
        fresh = tiny_model.model(torch.tensor([ids[:91]])).logits[0, -1:].float()
    torch.testing.assert_close(from_original, fresh, atol=1e-5, rtol=1e-5)
    assert cache.length == 91 and twin.length == 65
