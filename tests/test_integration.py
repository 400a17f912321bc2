"""The engine on the real built-in model (SmolLM2-135M-Instruct) and a real ~4K-token document."""

from __future__ import annotations

import pytest

from rapidspec import Rapid, low_bit_copy
from rapidspec.prompting.demo_document import demo_document
from rapidspec.retrieval import RetrievalConfig
from tests.specs import spec_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def builtin_fp32(smollm2):
    return smollm2


def test_greedy_rapid_eta_zero_reproduces_lc_exactly(builtin_fp32):
    item = demo_document(target_tokens=4000, tokenizer=builtin_fp32.tokenizer)
    engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25")), target=builtin_fp32)
    lc = engine.generate(item.document, item.question, mode="lc", max_new_tokens=48)
    rapid = engine.generate(item.document, item.question, mode="rapid", eta=0.0, gamma=6, max_new_tokens=48)
    assert lc.stats.prompt_tokens_target > 3500
    assert rapid.token_ids == lc.token_ids
    assert rapid.stats.drafted_tokens > 0 and rapid.stats.accepted_tokens > 0
    # the second run reused the document prefix of the first
    assert rapid.stats.target_prefill_reused_tokens > 3000


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_low_bit_self_drafter_keeps_greedy_equality_and_accepts(builtin_fp32, method):
    """The int8 / int4 kernel paths on real weights: exactness holds and drafts stay useful."""
    item = demo_document(target_tokens=4000, tokenizer=builtin_fp32.tokenizer)
    engine = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25")),
                   target=builtin_fp32, drafter=low_bit_copy(builtin_fp32, method, name="self"))
    lc = engine.generate(item.document, item.question, mode="lc", max_new_tokens=32)
    ragsd = engine.generate(item.document, item.question, mode="ragsd", gamma=6, max_new_tokens=32,
                            drafter_start="first")  # the drafter in every round: its kernels run
    assert ragsd.token_ids == lc.token_ids
    assert ragsd.stats.acceptance_rate > 0.5
