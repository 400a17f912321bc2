"""A cost book with fixed numbers, for tests of the decisions that read a machine's calibrated step costs."""

from __future__ import annotations

from rapidspec.drafting.calibration import DrafterCosts, TargetCosts


class StaticCosts:
    """What a machine's calibration file would hold (rapidspec.drafting.calibration.CostBook), never measuring."""

    def __init__(self, target=TargetCosts(0.1, 0.001), drafter=DrafterCosts(0.01, 0.0001), embedding=1e-5):
        self.values = {TargetCosts: target, DrafterCosts: drafter, float: embedding}

    def get(self, kind, key, measure, again=False):
        return self.values[kind]

    def entries(self):
        return []
