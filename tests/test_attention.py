"""The native-GQA attention function computes what transformers' sdpa computes."""

import torch

from rapidspec.attention import register
from rapidspec.cache import KVCache
from tests.conftest import make_tiny_model


def test_gqa_attention_matches_sdpa(byte_tokenizer):
    reference = make_tiny_model(5, byte_tokenizer).model
    native = make_tiny_model(5, byte_tokenizer).model
    native.set_attn_implementation(register())
    assert native.config._attn_implementation == "rapidspec_sdpa_gqa"
    ids = torch.randint(0, 250, (1, 300), generator=torch.Generator().manual_seed(0)).tolist()[0]
    with torch.inference_mode():
        # prefill without cache, then a 7-token verify and a 1-token step against the cache
        full = reference(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(native(torch.tensor([ids])).logits[0], full)
        for model in (reference, native):
            cache = KVCache(model, prefill_chunk_tokens=128)
            cache.prefill(ids[:280])
            verify = cache.forward(ids[280:287], num_logits=7)
            step = cache.forward(ids[287:288], num_logits=1)
            torch.testing.assert_close(verify, full[280:287].float(), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(step, full[287:288].float(), atol=1e-5, rtol=1e-5)


def test_bf16_single_token_step_attends_in_float32(byte_tokenizer):
    """The one-token CPU bf16 path upcasts; it stays within bf16 rounding of sdpa."""
    reference = make_tiny_model(6, byte_tokenizer).model.to(torch.bfloat16)
    native = make_tiny_model(6, byte_tokenizer).model.to(torch.bfloat16)
    native.set_attn_implementation(register())
    ids = list(range(40, 240))
    with torch.inference_mode():
        steps = []
        for model in (reference, native):
            cache = KVCache(model)
            cache.prefill(ids[:-1])
            steps.append(cache.forward(ids[-1:], num_logits=1))
        fp32 = make_tiny_model(6, byte_tokenizer).model(torch.tensor([ids])).logits[0, -1:].float()
    torch.testing.assert_close(steps[1], steps[0], atol=5e-2, rtol=5e-2)
    # upcasting the attention can only bring the step closer to the float32 model
    assert (steps[1] - fp32).abs().max() <= (steps[0] - fp32).abs().max() + 1e-2
