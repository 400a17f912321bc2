"""The native-GQA attention function computes what transformers' sdpa computes; its path choice is reproducible."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rapidspec.runtime import attention
from rapidspec.runtime.attention import grouped_matmul_attention, register, short_query_path
from rapidspec.runtime.grouped_attention import split_product
from rapidspec.runtime.cache import KVCache
from tests.conftest import make_tiny_model

REPOSITORY = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["matmul", "split", "batched", "keys", "sdpa"])
def forced_path(request, monkeypatch):
    """Run each model-level test with short queries on either path (the tiny heads never reach the thresholds)."""
    monkeypatch.setattr(attention, "SHORT_QUERY_PATH", request.param)
    return request.param


@pytest.fixture
def choices(tmp_path, monkeypatch):
    """An empty choices file of this test, measured paths on, nothing memoised (before and after)."""
    path = tmp_path / "cache" / "attention_paths.json"
    monkeypatch.setenv(attention.CHOICES_FILE_ENV, str(path))
    monkeypatch.setattr(attention, "SHORT_QUERY_PATH", "measure")
    attention.fastest_short_query_path.cache_clear()
    yield path
    attention.fastest_short_query_path.cache_clear()


def _shape_class(kv_len: int) -> str:
    """The choices file's key of a float32 query [1, 6, 1, 32] over 2 key/value heads (classes of 512.. keys)."""
    return f"float32 h6/2 q1 n{kv_len} d32 t{torch.get_num_threads()}"


def _never_timed(*shape):
    raise AssertionError(f"timed again: {shape}")


def test_short_query_path_is_forced_or_measured_once_per_shape_class_and_kept(monkeypatch, choices):
    query = torch.empty(1, 6, 1, 32)
    monkeypatch.setattr(attention, "SHORT_QUERY_PATH", "matmul")
    assert short_query_path(torch.empty(1, 6, 64, 32), 2, 4096) == "sdpa"  # a prefill chunk never
    assert short_query_path(query, 2, 4096) == "matmul"
    assert not choices.exists()  # a forced path is neither measured nor kept
    monkeypatch.setattr(attention, "SHORT_QUERY_PATH", "measure")
    first = short_query_path(query, 2, 600)
    assert first in attention.SHORT_QUERY_PATHS
    assert short_query_path(query, 2, 1000) == first  # 600 and 1000 keys are one class (512..1023)
    info = attention.fastest_short_query_path.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    kept = json.loads(choices.read_text())
    assert kept == {"format": attention.CHOICES_FORMAT, "machines": {attention.machine_key(): {_shape_class(512): first}}}
    assert [p.name for p in choices.parent.iterdir()] == [choices.name]  # no temporary file left


def test_a_kept_path_is_taken_without_timing(monkeypatch, choices):
    monkeypatch.setattr(attention, "measure_short_query_path", _never_timed)
    for path in attention.SHORT_QUERY_PATHS:
        table = {attention.machine_key(): {_shape_class(512): path}, "another CPU | AVX2 | torch 0": {}}
        choices.parent.mkdir(exist_ok=True)
        choices.write_text(json.dumps({"format": attention.CHOICES_FORMAT, "machines": table}))
        attention.fastest_short_query_path.cache_clear()
        assert short_query_path(torch.empty(1, 6, 1, 32), 2, 700) == path
        assert short_query_path(torch.empty(1, 6, 1, 32), 2, 900) == path


def test_a_fresh_process_takes_the_path_this_one_kept(choices):
    first = short_query_path(torch.empty(1, 6, 1, 32), 2, 3000)
    script = (
        "import torch\n"
        "from rapidspec.runtime import attention\n"
        f"torch.set_num_threads({torch.get_num_threads()})\n"
        "def never(*shape): raise AssertionError('timed again')\n"
        "attention.measure_short_query_path = never\n"
        "print(attention.short_query_path(torch.empty(1, 6, 1, 32), 2, 3000))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd=REPOSITORY
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == first


def test_a_corrupt_file_counts_as_empty_and_is_rewritten(monkeypatch, choices):
    choices.parent.mkdir()
    unknown_path = {attention.machine_key(): {_shape_class(256): "flash"}}
    for corrupt in (
        "{not json",
        "[1, 2]",
        json.dumps({"format": attention.CHOICES_FORMAT + 1, "machines": {}}),
        json.dumps({"format": attention.CHOICES_FORMAT, "machines": unknown_path}),
    ):
        choices.write_text(corrupt)
        attention.fastest_short_query_path.cache_clear()
        monkeypatch.setattr(attention, "measure_short_query_path", lambda *shape: "batched")
        assert short_query_path(torch.empty(1, 6, 1, 32), 2, 300) == "batched"
        kept = json.loads(choices.read_text())["machines"]
        assert kept == {attention.machine_key(): {_shape_class(256): "batched"}}
        attention.fastest_short_query_path.cache_clear()
        monkeypatch.setattr(attention, "measure_short_query_path", _never_timed)
        assert short_query_path(torch.empty(1, 6, 1, 32), 2, 300) == "batched"


def test_an_unwritable_file_gives_the_deterministic_default(monkeypatch, choices, tmp_path, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(attention.CHOICES_FILE_ENV, str(blocker / "attention_paths.json"))  # its directory is a file
    default = attention.default_short_query_path(4096)
    other = next(path for path in attention.SHORT_QUERY_PATHS if path != default)
    monkeypatch.setattr(attention, "measure_short_query_path", lambda *shape: other)
    with caplog.at_level(logging.DEBUG, logger=attention.__name__):
        for _ in range(2):  # the same in a fresh process: nothing kept, nothing timed taken
            attention.fastest_short_query_path.cache_clear()
            assert short_query_path(torch.empty(1, 6, 1, 32), 2, 5000) == default
    assert caplog.text.count("cannot store the measured attention paths") == 1  # once per folder and cause
    assert [p.name for p in tmp_path.iterdir()] == ["a file"]


def test_default_path_follows_the_cpu_capability(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert [attention.default_short_query_path(n) for n in (256, 512, 1024, 16384)] == ["batched"] * 2 + ["matmul"] * 2
    for capability in ("AVX2", "DEFAULT", "SVE256"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        assert attention.default_short_query_path(512) == attention.default_short_query_path(16384) == "sdpa"


def test_gqa_attention_matches_sdpa(byte_tokenizer, forced_path):
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


def test_bf16_steps_stay_within_bf16_rounding_of_sdpa(byte_tokenizer, forced_path):
    """In bfloat16 the matrix-product path (1-token step, 7-token verify) is as close to float32 as sdpa."""
    reference = make_tiny_model(6, byte_tokenizer).model.to(torch.bfloat16)
    native = make_tiny_model(6, byte_tokenizer).model.to(torch.bfloat16)
    native.set_attn_implementation(register())
    ids = list(range(40, 240))
    with torch.inference_mode():
        outputs = []
        for model in (reference, native):
            cache = KVCache(model)
            cache.prefill(ids[:-8])
            outputs.append(torch.cat([cache.forward(ids[-8:-1], num_logits=7), cache.forward(ids[-1:], num_logits=1)]))
        fp32 = make_tiny_model(6, byte_tokenizer).model(torch.tensor([ids])).logits[0, -8:].float()
    torch.testing.assert_close(outputs[1], outputs[0], atol=5e-2, rtol=5e-2)
    assert (outputs[1] - fp32).abs().max() <= 2 * (outputs[0] - fp32).abs().max() + 1e-2


def _repeat_kv_reference(query, key, value, mask, scaling):
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding", "additive"])
@pytest.mark.parametrize("q_len", [1, 5])
def test_grouped_matmul_attention_equals_repeated_heads(mask_kind, q_len):
    generator = torch.Generator().manual_seed(q_len)
    batch, heads, kv_heads, kv_len, dim = 2, 6, 2, 50, 16
    query = torch.randn(batch, heads, q_len, dim, generator=generator)
    key = torch.randn(batch, kv_heads, kv_len, dim, generator=generator)
    value = torch.randn(batch, kv_heads, kv_len, dim, generator=generator)
    causal = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]  # [q, n]
    causal = causal[None, None].repeat(batch, 1, 1, 1)  # [b, 1, q, n]
    padded = causal.clone()
    padded[1, :, :, :7] = False  # the first 7 keys of the second sequence are padding: not only the tail is masked
    additive = torch.randn(batch, 1, q_len, kv_len, generator=generator)
    mask = {"none": None, "causal": causal, "padding": padded, "additive": additive}[mask_kind]
    expected = _repeat_kv_reference(query, key, value, mask, 0.25)
    for path in ("matmul", "split", "batched", "keys"):
        got = grouped_matmul_attention(query, key, value, mask, 0.25, path=path)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [0.125, 0.1])
def test_a_power_of_two_scale_on_the_queries_gives_the_same_numbers_as_on_the_scores(dtype, scaling):
    """Scaling the query rows by 2**-k (head_dim 64) instead of the scores is exact: identical outputs, bit for bit.
    Other scales stay on the scores (the reference here computes them that way too)."""
    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, q_len, kv_len, dim = 6, 2, 7, 300, 64
    query = torch.randn(1, heads, q_len, dim, generator=generator).to(dtype)
    key = torch.randn(1, kv_heads, kv_len, dim, generator=generator).to(dtype)
    value = torch.randn(1, kv_heads, kv_len, dim, generator=generator).to(dtype)
    stacked = query.reshape(1, kv_heads, heads // kv_heads * q_len, dim)[0]  # [kv, g*q, d]
    scores = torch.bmm(stacked, key[0].transpose(1, 2)).mul_(scaling)  # [kv, g*q, n], scaled after the product
    expected = torch.bmm(scores.softmax(-1), value[0]).reshape(1, heads, q_len, dim)
    got = grouped_matmul_attention(query, key, value, None, scaling, path="batched")
    assert torch.equal(got, expected)


@pytest.mark.parametrize("parts, kv_len", [(2, 50), (3, 50), (4, 4), (2, 3)])
def test_the_split_product_sums_its_parts_of_the_keys_to_the_whole_product(parts, kv_len):
    """``split``'s probabilities-values product in ``parts`` runs of the keys (a remainder added on its own)."""
    generator = torch.Generator().manual_seed(parts * kv_len)
    probs = torch.randn(14, kv_len, generator=generator).softmax(-1)  # [rows, n]
    value = torch.randn(kv_len + 5, 16, generator=generator)[:kv_len]  # [n, d], a view of a longer buffer
    torch.testing.assert_close(split_product(probs, value, parts), probs @ value, atol=1e-6, rtol=1e-6)
    half = split_product(probs.bfloat16(), value.bfloat16(), parts)
    assert half.dtype == torch.bfloat16 and torch.allclose(half.float(), probs @ value, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len, causal_tail", [(1, False), (7, True), (7, False)])
def test_key_rows_past_the_values_are_scored_and_masked_never_read(dtype, q_len, causal_tail):
    """A cache hands attention its keys up to an aligned count (room after the held positions). Whatever that room
    holds (here NaN and huge values), every path gives what it gives on the held keys alone."""
    generator = torch.Generator().manual_seed(q_len)
    heads, kv_heads, kv_len, dim = 6, 2, 300, 16
    query = torch.randn(1, heads, q_len, dim, generator=generator).to(dtype)
    key = torch.randn(1, kv_heads, 384, dim, generator=generator).to(dtype)  # 300 held keys, room up to 384
    value = torch.randn(1, kv_heads, 384, dim, generator=generator).to(dtype)
    key[:, :, kv_len::2], key[:, :, kv_len + 1 :: 2] = float("nan"), 1e4
    for path in ("matmul", "split", "batched", "keys"):
        held = grouped_matmul_attention(query, key[:, :, :kv_len], value[:, :, :kv_len], None, 0.25, path=path,
                                        causal_tail=causal_tail)
        padded = grouped_matmul_attention(query, key, value[:, :, :kv_len], None, 0.25, path=path,
                                          causal_tail=causal_tail)
        assert not padded.isnan().any(), path
        torch.testing.assert_close(padded, held, atol=0, rtol=0)


def test_aligned_key_rows_round_up_to_the_alignment_within_the_capacity():
    align = attention.KEY_ALIGNMENT
    assert [attention.aligned_key_rows(n, 10 * align) for n in (1, align, align + 1, 3 * align - 1)] == \
        [align, align, 2 * align, 3 * align]
    assert attention.aligned_key_rows(align + 1, align + 5) == align + 5  # never past the buffer


def test_a_lean_forward_gives_the_same_logits_whatever_its_room_holds(monkeypatch):
    """The lean model hands attention the room after the held positions (aligned_key_rows); a verification and a
    plain step over a cache whose room holds NaN give the logits of one whose room holds zeros."""
    from rapidspec.runtime.lean import LeanModel
    from rapidspec.runtime.lean_cache import LeanKVCache

    lean = LeanModel(make_tiny_model().model)
    token_ids = [(7 * i) % 200 + 3 for i in range(300)]
    for path in ("matmul", "split"):
        monkeypatch.setattr(attention, "SHORT_QUERY_PATH", path)
        logits = []
        for room in (0.0, float("nan")):
            cache = LeanKVCache(lean)
            cache.reserve(1000)
            cache._keys.fill_(room)
            cache._values.fill_(room)
            cache.prefill(token_ids)
            logits.append(torch.cat([cache.forward([5, 6, 7, 8], num_logits=4), cache.forward([9])]))
        assert not logits[1].isnan().any(), path
        torch.testing.assert_close(logits[1], logits[0], atol=0, rtol=0)


def test_an_unknown_grouped_path_is_refused():
    query, key = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="path must be one of"):
        grouped_matmul_attention(query, key, key, None, 1.0, path="flash")
