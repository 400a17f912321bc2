"""The pure math of one verification step (invariants 3 and 4 at the level of one step)."""

import pytest
import torch
from scipy.stats import chisquare

from rapidspec.verification import sampling

# A worked example of the paper's residual.
P = torch.tensor([[0.156, 0.318, 0.152, 0.013, 0.361]])
Q = torch.tensor([[0.242, 0.055, 0.296, 0.214, 0.193]])


def augmented(p, q, eta, alpha):
    return sampling.augmented_logits(p.log(), p, q, eta, alpha).softmax(-1)


def fit(probs, n):
    """Expected counts of ``n`` draws from a [1, V] distribution, summing exactly to n."""
    counts = probs[0].double().numpy() * n
    return counts * (n / counts.sum())


def one_step(p, q, p_hat, residual, n, generator):
    """Monte Carlo of one verification step: draft x ~ q, accept or resample."""
    drafts = torch.multinomial(q.expand(n, -1), 1, replacement=True, generator=generator).squeeze(-1)  # [n]
    uniforms = torch.rand(n, generator=generator)
    accept = sampling.acceptance_mask(drafts, q.expand(n, -1), p_hat.expand(n, -1), uniforms)
    fallback = sampling.sample(sampling.residual_probs(p, q, p_hat, residual).expand(n, -1), generator)
    return torch.where(accept, drafts, fallback)


def test_filter_logits_top_k_and_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    assert torch.isinf(sampling.filter_logits(logits, top_k=2)[0, 2:]).all()
    assert torch.isfinite(sampling.filter_logits(logits, top_k=2)[0, :2]).all()
    probs = logits.softmax(-1)[0]  # [0.644, 0.237, 0.087, 0.032]
    kept = torch.isfinite(sampling.filter_logits(logits, top_p=0.7))[0]
    assert kept.tolist() == [True, True, False, False]
    assert probs[0] < 0.7 <= probs[0] + probs[1]
    # top_p smaller than the best token's probability still keeps that token.
    assert torch.isfinite(sampling.filter_logits(logits, top_p=0.01))[0].tolist() == [True, False, False, False]
    # ... even a top_p that float32 rounds to 0 (it dropped every token: a 500 from the server)
    assert torch.isfinite(sampling.filter_logits(logits, top_p=1e-300))[0].tolist() == [True, False, False, False]


@pytest.mark.parametrize("field, value", [("eta", 1e300), ("eta", 1e4 + 1), ("eta", float("inf")), ("eta", float("nan")),
                                          ("temperature", 1e300), ("temperature", float("inf"))])
def test_float_knobs_stay_in_what_float32_carries(field, value):
    from rapidspec.config import DecodeConfig
    from rapidspec.errors import RapidspecError

    with pytest.raises(RapidspecError, match=field):
        DecodeConfig(**{field: value})
    DecodeConfig(**{field: 1e4})  # the bound itself is fine


def test_draft_gate_applies_only_where_q_is_large():
    shift = sampling.draft_gate(P, Q, alpha=0.9)
    # max q = 0.296; gate keeps q >= 0.266 -> token 2 only
    assert torch.allclose(shift, torch.tensor([[0.0, 0.0, 0.296 - 0.152, 0.0, 0.0]]))
    assert torch.allclose(sampling.draft_gate(P, Q, alpha=0.0), Q - P)


def test_eta_zero_gives_the_target():
    assert torch.equal(sampling.augmented_logits(P.log(), P, Q, 0.0, 0.1), P.log())


def test_paper_example_augmented_distribution():
    p_hat = augmented(P, Q, eta=5.0, alpha=0.1)
    assert torch.allclose(p_hat, torch.tensor([[0.289, 0.103, 0.377, 0.043, 0.188]]), atol=2e-3)


def test_paper_residual_closed_form_matches_the_notes():
    p_hat = augmented(P, Q, eta=5.0, alpha=0.1)
    closed = sampling.output_distribution_paper(P, Q, p_hat)
    assert torch.allclose(closed, torch.tensor([[0.242, 0.161, 0.296, 0.043, 0.258]]), atol=2e-3)


@pytest.mark.parametrize("residual", ["exact", "paper"])
def test_one_step_output_distribution(residual):
    """exact -> p^ (invariant 3), paper -> Eq. 10 closed form (invariant 4).

    Chi-square goodness of fit, 200k draws; fails with probability 1e-4 when the
    implementation is right.
    """
    generator = torch.Generator().manual_seed(1)
    p_hat = augmented(P, Q, eta=5.0, alpha=0.1)
    expected = p_hat if residual == "exact" else sampling.output_distribution_paper(P, Q, p_hat)
    n = 200_000
    tokens = one_step(P, Q, p_hat, residual, n, generator)
    observed = torch.bincount(tokens, minlength=5).double()
    assert chisquare(observed.numpy(), fit(expected, n)).pvalue > 1e-4
    # And the two differ: the paper's residual does not sample p^.
    assert (sampling.output_distribution_paper(P, Q, p_hat) - p_hat).abs().max() > 0.05


def test_eta_zero_one_step_is_lossless():
    """eta = 0: plain speculative sampling follows p (failure probability 1e-4)."""
    generator = torch.Generator().manual_seed(2)
    n = 200_000
    tokens = one_step(P, Q, P, "exact", n, generator)
    observed = torch.bincount(tokens, minlength=5).double()
    assert chisquare(observed.numpy(), fit(P, n)).pvalue > 1e-4


def test_residual_falls_back_when_mass_vanishes():
    same = torch.tensor([[0.5, 0.5]])
    assert torch.allclose(sampling.residual_probs(same, same, same, "exact"), same)
    assert torch.allclose(sampling.residual_probs(same, same, same, "paper"), same)


def test_accepted_prefix_and_greedy_length():
    assert sampling.accepted_prefix_length(torch.tensor([True, True, False, True])) == 2
    assert sampling.accepted_prefix_length(torch.tensor([], dtype=torch.bool)) == 0
    assert sampling.greedy_accepted_length(torch.tensor([5, 7, 9]), torch.tensor([5, 7, 2, 4])) == 2
    assert sampling.greedy_accepted_length(torch.tensor([5, 7, 9]), torch.tensor([5, 7, 9, 4])) == 3


def test_greedy_choice_follows_the_shift():
    target_logits = torch.tensor([[2.0, 1.9, 0.0]])
    draft_logits = torch.tensor([[0.0, 5.0, 0.0]])
    assert sampling.greedy_target_choices(target_logits, draft_logits, 0.0, 0.1).tolist() == [0]
    assert sampling.greedy_target_choices(target_logits, draft_logits, 1.0, 0.1).tolist() == [1]
    # rows without a drafter distribution fall back to the target's argmax
    two = torch.tensor([[2.0, 1.9, 0.0], [0.0, 0.0, 3.0]])
    assert sampling.greedy_target_choices(two, draft_logits, 1.0, 0.1).tolist() == [1, 2]


def test_top_probability_is_the_softmax_maximum():
    logits = torch.tensor([2.0, -1.0, 0.5, 2.0, -30.0])
    assert sampling.top_probability(logits) == pytest.approx(float(logits.softmax(-1).max()), rel=1e-6)
    assert sampling.top_probability(torch.tensor([0.0, -torch.inf])) == pytest.approx(1.0)
    assert sampling.top_probability(torch.zeros(4, dtype=torch.bfloat16)) == pytest.approx(0.25)


def test_verify_greedy_worked_example():
    """The docstring's example: drafts [5, 7, 9], target argmax [5, 7, 2, 4] -> 2 accepted, recovered 2."""
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([5, 7, 2, 4]):
        logits[row, token] = 5.0
    greedy = sampling.SamplingParams()
    verdict = sampling.verify(logits, [5, 7, 9], None, greedy)
    assert (verdict.accepted, verdict.next_token) == (2, 2)
    everything = sampling.verify(logits, [5, 7, 2], None, greedy)
    assert (everything.accepted, everything.next_token) == (3, 4)  # the bonus token


def test_verify_leaves_the_bonus_token_open_only_when_all_drafts_pass_and_eta_is_positive():
    logits = torch.zeros(3, 6)
    logits[:, 1] = 3.0  # the target wants token 1 everywhere
    rows = torch.zeros(2, 6)
    rows[:, 1] = 3.0
    bonus_row = torch.zeros(6)
    bonus_row[4] = 50.0  # a drafter sure of token 4 at the bonus position
    shifted = sampling.SamplingParams(eta=5.0)
    rejected = sampling.verify(logits, [1, 2], rows, shifted)
    assert (rejected.accepted, rejected.next_token) == (1, 1)  # recovered: decided without the drafter
    accepted = sampling.verify(logits, [1, 1], rows, shifted)
    assert (accepted.accepted, accepted.next_token) == (2, None)  # p^ at k + 1 needs the drafter's row there
    assert sampling.bonus_token(logits, 2, bonus_row, shifted) == 4  # argmax(z + eta * g) with q there
    assert sampling.bonus_token(logits, 2, None, shifted) == 1  # no row (a stopping draft): p
    plain = sampling.verify(logits[:1], [], None, sampling.SamplingParams())
    assert (plain.accepted, plain.next_token) == (0, 1)  # k = 0, eta = 0: a plain step


def test_bonus_token_when_sampling_follows_p_hat():
    """With one bonus row, repeated draws follow softmax(z / T + eta * g) at that position (a chi-square bound:
    the gap allowed is 5 standard errors, false failure below 1e-6)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5)
    q = torch.tensor([0.05, 0.6, 0.2, 0.1, 0.05])
    params = sampling.SamplingParams(eta=2.0, alpha=0.0, temperature=1.0)
    expected = sampling.augmented_logits(logits[1:], logits[1:].softmax(-1), q[None], 2.0, 0.0).softmax(-1)[0]
    generator = torch.Generator().manual_seed(1)
    draws = 20000
    counts = torch.bincount(torch.tensor([sampling.bonus_token(logits, 1, q, params, generator) for _ in range(draws)]),
                            minlength=5).float() / draws
    assert torch.all((counts - expected).abs() <= 5 * (expected * (1 - expected) / draws).sqrt() + 1e-9)


def test_temperature_comes_before_top_k_and_top_p_as_in_transformers():
    """p is softmax of the logits at the temperature, then filtered: transformers' warpers in their order."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from rapidspec.verification.logprobs import output_logprobs

    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0]])  # [1, V]
    for temperature, top_k, top_p in [(2.0, 0, 0.7), (0.5, 0, 0.7), (2.0, 3, 0.9)]:
        expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        expected = TopPLogitsWarper(top_p)(None, expected).log_softmax(-1)
        got = output_logprobs(logits, None, sampling.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
        torch.testing.assert_close(got, expected)
    # The order matters: at T = 2 the nucleus of 0.7 keeps three tokens, filtering first would keep two.
    hot = output_logprobs(logits, None, sampling.SamplingParams(temperature=2.0, top_p=0.7))
    assert torch.isfinite(hot).sum() == 3 and torch.isfinite(sampling.filter_logits(logits, top_p=0.7)).sum() == 2
