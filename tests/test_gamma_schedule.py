"""The gamma schedules (rapidspec.drafting.gamma_schedule): the cost model's math by hand, the schedules' state, the option."""

from __future__ import annotations

import random

import pytest

from rapidspec import DecodeConfig
from rapidspec.cli import main
from rapidspec.engine import resolve
from rapidspec.errors import RapidspecError
from rapidspec.drafting.gamma_schedule import (
    ACCEPTANCE_DECAY,
    MAX_PROBE_EVERY,
    PROBE_DRAFTS,
    PROBE_EVERY,
    ConstantSchedule,
    CostSchedule,
    HeuristicSchedule,
    StepCosts,
    acceptance_estimates,
    all_accepted_probability,
    best_drafts,
    decayed_acceptance_counts,
    expected_round_seconds,
    expected_tokens,
    new_schedule,
)
from rapidspec.stats import GenerationStats, RoundRecord


def round_record(drafted, accepted, draft_step=0.01, verify=0.1, accept=0.0, forwards=None, pending=1):
    """A round as the engine reports it, with drafter seconds draft_step per forward."""
    forwards = drafted if forwards is None else forwards
    return RoundRecord(drafted, accepted, draft_step * forwards, forwards, verify, accept, pending + drafted)


# ------------------------------------------------------------------ pure math
def test_expected_tokens_by_hand():
    a = [0.8, 0.5, 0.5]
    assert expected_tokens(a, 0) == 1.0
    assert expected_tokens(a, 1) == pytest.approx(1.8)
    assert expected_tokens(a, 2) == pytest.approx(1 + 0.8 + 0.4)
    assert expected_tokens(a, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert expected_tokens([1.0] * 4, 4) == 5.0
    assert all_accepted_probability(a, 0) == 1.0 and all_accepted_probability(a, 3) == pytest.approx(0.2)


def test_expected_round_seconds_by_hand():
    costs = StepCosts(draft_step=0.01, verify_base=0.02, verify_per_token=0.005)
    a = [0.8, 0.5]
    assert costs.verify(3) == pytest.approx(0.035)
    assert expected_round_seconds(2, a, costs, bonus_forward=False) == pytest.approx(2 * 0.01 + 0.02 + 3 * 0.005)
    # eta > 0: the drafter also runs at the bonus position when both drafts are accepted (p = 0.4)
    assert expected_round_seconds(2, a, costs, bonus_forward=True) == pytest.approx(0.055 + 0.4 * 0.01)
    assert expected_round_seconds(0, a, costs, bonus_forward=True) == pytest.approx(0.025)  # a plain step


def test_best_drafts_by_hand():
    flat = StepCosts(draft_step=0.01, verify_base=0.1, verify_per_token=0.0)
    a = [0.9, 0.9, 0.1, 0.1]
    # tokens/s: k=0 10, k=1 1.9/0.11 = 17.3, k=2 2.71/0.12 = 22.6, k=3 2.791/0.13 = 21.5, k=4 2.7991/0.14 = 20.0
    assert best_drafts(a, flat, 0, 4, bonus_forward=False) == 2
    assert best_drafts(a, flat, 0, 1, bonus_forward=False) == 1  # capped by max_gamma
    # drafting dearer than what it saves: k=1 gives 1.9 / 1.1 = 1.7 tokens/s against 10 for a plain step
    dear = StepCosts(draft_step=1.0, verify_base=0.1, verify_per_token=0.0)
    assert best_drafts(a, dear, 0, 4, bonus_forward=False) == 0
    assert best_drafts(a, dear, 0, 4, bonus_forward=True) == 0  # eta > 0 too: a plain step, no drafter forward
    # a steep verify line (CPU-like) against a flat one (GPU-like), same acceptance 0.8
    steep = StepCosts(draft_step=0.045, verify_base=0.067, verify_per_token=0.014)
    # k=0 1/0.081 = 12.35, k=1 1.8/0.14 = 12.86, k=2 2.44/0.199 = 12.26
    assert best_drafts([0.8] * 8, steep, 0, 8, bonus_forward=False) == 1
    # ties go to the smaller k: nothing is ever accepted and drafting is free
    free = StepCosts(draft_step=0.0, verify_base=0.1, verify_per_token=0.0)
    assert best_drafts([0.0] * 4, free, 0, 4, bonus_forward=False) == 0


def test_best_drafts_is_the_argmax_of_expected_tokens_per_second():
    rng = random.Random(5)
    for _ in range(300):
        a = [rng.random() for _ in range(8)]
        costs = StepCosts(rng.uniform(0, 0.05), rng.uniform(0.001, 0.1), rng.uniform(0, 0.02))
        k_min, bonus = rng.choice([(0, False), (1, True)])
        rates = [expected_tokens(a, k) / expected_round_seconds(k, a, costs, bonus) for k in range(k_min, 9)]
        assert best_drafts(a, costs, k_min, 8, bonus) == k_min + rates.index(max(rates))


def test_decayed_acceptance_counts_by_hand():
    # position 1 accepted, 2 rejected, 3 not reached
    assert decayed_acceptance_counts([4, 2, 2], [4, 4, 2], 3, 1, 0.5) == ([3, 1, 1], [3, 3, 1])
    # all three accepted: nothing rejected
    assert decayed_acceptance_counts([0, 0, 0], [0, 0, 0], 3, 3, 0.5) == ([1, 1, 1], [1, 1, 1])
    # first draft rejected: only position 1 observed
    assert decayed_acceptance_counts([0, 0], [0, 0], 2, 0, 0.9) == ([0, 0], [1, 0])
    # more drafts than tracked positions
    assert decayed_acceptance_counts([0], [0], 3, 3, 0.9) == ([1], [1])


def test_acceptance_prior():
    # no observations: every position at the prior mean
    assert acceptance_estimates([0, 0, 0], [0, 0, 0]) == [0.5, 0.5, 0.5]
    # one rejection at position 1: (0.5 + 0) / (1 + 1); unseen positions follow their neighbour
    assert acceptance_estimates([0, 0], [1, 0]) == [0.25, 0.25]
    # three acceptances at 1, one at 2 out of 2: a_1 = 3.5 / 4, a_2 = (0.875 + 1) / 3
    assert acceptance_estimates([3, 1], [3, 2]) == pytest.approx([0.875, 0.625])
    # the prior is weak: ten acceptances in a row outweigh it
    accepted, observed = [0.0], [0.0]
    for _ in range(10):
        accepted, observed = decayed_acceptance_counts(accepted, observed, 1, 1, ACCEPTANCE_DECAY)
    assert acceptance_estimates(accepted, observed)[0] > 0.9


def test_step_costs_are_validated():
    for bad in ((-1.0, 0.1, 0.0), (0.1, 0.0, 0.0), (0.1, 0.1, -0.01), (float("nan"), 0.1, 0.0)):
        with pytest.raises(RapidspecError, match="step costs"):
            StepCosts(*bad)


# ------------------------------------------------------------------ schedules
def test_constant_and_heuristic_schedules():
    constant = ConstantSchedule(5)
    constant.record(round_record(5, 0))
    assert constant.next_drafts() == 5
    heuristic = HeuristicSchedule(2, 7)
    steps = []
    for accepted_all in (True, True, True, True, False, False):
        k = heuristic.next_drafts()
        heuristic.record(round_record(k, k if accepted_all else 0))
        steps.append(heuristic.next_drafts())
    assert steps == [4, 6, 7, 7, 6, 5]
    heuristic.record(round_record(0, 0))  # a round with one token left drafts nothing: no change
    assert heuristic.next_drafts() == 5
    # a round stopped early (draft_confidence) after 2 of 5 drafts, both kept: 5 + 2, as transformers does
    heuristic.record(round_record(2, 2))
    assert heuristic.next_drafts() == 7
    heuristic.record(round_record(2, 1))  # not all kept: 7 - 1, not 2 - 1
    assert heuristic.next_drafts() == 6


COSTS = StepCosts(draft_step=0.01, verify_base=0.1, verify_per_token=0.001)


def test_new_schedule_follows_the_config():
    # auto (the default): cost once resolved, with or without a seed (its choices never follow the clock)
    assert DecodeConfig().gamma_schedule == "auto"
    for config in (DecodeConfig(), DecodeConfig(seed=0)):
        assert isinstance(new_schedule(resolve(config, "self")[0], COSTS), CostSchedule)
    with pytest.raises(ValueError, match="resolve"):
        new_schedule(DecodeConfig(), COSTS)  # auto is the engine's to decide
    assert isinstance(new_schedule(DecodeConfig(gamma_schedule="constant"), COSTS), ConstantSchedule)
    assert isinstance(new_schedule(DecodeConfig(gamma_schedule="heuristic"), COSTS), HeuristicSchedule)
    rapid = new_schedule(DecodeConfig(gamma_schedule="cost", gamma=3, max_gamma=9, eta=1.0), COSTS)
    assert isinstance(rapid, CostSchedule) and (rapid.gamma, rapid.max_gamma, rapid.k_min) == (3, 9, 0)
    assert rapid.costs is COSTS
    assert rapid.bonus_forward and not new_schedule(DecodeConfig(mode="sd", gamma_schedule="cost"), COSTS).bonus_forward


def test_cost_schedule_drafts_gamma_first_then_follows_costs_and_acceptance():
    """The first round drafts gamma; then k = best_drafts(a, the calibrated costs), whatever the rounds' times."""
    schedule = CostSchedule(4, 16, 0.0, COSTS)
    assert schedule.next_drafts() == 4
    schedule.record(round_record(4, 4, draft_step=9.0, verify=9.0))  # measured times are not read
    a = schedule.acceptance()
    assert schedule.next_drafts() == best_drafts(a, COSTS, 0, 16, False) >= 4


def test_cost_schedule_choices_do_not_depend_on_measured_times():
    """Two runs of the same acceptance with very different round times choose the same k every round."""
    runs = []
    for slow in (1.0, 50.0):
        schedule, chosen = CostSchedule(3, 16, 1.0, COSTS), []
        for index in range(40):
            k = schedule.next_drafts()
            chosen.append(k)
            schedule.record(round_record(k, min(k, index % 4), draft_step=0.01 * slow, verify=0.1 * slow))
        runs.append(chosen)
    assert runs[0] == runs[1]


def test_cost_schedule_probes_while_taking_plain_steps():
    """With k = 0 chosen, probes of PROBE_DRAFTS come after 7, then 15, 31 and at most 63 plain rounds."""
    assert (PROBE_EVERY, MAX_PROBE_EVERY, PROBE_DRAFTS) == (8, 64, 2)
    dear = StepCosts(draft_step=1.0, verify_base=0.1, verify_per_token=0.0)
    schedule = CostSchedule(4, 16, 0.0, dear)
    chosen = []
    for _ in range(1 + 8 + 16 + 32 + 64 + 64):
        k = schedule.next_drafts()
        chosen.append(k)
        schedule.record(round_record(k, 0))
    assert chosen == [4] + [0] * 7 + [2] + [0] * 15 + [2] + [0] * 31 + [2] + ([0] * 63 + [2]) * 2


def test_cost_schedule_probe_interval_resets_when_drafting_pays_again():
    """Rejected probes double the wait; a kept probe that makes drafting pay resets it to PROBE_EVERY."""
    cheap = StepCosts(draft_step=0.03, verify_base=0.1, verify_per_token=0.0)  # k = 1 pays iff a_1 > 0.3
    schedule = CostSchedule(4, 16, 0.0, cheap)
    chosen = []
    for index in range(70):
        k = schedule.next_drafts()
        chosen.append(k)
        schedule.record(round_record(k, k if index >= 30 else 0))  # drafts are kept from round 30 on
    assert chosen[:57] == [4] + [0] * 7 + [2] + [0] * 15 + [2] + [0] * 31 + [2]
    assert min(chosen[57:]) >= 1 and schedule.probe_every == PROBE_EVERY


def test_cost_schedule_comes_back_when_acceptance_recovers():
    """Rejections lead to plain steps; accepted probes raise a_1 until drafting pays again."""
    cheap = StepCosts(draft_step=0.03, verify_base=0.1, verify_per_token=0.0)  # k = 1 pays iff a_1 > 0.3
    schedule = CostSchedule(4, 16, 0.0, cheap)
    schedule.record(round_record(schedule.next_drafts(), 0))  # a_1 = 0.25
    chosen = []
    for _ in range(4 * PROBE_EVERY):
        k = schedule.next_drafts()
        chosen.append(k)
        schedule.record(round_record(k, k))  # acceptance is back: every draft is kept
    assert chosen[: PROBE_EVERY] == [0] * (PROBE_EVERY - 1) + [PROBE_DRAFTS]
    assert chosen[-1] >= 4 and 0 not in chosen[PROBE_EVERY:]


@pytest.mark.parametrize("eta", [0.0, 2.0])
def test_cost_schedule_takes_plain_rounds_when_drafting_is_dear_at_any_eta(eta):
    """A plain step (k = 0) wins against dear drafts with eta > 0 as with eta = 0; probes keep coming."""
    dear = StepCosts(draft_step=1.0, verify_base=0.1, verify_per_token=0.0)
    schedule = CostSchedule(3, 16, eta, dear)
    chosen = []
    for _ in range(1 + 8 + 16):
        k = schedule.next_drafts()
        chosen.append(k)
        schedule.record(round_record(k, 0, forwards=k))
    assert chosen == [3] + [0] * 7 + [PROBE_DRAFTS] + [0] * 15 + [PROBE_DRAFTS]


# ---------------------------------------------------------- config, stats, CLI
def test_gamma_schedule_is_validated():
    assert DecodeConfig(gamma_schedule="cost").gamma_schedule == "cost"
    with pytest.raises(RapidspecError, match="gamma_schedule must be one of auto, constant, heuristic, cost, got 'fast'"):
        DecodeConfig(gamma_schedule="fast")


def test_stats_count_plain_rounds_and_mean_drafts():
    stats = GenerationStats()
    assert stats.mean_drafts_per_round is None
    for drafted, accepted in ((4, 2), (0, 0), (0, 0), (2, 2)):
        stats.add_round(round_record(drafted, accepted, verify=0.1, accept=0.01))
    assert (stats.rounds, stats.plain_rounds, stats.drafted_tokens, stats.accepted_tokens) == (4, 2, 6, 4)
    assert stats.mean_drafts_per_round == 1.5 and stats.mean_accepted_length == 2.0
    assert stats.verify_seconds == pytest.approx(0.4) and stats.accept_seconds == pytest.approx(0.04)
    assert stats.draft_seconds == pytest.approx(0.06)
    out = stats.to_dict()
    assert out["plain_rounds"] == 2 and out["mean_drafts_per_round"] == 1.5 and out["gamma_schedule"] == "constant"


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "demo", "bench", "eval"])
def test_every_command_maps_gamma_schedule_cost(command):
    from rapidspec.cli import build_parser
    from rapidspec.cli.options import decode_config

    required = ["--document", "d.txt", "--question", "q"] if command == "generate" else []
    args = build_parser().parse_args([command, *required, "--gamma-schedule", "cost", "--max-gamma", "9"])
    config = decode_config(args, max_new_tokens=8)  # eval's default (None) depends on the task
    assert (config.gamma_schedule, config.max_gamma) == ("cost", 9)


def test_cli_refuses_an_unknown_gamma_schedule(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--document", "d.txt", "--question", "q", "--gamma-schedule", "fast"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--gamma-schedule: invalid choice: 'fast'" in err and "cost" in err
