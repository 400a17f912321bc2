"""The first token is the target's; the drafter joins when it pays (rapidspec.drafting.join, .calibration)."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest
import torch

from rapidspec import Rapid
from rapidspec.drafting.calibration import (
    COSTS_FORMAT,
    CostBook,
    DrafterCosts,
    TargetCosts,
    context_bucket,
    line_through,
    measure_drafter,
    measure_verify,
)
from rapidspec.drafting.gamma_schedule import StepCosts
from rapidspec.drafting.memory import MEMORY_PRIOR, ConversationMemory, prior_estimates
from rapidspec.drafting.join import (
    MIN_PIECE_TOKENS,
    drafting_seconds_per_token,
    expected_remaining,
    piece_tokens,
    worth_preparing,
)
from rapidspec.retrieval import RetrievalConfig
from rapidspec.runtime import new_kv_cache
from tests.static_costs import StaticCosts
from tests.specs import spec_of

RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=200)
DOCUMENT = " ".join(f"Fact {i}: the archive of room {i} opens at {i % 12 + 1} o'clock." for i in range(60))
QUESTION = "When does room 7 open?"


def engine(tiny_model, costs=None, **options) -> Rapid:
    rapid = Rapid(spec_of(retrieval=RETRIEVAL, drafter_backend="torch", **options), target=tiny_model)
    rapid.costs = costs or StaticCosts()
    return rapid


# ------------------------------------------------------------------ pure math
def test_worth_preparing_by_hand():
    assert worth_preparing(0.5, 0.05, 0.025, 40)  # 10 rounds to prepare, 30 tokens save 0.75 s
    assert not worth_preparing(0.5, 0.05, 0.025, 25)  # 15 tokens save 0.375 s
    assert not worth_preparing(0.0, 0.05, 0.06, 100)  # drafting is no cheaper than a plain step
    assert not worth_preparing(0.0, 0.05, 0.01, 1)  # one token left: nothing to draft
    assert worth_preparing(0.0, 0.05, 0.01, 2)  # nothing left to prepare


def test_expected_remaining_by_hand():
    assert [expected_remaining(256, n, False) for n in (1, 10, 100, 240)] == [32, 32, 100, 16]
    assert expected_remaining(256, 10, True) == 246  # a fixed length: all it may add


def test_piece_tokens_is_about_one_plain_step():
    assert piece_tokens(0.05, 0.001) == 50
    assert piece_tokens(0.05, 0.01) == MIN_PIECE_TOKENS
    assert piece_tokens(0.05, 0.0) > 10**5


def test_drafting_seconds_per_token_by_hand():
    costs = StepCosts(draft_step=0.01, verify_base=0.05, verify_per_token=0.005)
    seconds = drafting_seconds_per_token(costs, [0.8] * 4, 4, False)
    # k = 3: E = 1 + 0.8 + 0.64 + 0.512 = 2.952 tokens for C = 0.03 + 0.07 s (k = 4: 0.115 s for 3.3616, dearer)
    assert seconds == pytest.approx(0.1 / 2.952)


def test_buckets_and_verify_lines():
    assert [context_bucket(n) for n in (1, 300, 512, 513, 7000, 8192)] == [512, 512, 512, 1024, 8192, 8192]
    line = line_through(1, 0.05, 8, 0.12)
    assert (line.base, line.per_token) == pytest.approx((0.04, 0.01))
    assert line_through(1, 0.2, 8, 0.1) == TargetCosts(0.2, 0.0)  # noise giving a negative slope: flat


def test_a_conversation_remembers_its_own_answers_only():
    memory = ConversationMemory()
    turn_1 = list(range(100, 140))
    assert memory.lookup(turn_1) is None and prior_estimates(3) == pytest.approx([MEMORY_PRIOR] * 3)
    memory.record(turn_1, None, [4, 4, 2], [4, 2, 0], drafter_tokens=[7, 8, 9])  # position 1 always, 2 half, 3 never
    turn_2 = turn_1 + [1, 2, 3]  # the answer, then the next question
    first = memory.lookup(turn_2)
    a = first.estimates(3)
    assert a[0] == pytest.approx((MEMORY_PRIOR + 4) / 5) and a[1] == pytest.approx((a[0] + 2) / 5) and a[2] < a[1]
    assert first.kept() == [(7, 8, 9)]
    assert memory.lookup(turn_1) is None  # the same prompt again continues none of its own answers
    assert memory.lookup([100, 101, 5] + turn_1[3:] + [1]) is None  # another conversation: the prior
    memory.record(turn_2, first, [], [])  # an answer whose drafter did not join: the counts decay toward the prior
    second = memory.lookup(turn_2 + [4, 5])
    b = second.estimates(3)
    assert second.length == len(turn_2) and second.kept() == []
    assert b[0] == pytest.approx((MEMORY_PRIOR + 3.6) / 4.6) and b[2] > a[2]
    assert memory.lookup(turn_1 + [1, 9]).length == len(turn_1)  # a branch from turn 1 finds turn 1


def test_the_memory_is_bounded():
    memory = ConversationMemory(max_entries=3)
    for i in range(5):
        memory.record([i] * 20, None, [1], [1])
    assert len(memory) == 3 and memory.lookup([0] * 21) is None and memory.lookup([4] * 21) is not None


# ------------------------------------------------------------------ calibration
def test_verify_and_drafter_measurements_leave_the_cache_as_it_was(tiny_model):
    cache = new_kv_cache(tiny_model, 64)
    cache.prefill(list(range(40)))
    before = cache.forward([41], 1)
    cache.crop(40)
    costs = measure_verify(cache, [41], 8)
    assert cache.length == 40 and costs.base >= 0 and costs.per_token >= 0
    torch.testing.assert_close(cache.forward([41], 1), before)
    drafter = measure_drafter(lambda n: new_kv_cache(tiny_model, 64), 3)
    assert drafter.step > 0 and drafter.prefill_per_token > 0


def test_cost_book_measures_once_and_keeps_it_per_machine(tmp_path):
    path = tmp_path / "costs.json"
    calls = []

    def measure():
        calls.append(1)
        return DrafterCosts(0.02, 0.001)

    assert CostBook(path).get(DrafterCosts, "drafter x", measure) == DrafterCosts(0.02, 0.001)
    again = CostBook(path)  # another engine, another process: read from the file
    assert again.get(DrafterCosts, "drafter x", measure) == DrafterCosts(0.02, 0.001) and len(calls) == 1
    content = json.loads(path.read_text())
    assert content["format"] == COSTS_FORMAT and len(content["machines"]) == 1
    (machine,) = content["machines"].values()
    (key,) = machine
    machine[key] = {"step": "nan?", "prefill_per_token": 1}  # a damaged entry is measured again
    path.write_text(json.dumps(content))
    assert CostBook(path).get(DrafterCosts, "drafter x", measure) == DrafterCosts(0.02, 0.001) and len(calls) == 2
    assert CostBook(path).get(float, "embedder y", lambda: 3e-5) == 3e-5


def test_calibrate_measures_the_drafter_once_before_any_generation(tiny_model, other_tiny_model, tmp_path):
    from rapidspec.config import DecodeConfig

    engine = Rapid(spec_of(drafter_backend="torch", kv_cache_gib=0), target=tiny_model, drafter=other_tiny_model)
    engine.costs = CostBook(tmp_path / "costs.json")
    engine.calibrate(DecodeConfig(mode="lc"))  # no drafter in lc: nothing measured
    assert not (tmp_path / "costs.json").exists()
    engine.calibrate(DecodeConfig(mode="rapid", drafter_backend="torch"))
    (kept,) = json.loads((tmp_path / "costs.json").read_text())["machines"].values()
    assert [key.split()[0] for key in kept] == ["drafter"]
    before = (tmp_path / "costs.json").read_text()
    engine.calibrate(DecodeConfig(mode="rapid", drafter_backend="torch"))  # kept: not measured again
    assert (tmp_path / "costs.json").read_text() == before



def test_calibrate_measures_a_context_the_prefix_cache_holds_on_a_copy_of_it(tiny_model, tmp_path, monkeypatch):
    """A context the prefix cache holds (after an answer about a document) is measured on a copy of that entry:
    no filler prefill, the entry untouched; a longer context than any entry is prefilled with filler."""
    from rapidspec.config import DecodeConfig
    from rapidspec.drafting import calibration

    engine = Rapid(spec_of(kv_cache_gib=0), target=tiny_model)
    engine.costs = CostBook(tmp_path / "costs.json")
    out = engine.generate(" ".join(f"line {i} of the report." for i in range(40)), "which line?", mode="lc",
                          max_new_tokens=3)
    held = engine.prefix_cache.held_token_ids
    n = out.stats.prompt_tokens_target
    prefilled, measured = [], []
    new_cache = calibration.new_kv_cache
    monkeypatch.setattr(calibration, "new_kv_cache", lambda *a: prefilled.append(a) or new_cache(*a))
    measure = calibration.measure_verify
    monkeypatch.setattr(calibration, "measure_verify",
                        lambda cache, pending, tokens: measured.append((cache.length, list(pending))) or
                        measure(cache, pending, tokens))
    copies, longest = [], engine.prefix_cache.longest_copy
    monkeypatch.setattr(engine.prefix_cache, "longest_copy", lambda *a: copies.append(a) or longest(*a))
    queries = engine.prefix_cache.counters.queries
    engine.calibrate(DecodeConfig(mode="rapid"), contexts=[n])
    assert prefilled == [] and measured == [(n - 1, [held[0][n - 1]])] and len(copies) == 1
    assert engine.prefix_cache.held_token_ids == held
    assert engine.prefix_cache.counters.queries == queries  # not a request's lookup
    engine.calibrate(DecodeConfig(mode="rapid"), contexts=[n])  # kept: no copy, no measurement
    assert len(copies) == 1 and len(measured) == 1
    (kept,) = json.loads((tmp_path / "costs.json").read_text())["machines"].values()
    assert any(f"verify at {calibration.context_bucket(n)} tokens" in key for key in kept)
    engine.calibrate(DecodeConfig(mode="rapid"), contexts=[4 * n])  # longer than any entry: filler
    assert len(prefilled) == 1 and measured[-1][0] == 4 * n - 1

@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_cache_keeps_costs_in_memory_with_one_warning(tmp_path, caplog):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    book, calls = CostBook(folder / "costs.json"), []
    with caplog.at_level(logging.WARNING):
        for key in ("a", "a", "b"):
            book.get(float, key, lambda: calls.append(1) or 0.5)
    assert len(calls) == 2 and sum("cannot keep measured step costs" in r.message for r in caplog.records) == 1


# ------------------------------------------------------------------ the engine
def test_the_first_token_comes_before_retrieval_and_the_drafter(tiny_model):
    rapid = engine(tiny_model)
    calls: list[str] = []
    retrieve = rapid.retriever.retrieve
    rapid.retriever.retrieve = lambda *a, **k: calls.append("retrieve") or retrieve(*a, **k)
    stream = rapid.stream(DOCUMENT, QUESTION, mode="rapid", eta=1.0, max_new_tokens=40, ignore_eos=True)
    first = next(stream)
    assert first.token_ids and calls == []  # the first token: the target's prefill and one plain step
    output = list(stream)[-1].output
    stats = output.stats
    assert calls == ["retrieve"] and stats.retrieved_chunks > 0 and output.retrieval is not None
    assert stats.drafter_joined_at is not None and stats.drafter_joined_at >= 1 and stats.drafted_tokens > 0
    assert 0 < stats.time_to_first_token <= stats.drafter_join_seconds
    assert stats.prompt_tokens_drafter > 0 and stats.new_tokens == 40


def test_eta_zero_greedy_with_a_late_drafter_equals_lc(tiny_model):
    rapid = engine(tiny_model)
    lc = rapid.generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=48, ignore_eos=True)
    out = rapid.generate(DOCUMENT, QUESTION, mode="rapid", eta=0.0, max_new_tokens=48, ignore_eos=True)
    assert out.token_ids == lc.token_ids and out.stats.drafted_tokens > 0


def test_a_drafter_prefilled_beside_the_target_joins_under_the_cost_schedule(tiny_model, tmp_path):
    """drafter_prefill="beside" with the default join: the llama.cpp drafter joins at the first round's end and the
    cost schedule plans its rounds with the calibrated costs (it was once given none and the second round failed)."""
    from rapidspec.runtime.llama_cpp import llama_cpp_available
    from tests.tiny_gguf import write_tiny_gguf

    if not llama_cpp_available():
        pytest.skip("llama-cpp-python is not installed")
    rapid = Rapid(spec_of(retrieval=RETRIEVAL, drafter_backend="llama.cpp", drafter_prefill="beside"),
                  target=tiny_model, drafter=str(write_tiny_gguf(tiny_model, tmp_path / "self.gguf")))
    rapid.costs = StaticCosts()
    lc = rapid.generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=32, ignore_eos=True)
    out = rapid.generate(DOCUMENT, QUESTION, mode="rapid", eta=0.0, max_new_tokens=32, ignore_eos=True,
                         gamma_schedule="cost")
    assert out.stats.drafter_prefill_beside and out.stats.drafter_joined_at == 1
    assert out.stats.drafted_tokens > 0 and out.token_ids == lc.token_ids


def test_the_prefill_runs_in_pieces_of_about_one_plain_step(tiny_model):
    """200 retrieved tokens and more, 16 a piece (a plain step's worth): the drafter joins after that many rounds."""
    costs = StaticCosts(drafter=DrafterCosts(0.001, 0.1 / MIN_PIECE_TOKENS))  # 16 tokens cost one plain step
    rapid = engine(tiny_model, costs, reuse_document_cache=False)
    drafter_present = []  # per round: whether the drafter had joined (its cache given to the observer)
    stats = rapid.generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=200, ignore_eos=True,
                           observer=lambda cache, seq, drafter_cache, drafter_seq: drafter_present.append(
                               drafter_cache is not None)).stats
    pieces = -(-(stats.prompt_tokens_drafter - 1) // MIN_PIECE_TOKENS)
    # round 1 emits the first token, then each round boundary runs one piece: the drafter drafts the round after
    # the last one (rounds before it draft by prompt lookup and may emit several tokens each)
    assert drafter_present.index(True) == pieces and stats.drafter_joined_at >= pieces


@pytest.mark.parametrize("eta", [0.0, 5.0])
def test_until_the_drafter_joins_rounds_draft_by_lookup_and_answer_as_lc(tiny_model, eta):
    """A drafter that never pays: rounds after the first draft by prompt lookup over the target's own text, verified
    with eta = 0 (p, as plain steps), so the greedy answer is lc's whatever eta; the model drafter's counts stay 0."""
    dear = StaticCosts(drafter=DrafterCosts(0.01, 0.01))
    rapid = engine(tiny_model, dear)
    lc = rapid.generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=60, ignore_eos=True)
    out = rapid.generate(DOCUMENT, QUESTION, mode="rapid", eta=eta, max_new_tokens=60, ignore_eos=True)
    assert out.token_ids == lc.token_ids
    assert out.stats.lookup_drafted_tokens > 0 and out.stats.lookup_accepted_tokens > 0  # the tiny model repeats
    assert out.stats.drafter_joined_at is None and out.stats.drafted_tokens == 0 and out.stats.rounds == 0
    first = rapid.generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=60, ignore_eos=True, drafter_start="first")
    assert first.stats.lookup_drafted_tokens == 0 and first.stats.drafted_tokens > 0  # the drafter from round 1
    assert lc.stats.lookup_drafted_tokens == 0  # no drafter in lc: no lookup either


def test_the_lookup_rounds_before_the_join_match_at_least_rounds_min_ngram_tokens(tiny_model, monkeypatch):
    """Mode lookup matches from MIN_NGRAM tokens; the rounds before a model drafter joins from ROUNDS_MIN_NGRAM."""
    import rapidspec.engine.rapid as rapid_module
    from rapidspec.drafting.lookup import MIN_NGRAM, ROUNDS_MIN_NGRAM, LookupDrafter

    made = []

    class Recorded(LookupDrafter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.min_ngram)

    monkeypatch.setattr(rapid_module, "LookupDrafter", Recorded)
    rapid = engine(tiny_model, StaticCosts(drafter=DrafterCosts(0.01, 0.01)))
    rapid.generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=20, ignore_eos=True)
    assert made == [ROUNDS_MIN_NGRAM] and ROUNDS_MIN_NGRAM > MIN_NGRAM


def test_a_drafter_that_will_not_pay_is_never_prefilled(tiny_model):
    dear = StaticCosts(drafter=DrafterCosts(0.01, 0.01))  # 2-3 s to prefill against 0.1 s steps
    rapid = engine(tiny_model, dear)
    lc = rapid.generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=20, ignore_eos=True)
    out = rapid.generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=20, ignore_eos=True)
    assert out.token_ids == lc.token_ids
    assert out.stats.drafter_joined_at is None and out.stats.drafted_tokens == 0
    assert out.stats.drafter_prefill_reused_tokens == 0 and rapid.drafting.pool("torch").kept == 0
    costs = StaticCosts(drafter=DrafterCosts(0.01, 0.001))  # 0.2 s to prefill: pays on a long answer only
    short = engine(tiny_model, costs).generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=3, ignore_eos=True)
    assert short.stats.drafter_joined_at is None
    long = engine(tiny_model, costs).generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=60, ignore_eos=True)
    assert long.stats.drafter_joined_at is not None


def test_an_answer_ending_mid_prefill_keeps_the_prefix_for_the_next_question(tiny_model):
    costs = StaticCosts(drafter=DrafterCosts(0.001, 0.1 / MIN_PIECE_TOKENS))
    rapid = engine(tiny_model, costs)
    stream = rapid.stream(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=200, ignore_eos=True)
    for _ in range(10):  # the first token, then nine prefill pieces (144 tokens: a kept cache worth reusing)
        next(stream)
    stream.close()  # the user stops reading
    assert rapid.drafting.pool("torch").kept == 1
    second = rapid.generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=200, ignore_eos=True)
    # the plan's pieces share the prompt evenly: 9 of ceil(len / 16) pieces hold at most 9 * 16 tokens
    assert 8 * MIN_PIECE_TOKENS < second.stats.drafter_prefill_reused_tokens <= 9 * MIN_PIECE_TOKENS


def test_drafter_start_first_drafts_from_the_first_round(tiny_model):
    rapid = engine(tiny_model)
    stats = rapid.generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=16, ignore_eos=True,
                           drafter_start="first", gamma_schedule="constant").stats
    assert stats.drafter_joined_at == 0 and stats.plain_rounds == 0 and stats.retrieved_chunks > 0


def test_speculative_metrics_in_vllms_schema(tiny_model):
    stats = engine(tiny_model).generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=40, ignore_eos=True).stats
    metrics = stats.speculative_decoding()
    drafts = stats.rounds - stats.plain_rounds
    assert metrics["num_drafts"] == drafts > 0
    assert metrics["num_draft_tokens"] == stats.drafted_tokens
    assert metrics["num_accepted_draft_tokens"] == stats.accepted_tokens
    assert metrics["mean_acceptance_length"] == pytest.approx(1 + stats.accepted_tokens / drafts)
    histogram = metrics["acceptance_histogram"]
    assert sum(histogram) == drafts and sum(i * n for i, n in enumerate(histogram)) == stats.accepted_tokens


def test_a_retrieval_that_refuses_the_request_leaves_the_answer_to_the_target(tiny_model):
    """The preparation runs after the first token: a budget below every chunk ends it, not the answer."""
    rapid = Rapid(spec_of(retrieval=RetrievalConfig(method="bm25", chunk_tokens=96, budget_tokens=1), drafter_backend="torch"),
                  target=tiny_model)
    rapid.costs = StaticCosts()
    lc = rapid.generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=30, ignore_eos=True)
    out = rapid.generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=30, ignore_eos=True)
    assert out.token_ids == lc.token_ids and out.stats.drafter_joined_at is None
    assert "budget of 1 tokens" in out.stats.drafter_error
    with pytest.raises(Exception, match="budget of 1 tokens"):  # before the first round: the request's error
        rapid.generate(DOCUMENT, QUESTION, mode="rapid", max_new_tokens=30, drafter_start="first")
