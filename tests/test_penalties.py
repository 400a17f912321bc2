"""Frequency, presence and repetition penalties: the formulas, transformers' meaning, and exactness under speculation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from rapidspec import DecodeConfig, Rapid
from rapidspec.errors import RapidspecError
from rapidspec.retrieval import RetrievalConfig
from rapidspec.verification.penalties import Penalties, path_counts, penalise
from tests.test_engine_distribution import DOCUMENT as MARKOV_DOCUMENT
from tests.test_engine_distribution import DRAFT_ROWS, DRAFT_START, QUESTION as MARKOV_QUESTION, TARGET_ROWS, TARGET_START
from tests.test_engine_distribution import augmented_numpy, markov_pair, sampled_answers  # noqa: F401  (a fixture)
from tests.specs import spec_of

pytestmark = pytest.mark.usefixtures("drafter_from_the_first_round")

RETRIEVAL = RetrievalConfig(method="bm25", chunk_tokens=64, budget_tokens=128)
DOCUMENT = " ".join(f"Paragraph {i}: the quick brown fox number {i} jumps over the lazy dog again." for i in range(12))
QUESTION = "What does the fox do?"
PENALTIES = {"frequency_penalty": 0.6, "presence_penalty": 0.4, "repetition_penalty": 1.3}


def test_penalise_follows_the_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, float("-inf")]])
    counts = torch.tensor([[2, 0, 1, 1]])
    seen = torch.tensor([[True, True, False, True]])
    out = penalise(logits, counts, seen, frequency=0.5, presence=0.25, repetition=2.0)
    # token 0: 2 - 1 - 0.25 = 0.75 > 0 -> / 2; token 1: seen (prompt), -1 * 2; token 2: 0.5 - 0.5 - 0.25, unseen
    assert torch.allclose(out[0, :3], torch.tensor([0.375, -2.0, -0.25]))
    assert out[0, 3] == float("-inf")  # a masked token stays masked
    assert torch.equal(penalise(logits, counts, seen, 0.0, 0.0, 1.0), logits)  # all off: unchanged


def test_rows_along_a_path_equal_one_row_at_a_time():
    state = Penalties([1, 2], width=6, frequency=0.3, presence=0.2, repetition=1.5, device=torch.device("cpu"))
    state.commit([3, 3])
    assert torch.equal(path_counts(state.counts, [4, 3], 3)[:, 3:5], torch.tensor([[2, 0], [2, 1], [3, 1]]))
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    rows = state.rows(logits, [4, 3])
    for i in range(3):
        assert torch.allclose(rows[i], state.row_after(logits[i], [4, 3][:i]))


@pytest.mark.parametrize("options, message", [({"frequency_penalty": 2.5}, "frequency_penalty"),
                                              ({"presence_penalty": -3}, "presence_penalty"),
                                              ({"repetition_penalty": 0}, "repetition_penalty"),
                                              ({"repetition_penalty": float("nan")}, "repetition_penalty")])
def test_out_of_range_penalties_are_refused(options, message):
    with pytest.raises(RapidspecError, match=message):
        DecodeConfig(**options)


def reference_greedy(model, prompt: list[int], steps: int, eos: set[int], frequency: float, presence: float,
                     repetition: float) -> list[int]:
    """A plain greedy loop with transformers' forward and the penalties written out, no rapidspec in the way."""
    answer: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            z = model(torch.tensor([prompt + answer])).logits[0, -1].float().clone()
        for token in set(prompt + answer):  # transformers' RepetitionPenaltyLogitsProcessor, after OpenAI's two
            count = answer.count(token)
            z[token] -= frequency * count + presence * (count > 0)
            z[token] = z[token] / repetition if z[token] > 0 else z[token] * repetition
        answer.append(int(z.argmax()))
        if answer[-1] in eos:
            break
    return answer


def test_lc_follows_the_penalised_target(tiny_model):
    engine = Rapid(spec_of(retrieval=RETRIEVAL), target=tiny_model)
    config = DecodeConfig(mode="lc", max_new_tokens=24, **PENALTIES)
    out = engine.generate(DOCUMENT, QUESTION, config=config)
    prompt = list(engine.document_prompts(DOCUMENT, QUESTION, config).target_ids)
    assert list(out.token_ids) == reference_greedy(tiny_model.model, prompt, 24, set(engine.eos_token_ids),
                                                   **{k.removesuffix("_penalty"): v for k, v in PENALTIES.items()})
    # transformers' own repetition_penalty gives the same tokens (the one penalty it has)
    alone = engine.generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=24, repetition_penalty=1.3)
    hf = tiny_model.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, repetition_penalty=1.3,
                                   attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert list(alone.token_ids) == hf[0, len(prompt):].tolist()[: len(alone.token_ids)]
    plain = engine.generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=24)
    assert plain.token_ids != out.token_ids  # the penalties change this answer


@pytest.mark.parametrize("drafter", [None, "other"])
@pytest.mark.parametrize("mode", ["sd", "ragsd", "rapid", "magicdec", "lookup"])
def test_greedy_drafting_at_eta_zero_equals_penalised_lc(tiny_model, other_tiny_model, drafter, mode):
    """Drafts are penalised along their path as the target's rows are, so at eta = 0 nothing changes the answer."""
    engine = Rapid(spec_of(retrieval=RETRIEVAL, drafter_backend="torch"),
                   target=tiny_model, drafter=other_tiny_model if drafter else None)
    lc = engine.generate(DOCUMENT, QUESTION, mode="lc", max_new_tokens=32, **PENALTIES)
    eta = {"eta": 0.0} if mode == "rapid" else {}
    out = engine.generate(DOCUMENT, QUESTION, mode=mode, max_new_tokens=32, gamma=4, gamma_schedule="constant",
                          **eta, **PENALTIES)
    assert out.token_ids == lc.token_ids
    if mode != "lookup":
        assert out.stats.drafted_tokens > 0


def penalised_rows(rows: np.ndarray, counts: np.ndarray, seen: np.ndarray, frequency: float, presence: float,
                   repetition: float):
    """Probabilities after the penalties, from probabilities, the answer's counts and the states seen in the prompt."""
    z = np.log(rows) - frequency * counts - presence * (counts > 0)
    z = np.where(seen | (counts > 0), np.where(z > 0, z / repetition, z * repetition), z)
    e = np.exp(z - z.max())
    return e / e.sum()


def expected_joint_penalised(eta: float, alpha: float, seen: np.ndarray) -> np.ndarray:
    """The first 3 states when every token follows p^ of the penalised p and q of its position (``seen``: [4] bool,
    the states in the target's prompt)."""
    joint = np.zeros((4, 4, 4))
    pen = {k.removesuffix("_penalty"): v for k, v in PENALTIES.items()}
    for path in itertools.product(range(4), repeat=3):
        prob, p, q, counts = 1.0, np.array(TARGET_START), np.array(DRAFT_START), np.zeros(4)
        for state in path:
            prob *= augmented_numpy(penalised_rows(p, counts, seen, **pen), penalised_rows(q, counts, seen, **pen), eta,
                                    alpha)[state]
            p, q = np.array(TARGET_ROWS[state]), np.array(DRAFT_ROWS[state])
            counts[state] += 1
        joint[path] = prob
    return joint


@pytest.mark.parametrize(("mode", "eta"), [("ragsd", 0.0), ("rapid", 3.0), ("lookup", 0.0)])
def test_sampled_sequences_follow_the_penalised_target(markov_pair, mode, eta):  # noqa: F811
    """eta = 0 follows the penalised p, eta > 0 the p^ of the penalised p and q. 3000 answers of 3 tokens drafted 2 at
    a time (acceptance, rejection and the bonus token all occur, with counts that change inside a round); chi-square
    over the 64 outcomes. With a correct engine each case fails with probability 1e-4."""
    target, drafter, states = markov_pair
    rapid = Rapid(spec_of(retrieval=RETRIEVAL, reuse_document_cache=False), target=target, drafter=drafter)
    generator = torch.Generator().manual_seed(17)
    n = 3000
    index = {s: i for i, s in enumerate(states)}
    counts = np.zeros((4, 4, 4))
    for answer in sampled_answers(rapid, n, generator, MARKOV_DOCUMENT, MARKOV_QUESTION, mode=mode, eta=eta, gamma=2,
                                  gamma_schedule="constant", temperature=1.0, max_new_tokens=3, **PENALTIES):
        counts[tuple(index[t] for t in answer)] += 1
    prompt = rapid.document_prompts(MARKOV_DOCUMENT, MARKOV_QUESTION, DecodeConfig(mode="lc")).target_ids
    seen = np.array([s in prompt for s in states])  # the template's "below" and "text": w and x
    assert seen.any() and not seen.all()
    expected = expected_joint_penalised(eta, 0.1, seen).ravel() * n
    assert chisquare(counts.ravel(), expected * (n / expected.sum())).pvalue > 1e-4
