"""Exact distributions and forced-logit cases through the whole engine.

``MarkovLM`` is a model whose next-token logits depend only on the last token
(a table), so the distribution of the first tokens of an answer is known in
closed form whatever the context. Target and drafter get different tables.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import GenerationConfig, LlamaConfig

from rapidspec import DecodeConfig, Rapid
from rapidspec.drafting.gamma_schedule import CostSchedule, StepCosts
from rapidspec.grammar import Grammar
from rapidspec.models import LoadedModel
from rapidspec.outputs import last_output
from rapidspec.retrieval import RetrievalConfig
from tests.test_engine import PlainSteps
from tests.specs import spec_of

# the rounds' math from the first round (drafter_start="first"; the default join: test_drafter_join.py)
pytestmark = pytest.mark.usefixtures("drafter_from_the_first_round")

DOCUMENT = "\n\n".join(f"Line {i} of a short note about apples and pears." for i in range(30))
QUESTION = "What fruit is named?"
RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=64, budget_tokens=128)


class MarkovLM(torch.nn.Module):
    """logits(next | ..., last) = table[last]; ignores the cache it is given."""

    def __init__(self, table: torch.Tensor, eos_id: int) -> None:
        super().__init__()
        vocab = table.shape[0]
        self.table = table
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=8, num_hidden_layers=1, num_attention_heads=1)
        self.generation_config = GenerationConfig(eos_token_id=eos_id)
        self.lm_head = torch.nn.Linear(1, vocab, bias=False)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, past_key_values=None, use_cache=True, logits_to_keep=1):
        return SimpleNamespace(logits=self.table[input_ids[:, -logits_to_keep:]])


def markov_table(tokenizer, rows: dict[int, list[float]], states: list[int], default: list[float]) -> torch.Tensor:
    """A [V, V] logit table: from any token, next-token probabilities over ``states``."""
    vocab = len(tokenizer)
    table = torch.full((vocab, vocab), -math.inf)
    for token in range(vocab):
        probs = rows.get(token, default)
        table[token, states] = torch.tensor(probs).log()
    return table


def loaded(model: MarkovLM, tokenizer) -> LoadedModel:
    return LoadedModel(
        name="markov", model=model, tokenizer=tokenizer, device=model.device, dtype=torch.float32,
        max_context=100_000, source="table",
    )


def sampled_answers(rapid: Rapid, n: int, generator: torch.Generator, document: str = DOCUMENT,
                    question: str = QUESTION, **options) -> list[list[int]]:
    """The token ids of ``n`` answers to one question, sampled through the engine's decode (prompts built once)."""
    config = DecodeConfig(**options)
    prompts = rapid.document_prompts(document, question, config)
    return [last_output(rapid.decode(prompts, config, generator=generator)).token_ids for _ in range(n)]


def augmented_numpy(p: np.ndarray, q: np.ndarray, eta: float, alpha: float) -> np.ndarray:
    """p^ = softmax(log p + eta * 1[q >= alpha max q] * (q - p)), written independently of the library."""
    shift = np.where(q >= alpha * q.max(), q - p, 0.0)
    logits = np.log(p) + eta * shift
    e = np.exp(logits - logits.max())
    return e / e.sum()


TARGET_ROWS = [[0.4, 0.3, 0.2, 0.1], [0.1, 0.5, 0.2, 0.2], [0.25, 0.25, 0.3, 0.2], [0.3, 0.1, 0.3, 0.3]]
DRAFT_ROWS = [[0.1, 0.2, 0.3, 0.4], [0.3, 0.3, 0.2, 0.2], [0.5, 0.1, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25]]
TARGET_START = [0.3, 0.3, 0.2, 0.2]
DRAFT_START = [0.1, 0.6, 0.2, 0.1]


@pytest.fixture(scope="module")
def markov_pair(byte_tokenizer):
    states = byte_tokenizer.convert_tokens_to_ids(list("wxyz"))
    target = MarkovLM(markov_table(byte_tokenizer, dict(zip(states, TARGET_ROWS)), states, TARGET_START), -1)
    drafter = MarkovLM(markov_table(byte_tokenizer, dict(zip(states, DRAFT_ROWS)), states, DRAFT_START), -1)
    return loaded(target, byte_tokenizer), loaded(drafter, byte_tokenizer), states


def expected_joint(eta: float, alpha: float, length: int) -> np.ndarray:
    """Distribution over the first ``length`` states when every token follows p^ of its position."""
    start_p, start_q = np.array(TARGET_START), np.array(DRAFT_START)
    rows_p, rows_q = np.array(TARGET_ROWS), np.array(DRAFT_ROWS)
    joint = np.zeros((4,) * length)
    for path in itertools.product(range(4), repeat=length):
        prob, p, q = 1.0, start_p, start_q
        for state in path:
            prob *= augmented_numpy(p, q, eta, alpha)[state]
            p, q = rows_p[state], rows_q[state]
        joint[path] = prob
    return joint


@pytest.mark.parametrize(
    "mode, eta, confidence",
    [("ragsd", 0.0, 0.0), ("rapid", 3.0, 0.0), ("ragsd", 0.0, 0.25), ("rapid", 3.0, 0.25), ("magicdec", 0.0, 0.0),
     ("lookup", 0.0, 0.0)],
)
def test_sampled_sequences_follow_the_target(markov_pair, mode, eta, confidence):
    """Invariants 2 and 3: eta = 0 follows p, eta > 0 with the exact residual follows p^.

    3000 answers of 3 tokens (drafted 2 at a time, so acceptance, rejection and
    the bonus token all occur); chi-square over the 64 joint outcomes. With
    ``draft_confidence`` 0.25, rounds also stop after drafts with q < 0.25
    (about half of them here), which must not change the distribution. With a
    correct engine each case fails with probability 1e-4.
    """
    target, drafter, states = markov_pair
    rapid = Rapid(spec_of(retrieval=RETRIEVAL, reuse_document_cache=False),
                  target=target, drafter=drafter)  # 3000 stored caches: slow
    generator = torch.Generator().manual_seed(11)
    n = 3000
    index = {s: i for i, s in enumerate(states)}
    counts = np.zeros((4, 4, 4))
    for answer in sampled_answers(rapid, n, generator, mode=mode, eta=eta, gamma=2, temperature=1.0, max_new_tokens=3,
                                  draft_confidence=confidence, gamma_schedule="constant"):
        counts[tuple(index[t] for t in answer)] += 1
    expected = expected_joint(eta, 0.1, 3).ravel() * n
    assert chisquare(counts.ravel(), expected * (n / expected.sum())).pvalue > 1e-4


# With a flat verify cost, drafting k = 1 pays iff a_1 > draft_step / verify = 0.5: after round 1
# (gamma = 1) a_1 is 0.75 if its draft was accepted, 0.25 if not, so later rounds depend on history.
HISTORY_DEPENDENT_COSTS = StepCosts(draft_step=0.5, verify_base=1.0, verify_per_token=0.0)
# Drafts so cheap that every k >= 1 beats a plain step (E(1) / C(1) >= 1.25 / 1.0625 > 1) while the
# best k still grows with a_1: with eta > 0 no round is plain, so every token follows p^.
CHEAP_DRAFT_COSTS = StepCosts(draft_step=0.05, verify_base=1.0, verify_per_token=0.0)


@pytest.mark.parametrize(("mode", "eta"), [("ragsd", 0.0), ("rapid", 3.0)])
def test_cost_schedule_sampled_sequences_follow_the_target(markov_pair, mode, eta):
    """Invariants 2 and 3 when the cost schedule chooses each round's k from the acceptance so far.

    The costs are fixed so the choice depends on the history: with eta = 0,
    k = 0 (a plain step) after a rejected first draft and k = 1 after an
    accepted one; with eta = 3 (cheap drafts, bonus forward counted, no plain
    round), k = 1 after a rejection, more after an acceptance. 3000 answers
    of 5 tokens; chi-square
    over the 64 outcomes of the first 3 tokens, which rounds of every kind
    produce. With a correct engine each case fails with probability 1e-4.
    """
    target, drafter, states = markov_pair
    rapid = Rapid(spec_of(retrieval=RETRIEVAL, reuse_document_cache=False),
                  target=target, drafter=drafter)  # 3000 stored caches: slow
    config = DecodeConfig(mode=mode, eta=eta, gamma=1, gamma_schedule="cost", temperature=1.0, max_new_tokens=5)
    prompts = rapid.document_prompts(DOCUMENT, QUESTION, config)
    generator = torch.Generator().manual_seed(12)
    n = 3000
    index = {s: i for i, s in enumerate(states)}
    counts = np.zeros((4, 4, 4))
    plain_rounds = drafted_again = drafted_two = 0
    for _ in range(n):
        costs = HISTORY_DEPENDENT_COSTS if eta == 0 else CHEAP_DRAFT_COSTS
        schedule = CostSchedule(config.gamma, config.max_gamma, eta, costs)
        out = last_output(rapid.decode(prompts, config, generator=generator, schedule=schedule))
        counts[tuple(index[t] for t in out.token_ids[:3])] += 1
        plain_rounds += out.stats.plain_rounds
        drafted_again += out.stats.drafted_per_position[0] >= 2  # a later round drafted too
        drafted_two += len(out.stats.drafted_per_position) >= 2  # a later round drafted 2 (round 1 drafts 1)
    if eta == 0:  # about 2 plain rounds per answer, 70% of answers draft again
        assert plain_rounds > n and drafted_again > n / 2
    else:  # 95% of answers draft 2 in a round; a plain round only when one token is left
        assert plain_rounds < n / 4 and drafted_two > n / 2
    expected = expected_joint(eta, 0.1, 3).ravel() * n
    assert chisquare(counts.ravel(), expected * (n / expected.sum())).pvalue > 1e-4


def test_plain_rounds_follow_the_target_even_when_eta_is_positive(markov_pair):
    """A schedule asking for 0 drafts gets plain steps: tokens follow p, not p^, and the drafter never runs.

    3000 answers of 3 tokens, eta = 3; chi-square over the 64 outcomes against
    p's joint (with a correct engine it fails with probability 1e-4), and
    against p^'s joint, which these tokens must not follow (p^ and p differ
    enough here that a correct engine passes this with probability > 1 - 1e-6).
    """
    target, drafter, states = markov_pair
    rapid = Rapid(spec_of(retrieval=RETRIEVAL, reuse_document_cache=False), target=target, drafter=drafter)
    config = DecodeConfig(mode="rapid", eta=3.0, gamma=1, temperature=1.0, max_new_tokens=3, gamma_schedule="constant")
    prompts = rapid.document_prompts(DOCUMENT, QUESTION, config)
    generator = torch.Generator().manual_seed(13)
    n = 3000
    index = {s: i for i, s in enumerate(states)}
    counts = np.zeros((4, 4, 4))
    for _ in range(n):
        out = last_output(rapid.decode(prompts, config, generator=generator, schedule=PlainSteps()))
        assert out.stats.drafted_tokens == 0 and out.stats.rounds == out.stats.plain_rounds == 3
        counts[tuple(index[t] for t in out.token_ids)] += 1
    follows_p, follows_p_hat = (expected_joint(eta, 0.1, 3).ravel() * n for eta in (0.0, 3.0))
    assert chisquare(counts.ravel(), follows_p * (n / follows_p.sum())).pvalue > 1e-4
    assert chisquare(counts.ravel(), follows_p_hat * (n / follows_p_hat.sum())).pvalue < 1e-6


def forced(byte_tokenizer, target_next: dict[str, str], draft_next: dict[str, str], start_t: str, start_d: str, eos_after=None):
    """Deterministic tables: after character c the target puts all mass on target_next[c]."""
    vocab = len(byte_tokenizer)
    ids = byte_tokenizer.convert_tokens_to_ids

    def table(next_map, start):
        t = torch.full((vocab, vocab), -30.0)
        t[:, ids(start)] = 0.0
        for a, b in next_map.items():
            t[ids(a)] = -30.0
            t[ids(a), byte_tokenizer.eos_token_id if b == "EOS" else ids(b)] = 0.0
        return t

    eos = byte_tokenizer.eos_token_id
    return (
        loaded(MarkovLM(table(target_next, start_t), eos), byte_tokenizer),
        loaded(MarkovLM(table(draft_next, start_d), eos), byte_tokenizer),
    )


def test_forced_all_accepted_gives_the_bonus_token(byte_tokenizer):
    chain = {"a": "b", "b": "c", "c": "d", "d": "e", "e": "f", "f": "g", "g": "h"}
    target, drafter = forced(byte_tokenizer, chain, chain, "a", "a")
    out = Rapid(spec_of(retrieval=RETRIEVAL), target=target, drafter=drafter).generate(
        DOCUMENT, QUESTION, mode="ragsd", gamma=3, max_new_tokens=8, gamma_schedule="constant"
    )
    assert out.text == "abcdefgh"
    # rounds: [a b c] + d bonus, [e f g] + h bonus
    assert out.stats.rounds == 2 and out.stats.accepted_tokens == 6 and out.stats.drafted_tokens == 6


def test_forced_draft_confidence_ends_the_round_after_an_unsure_draft(byte_tokenizer):
    """After b the drafter splits its mass between c and y (top probability about 0.5)."""
    chain = {"a": "b", "b": "c", "c": "d", "d": "e", "e": "f", "f": "g", "g": "h"}
    target, drafter = forced(byte_tokenizer, chain, chain, "a", "a")
    b, y = byte_tokenizer.convert_tokens_to_ids(["b", "y"])
    drafter.model.table[b, y] = -0.01
    out = Rapid(spec_of(retrieval=RETRIEVAL), target=target, drafter=drafter).generate(
        DOCUMENT, QUESTION, mode="ragsd", gamma=4, max_new_tokens=8, draft_confidence=0.6, gamma_schedule="constant"
    )
    assert out.text == "abcdefgh"
    # rounds: [a b c] stops after the unsure c, + d bonus; then [e f g] (3 left to draft) + h bonus.
    # Without the stop: [a b c d] + e, then [f g] + h, i.e. drafted per position [2, 2, 1, 1].
    assert out.stats.rounds == 2 and out.stats.accepted_tokens == 6
    assert out.stats.drafted_per_position == [2, 2, 2]


def test_forced_first_rejected_emits_the_target_token(byte_tokenizer):
    target_chain = {"a": "b", "b": "c", "c": "d", "d": "e", "e": "f", "f": "g"}
    draft_chain = {"a": "x", "x": "y", "y": "z", "z": "x", "b": "x", "c": "x", "d": "x", "e": "x", "f": "x"}
    target, drafter = forced(byte_tokenizer, target_chain, draft_chain, "a", "q")
    out = Rapid(spec_of(retrieval=RETRIEVAL), target=target, drafter=drafter).generate(
        DOCUMENT, QUESTION, mode="ragsd", gamma=3, max_new_tokens=6, gamma_schedule="constant"
    )
    assert out.text == "abcdef"
    assert out.stats.accepted_tokens == 0
    assert out.stats.rounds == 6


def test_forced_eos_inside_a_draft_stops(byte_tokenizer):
    chain = {"a": "b", "b": "EOS"}
    target, drafter = forced(byte_tokenizer, chain, chain, "a", "a")
    out = Rapid(spec_of(retrieval=RETRIEVAL), target=target, drafter=drafter).generate(
        DOCUMENT, QUESTION, mode="ragsd", gamma=5, max_new_tokens=20, gamma_schedule="constant"
    )
    assert out.text == "ab"
    assert out.stats.stop_reason == "eos"
    assert out.stats.rounds == 1
    # the drafter stopped drafting at EOS: a, b, EOS
    assert out.stats.drafted_tokens == 3


@pytest.mark.parametrize("mode", ["lc", "ragsd", "rapid"])
def test_ignore_eos_generates_past_eos_up_to_the_limit(byte_tokenizer, mode):
    chain = {"a": "b", "b": "EOS"}  # after EOS the tables go back to "a"
    target, drafter = forced(byte_tokenizer, chain, chain, "a", "a")
    out = Rapid(spec_of(retrieval=RETRIEVAL), target=target, drafter=drafter).generate(
        DOCUMENT, QUESTION, mode=mode, gamma=4, max_new_tokens=9, ignore_eos=True, gamma_schedule="constant"
    )
    eos = byte_tokenizer.eos_token_id
    a, b = byte_tokenizer.convert_tokens_to_ids(["a", "b"])
    assert out.token_ids == (a, b, eos) * 3
    assert out.text == "ababab"  # EOS is a special token: not in the text
    assert out.stats.stop_reason == "length" and out.stats.new_tokens == 9
    if mode != "lc":
        assert out.stats.accepted_tokens == out.stats.drafted_tokens  # drafting went on past EOS


@pytest.mark.parametrize(("mode", "expected"), [("ragsd", "abc"), ("rapid", "aby")])
def test_greedy_bonus_token_uses_the_drafter_at_the_bonus_position(byte_tokenizer, mode, expected):
    """Both drafts accepted; at the bonus position the target nearly ties c (0) and y (-0.1), the drafter says y.

    rapid (eta = 2) must shift the bonus choice to y, which needs q at the bonus position.
    """
    target, drafter = forced(byte_tokenizer, {"a": "b", "b": "c"}, {"a": "b", "b": "y"}, "a", "a")
    b, y = byte_tokenizer.convert_tokens_to_ids(["b", "y"])
    target.model.table[b, y] = -0.1
    out = Rapid(spec_of(retrieval=RETRIEVAL), target=target, drafter=drafter).generate(
        DOCUMENT, QUESTION, mode=mode, gamma=2, max_new_tokens=3, gamma_schedule="constant"
    )
    assert out.text == expected
    assert out.stats.rounds == 1 and out.stats.accepted_tokens == 2


# Allowed states per position under GRAMMAR (w x y z = states 0 1 2 3); every token after the third is free.
GRAMMAR_ALLOWED = [[0, 1, 2], [1, 3], [0, 2, 3]]
GRAMMAR = Grammar.regex("[wxy][xz][wyz][wxyz]*")


def expected_joint_under_grammar(eta: float, alpha: float) -> np.ndarray:
    """As :func:`expected_joint` for 3 tokens, with p and q restricted to the allowed states and renormalised."""
    start_p, start_q = np.array(TARGET_START), np.array(DRAFT_START)
    rows_p, rows_q = np.array(TARGET_ROWS), np.array(DRAFT_ROWS)
    joint = np.zeros((4, 4, 4))
    for path in itertools.product(range(4), repeat=3):
        prob, p, q = 1.0, start_p, start_q
        for position, state in enumerate(path):
            keep = np.isin(np.arange(4), GRAMMAR_ALLOWED[position])
            pk, qk = np.where(keep, p, 0.0), np.where(keep, q, 0.0)
            with np.errstate(divide="ignore"):
                prob *= augmented_numpy(pk / pk.sum(), qk / qk.sum(), eta, alpha)[state]
            p, q = rows_p[state], rows_q[state]
        joint[path] = prob
    return joint


@pytest.mark.parametrize(("mode", "eta"), [("ragsd", 0.0), ("rapid", 3.0), ("lookup", 0.0)])
def test_sampled_sequences_under_a_grammar_follow_the_constrained_target(markov_pair, mode, eta):
    """A grammar masks p, q and p^ alike: eta = 0 follows p restricted to the allowed tokens, eta > 0 the p^ of the
    restricted p and q (the shift acts among allowed tokens only). 3000 answers of 3 tokens drafted 2 at a time;
    chi-square over the 64 outcomes (those the grammar forbids expected 0, so any one fails the test). With a correct
    engine each case fails with probability 1e-4."""
    target, drafter, states = markov_pair
    rapid = Rapid(spec_of(retrieval=RETRIEVAL, reuse_document_cache=False), target=target, drafter=drafter)
    generator = torch.Generator().manual_seed(13)
    n = 3000
    index = {s: i for i, s in enumerate(states)}
    counts = np.zeros((4, 4, 4))
    for answer in sampled_answers(rapid, n, generator, mode=mode, eta=eta, gamma=2, gamma_schedule="constant",
                                  temperature=1.0, max_new_tokens=3, grammar=GRAMMAR):
        counts[tuple(index[t] for t in answer)] += 1
    expected = expected_joint_under_grammar(eta, 0.1).ravel() * n
    allowed = expected > 0
    assert counts.ravel()[~allowed].sum() == 0
    assert chisquare(counts.ravel()[allowed], expected[allowed] * (n / expected.sum())).pvalue > 1e-4
