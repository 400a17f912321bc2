"""The engine's invariants on tiny models built from configs."""

from __future__ import annotations

import pytest
import torch

from rapidspec import DecodeConfig, Rapid
from rapidspec.errors import RapidspecError
from rapidspec.drafting.gamma_schedule import PROBE_DRAFTS, PROBE_EVERY, CostSchedule, StepCosts
from rapidspec.outputs import last_output
from rapidspec.retrieval import RetrievalConfig
from tests.specs import spec_of

# the rounds' math from the first round (drafter_start="first"; the default join: test_drafter_join.py)
pytestmark = pytest.mark.usefixtures("drafter_from_the_first_round")

DOCUMENT = "\n\n".join(
    f"Paragraph {i}: the river town kept {i} boats and a lighthouse painted shade {i % 7}." for i in range(40)
)
QUESTION = "How many boats did the river town keep in paragraph 17?"
RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=300)


def engine(target, drafter=None) -> Rapid:
    return Rapid(spec_of(retrieval=RETRIEVAL), target=target, drafter=drafter)


@pytest.fixture(scope="module")
def lc_output(tiny_model):
    return engine(tiny_model).generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=40)


@pytest.mark.parametrize("mode", ["sd", "ragsd", "rapid", "magicdec"])
@pytest.mark.parametrize("drafter_kind", ["self", "random"])
def test_greedy_eta_zero_equals_lc(tiny_model, other_tiny_model, lc_output, mode, drafter_kind):
    """Invariant 1: eta = 0 greedy reproduces target-only greedy for any drafter (gamma 4 every round; the
    default cost schedule: test_cost_schedule_greedy_eta_zero_equals_lc)."""
    drafter = None if drafter_kind == "self" else other_tiny_model
    out = engine(tiny_model, drafter).generate(DOCUMENT, QUESTION, mode=mode, eta=0.0, gamma=4, max_new_tokens=40,
                                               gamma_schedule="constant")
    assert out.token_ids == lc_output.token_ids
    assert out.text == lc_output.text
    assert out.stats.rounds > 0 and out.stats.drafted_tokens > 0
    if mode == "sd" and drafter_kind == "self":
        # same weights, same context: everything is accepted
        assert out.stats.acceptance_rate == 1.0
        assert out.stats.mean_accepted_length > 4.0
    if drafter_kind == "random":
        assert out.stats.acceptance_rate < 0.5


def test_caches_hold_exactly_the_committed_tokens(tiny_model, other_tiny_model):
    """Invariant 5: after every round, cached logits equal a fresh forward pass."""
    checked = []

    def observer(target_cache, target_seq, drafter_cache, drafter_seq):
        for cache, seq in ((target_cache, target_seq), (drafter_cache, drafter_seq)):
            assert cache.token_ids == seq[: cache.length]
            assert 1 <= len(seq) - cache.length <= 2
            probe = cache.clone()
            cached = probe.forward(seq[probe.length :], num_logits=1)[0]
            fresh = cache.model(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
            torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)
        checked.append(len(target_seq))

    out = engine(tiny_model, other_tiny_model).generate(
        DOCUMENT, QUESTION, mode="rapid", eta=2.0, gamma=3, temperature=1.0, seed=3, max_new_tokens=30, gamma_schedule="constant",
        observer=observer,
    )
    assert len(checked) == out.stats.rounds >= 5


def test_stream_concatenates_to_the_text(tiny_model):
    chunks = list(engine(tiny_model).stream(DOCUMENT, QUESTION, mode="rapid", gamma=3, max_new_tokens=30))
    output = chunks[-1].output
    assert output is not None
    assert "".join(c.text for c in chunks) == output.text
    assert sum(len(c.token_ids) for c in chunks) == len(output.token_ids) == output.stats.new_tokens == 30
    assert output.stats.stop_reason == "length"
    assert output.retrieval is not None and output.retrieval.num_tokens <= 300


def test_seed_determinism(tiny_model, other_tiny_model):
    rapid = engine(tiny_model, other_tiny_model)
    runs = [
        rapid.generate(DOCUMENT, QUESTION, mode="rapid", temperature=1.0, seed=seed, max_new_tokens=25).token_ids
        for seed in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("mode", ["lc", "sd"])
def test_stop_string_ends_generation(tiny_model, lc_output, mode):
    """The text ends before the stop string; the tokens end with the one that completed it (none after it)."""
    text = lc_output.text
    stop = text[10:13]
    out = engine(tiny_model).generate(DOCUMENT, QUESTION, mode=mode, gamma=6, max_new_tokens=40, stop=(stop,))
    assert out.stats.stop_reason == "stop"
    assert out.text == text[: text.find(stop)]
    decode = tiny_model.tokenizer.decode
    assert stop in decode(out.token_ids) and stop not in decode(out.token_ids[:-1])
    assert out.stats.new_tokens == len(out.token_ids) and out.token_ids == lc_output.token_ids[: len(out.token_ids)]


def test_stats_are_consistent(tiny_model):
    out = engine(tiny_model).generate(DOCUMENT, QUESTION, mode="ragsd", gamma=4, max_new_tokens=30)
    s = out.stats
    assert s.prompt_tokens_target > s.prompt_tokens_drafter > 0
    assert s.retrieved_chunks >= 1 and 0 < s.retrieved_tokens <= 300
    assert s.accepted_tokens <= s.drafted_tokens
    assert s.mean_accepted_length == pytest.approx(1 + s.accepted_tokens / s.rounds)
    assert sum(s.drafted_per_position) == s.drafted_tokens
    assert sum(s.accepted_per_position) == s.accepted_tokens
    assert s.to_dict()["acceptance_rate"] == s.acceptance_rate


def test_document_cache_is_reused_across_questions(tiny_model):
    rapid = engine(tiny_model)
    first = rapid.generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=10)
    second = rapid.generate(DOCUMENT, "What colour was the lighthouse?", mode="lc", max_new_tokens=10)
    assert first.stats.target_prefill_reused_tokens == 0
    assert second.stats.target_prefill_reused_tokens > len(DOCUMENT) * 0.9
    fresh = engine(tiny_model).generate(DOCUMENT, "What colour was the lighthouse?", mode="lc", max_new_tokens=10)
    assert fresh.token_ids == second.token_ids


def test_middle_truncation_and_refusal(byte_tokenizer):
    from tests.conftest import make_tiny_model

    small = make_tiny_model(0, byte_tokenizer, max_context=600)
    out = engine(small).generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=8)
    assert out.stats.document_tokens_truncated > 0
    assert out.stats.prompt_tokens_target <= 600 - 8
    with pytest.raises(RapidspecError, match="window"):
        engine(small).generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=8, truncate="error")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"eta": -1.0}, "eta"),
        ({"gamma": 0}, "gamma"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"mode": "fast"}, "mode"),
        ({"mode": "sd", "eta": 3.0}, "eta"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"draft_confidence": 1.0}, "draft_confidence"),
        ({"draft_confidence": -0.1}, "draft_confidence"),
        # bounded knobs: no request can ask for gigabytes
        ({"gamma_schedule": "cost", "max_gamma": 10**7}, r"max_gamma must be an integer in \[1, 64\]"),
        ({"max_new_tokens": 10**9}, "max_new_tokens"),
        ({"streaming_tokens": 10**12}, "streaming_tokens"),
        ({"stop": tuple(f"s{i}" for i in range(17))}, "at most 16"),
        ({"max_model_len": 8}, "max_model_len"),
        ({"time_limit_s": 0}, "time_limit_s"),
        ({"time_limit_s": float("inf")}, "time_limit_s"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(RapidspecError, match=message):
        DecodeConfig(**options)


def test_empty_inputs_are_clear_errors(tiny_model):
    with pytest.raises(RapidspecError, match="document"):
        engine(tiny_model).generate("  ", QUESTION)
    with pytest.raises(RapidspecError, match="question"):
        engine(tiny_model).generate(DOCUMENT, "")


def test_vocabulary_mismatch_is_a_clear_error(tiny_model):
    from tests.conftest import build_byte_tokenizer, make_tiny_model

    other_tokenizer = build_byte_tokenizer()
    other_tokenizer.add_tokens(["<extra>"])
    with pytest.raises(RapidspecError, match="vocabulary"):
        Rapid(target=tiny_model, drafter=make_tiny_model(2, other_tokenizer))


def test_heuristic_gamma_schedule_grows_on_full_acceptance(tiny_model, lc_output):
    out = engine(tiny_model).generate(
        DOCUMENT, QUESTION, mode="sd", gamma=2, gamma_schedule="heuristic", max_gamma=8, max_new_tokens=40
    )
    assert out.token_ids == lc_output.token_ids
    # all accepted (same weights, same context): gamma 2 -> 4 -> 6 -> 8
    assert len(out.stats.drafted_per_position) == 8


@pytest.mark.parametrize(("confidence", "drafts_per_round"), [(0.999, 1), (1e-6, 4)])
def test_draft_confidence_stops_a_round_after_an_unsure_draft(tiny_model, lc_output, confidence, drafts_per_round):
    """The tiny model's top probabilities are far below 0.999 and far above 1e-6."""
    out = engine(tiny_model).generate(
        DOCUMENT, QUESTION, mode="sd", gamma=4, draft_confidence=confidence, max_new_tokens=40,
        gamma_schedule="constant",
    )
    assert out.token_ids == lc_output.token_ids
    assert out.stats.drafted_per_position[0] == out.stats.rounds
    assert len(out.stats.drafted_per_position) == drafts_per_round


def test_rag_mode_reads_only_the_retrieved_text(tiny_model, lc_output):
    out = engine(tiny_model).generate(DOCUMENT, QUESTION, mode="rag", max_new_tokens=10)
    assert out.stats.prompt_tokens_target < lc_output.stats.prompt_tokens_target / 2
    assert out.stats.prompt_tokens_drafter == 0 and out.stats.rounds == 0
    assert out.retrieval is not None
    assert all(DOCUMENT[c.char_start : c.char_end] == c.text for c in out.retrieval.chunks)


# ------------------------------------------------------------ gamma_schedule="cost"
# Drafting 10x dearer than a plain step: the cost schedule makes rounds plain steps.
DEAR_DRAFTS = StepCosts(draft_step=1.0, verify_base=0.1, verify_per_token=0.01)


class PlainSteps:
    """A gamma schedule asking for a plain step every round."""

    def next_drafts(self) -> int:
        return 0

    def record(self, round_) -> None:
        pass


def decode_with(rapid: Rapid, config: DecodeConfig, schedule, observer=None):
    prompts = rapid.document_prompts(DOCUMENT, QUESTION, config)
    return last_output(rapid.decode(prompts, config, schedule=schedule, observer=observer))


@pytest.mark.parametrize("mode", ["sd", "ragsd", "rapid"])
@pytest.mark.parametrize("drafter_kind", ["self", "random"])
def test_cost_schedule_greedy_eta_zero_equals_lc(tiny_model, other_tiny_model, lc_output, mode, drafter_kind):
    """Invariant 1 with k chosen from the calibrated costs (whatever it chooses)."""
    drafter = None if drafter_kind == "self" else other_tiny_model
    out = engine(tiny_model, drafter).generate(
        DOCUMENT, QUESTION, mode=mode, eta=0.0, gamma=4, gamma_schedule="cost", max_new_tokens=40
    )
    assert out.token_ids == lc_output.token_ids
    assert out.stats.gamma_schedule == "cost"
    assert out.stats.drafted_per_position[0] >= 1  # the first round drafts gamma
    assert out.stats.rounds - out.stats.plain_rounds == out.stats.drafted_per_position[0]


def test_cost_schedule_with_dear_drafts_takes_plain_steps(tiny_model, lc_output):
    """k = 0 is chosen after the first round; probes of PROBE_DRAFTS every PROBE_EVERY rounds; caches stay exact.

    Self-drafting in ``sd`` accepts everything: round 1 drafts 4 (5 tokens),
    then 7 plain rounds and a probe of 2 (15 tokens), 15 plain rounds and a
    probe (the wait doubled: 33 tokens), then 7 plain rounds: 40 tokens in 32
    rounds, 29 of them plain.
    """
    assert (PROBE_EVERY, PROBE_DRAFTS) == (8, 2) and len(lc_output.token_ids) == 40
    checked = []

    def observer(target_cache, target_seq, drafter_cache, drafter_seq):
        for cache, seq in ((target_cache, target_seq), (drafter_cache, drafter_seq)):
            assert cache.token_ids == seq[: cache.length]  # the drafter lags behind after plain rounds
            cached = cache.clone().forward(seq[cache.length :], num_logits=1)[0]
            fresh = cache.model(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
            torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)
        checked.append(len(drafter_seq) - drafter_cache.length)

    config = DecodeConfig(mode="sd", gamma=4, gamma_schedule="cost", max_new_tokens=40)
    out = decode_with(engine(tiny_model), config, CostSchedule(4, 16, 0.0, DEAR_DRAFTS), observer)
    assert out.token_ids == lc_output.token_ids
    stats = out.stats
    assert (stats.rounds, stats.plain_rounds, stats.drafted_tokens, stats.accepted_tokens) == (32, 29, 8, 8)
    assert stats.drafted_per_position == [3, 3, 1, 1]
    assert stats.mean_drafts_per_round == pytest.approx(8 / 32)
    assert stats.to_dict()["plain_rounds"] == 29 and stats.to_dict()["mean_drafts_per_round"] == pytest.approx(1 / 4)
    # the drafter feeds at the second probe: 2 tokens pending after a fully accepted round, + 15 plain rounds' tokens
    assert max(checked) == 2 + 2 * PROBE_EVERY - 1


@pytest.mark.parametrize("drafter_kind", ["self", "random"])
def test_cost_schedule_with_dear_drafts_takes_plain_steps_when_eta_is_positive(
    tiny_model, other_tiny_model, lc_output, drafter_kind
):
    """Plain steps with eta > 0 too: after the first round only probes draft; a plain step's token is p's argmax."""
    drafter = None if drafter_kind == "self" else other_tiny_model
    config = DecodeConfig(mode="rapid", eta=2.0, gamma=4, max_new_tokens=40)
    rapid = engine(tiny_model, drafter)
    out = decode_with(rapid, config, CostSchedule(4, 16, 2.0, DEAR_DRAFTS))
    stats = out.stats
    drafting = stats.rounds - stats.plain_rounds
    assert drafting <= 1 + stats.rounds // PROBE_EVERY and stats.plain_rounds >= stats.rounds - drafting
    assert stats.drafted_per_position == [drafting, drafting, 1, 1]  # round 1 drafts 4, probes 2
    # every round plain: no drafter forward, and greedy tokens are the target's own (lc's), not argmax(z + eta * g)
    plain = decode_with(rapid, config, PlainSteps())
    assert plain.token_ids == lc_output.token_ids
    assert plain.stats.drafted_tokens == 0 and plain.stats.rounds == plain.stats.plain_rounds == 40
