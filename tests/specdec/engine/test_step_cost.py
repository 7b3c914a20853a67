"""Step-cost calibration: the device-synchronised clock it reads, and the line it fits on the tiny target."""

from __future__ import annotations

import torch

from specdec.engine.step_cost import StepCost, calibrate, synchronized_clock_ns


def test_synchronized_clock_reads_forward_on_cpu():
    device = torch.device("cpu")
    first = synchronized_clock_ns(device)
    torch.ones(8).sum()
    assert synchronized_clock_ns(device) >= first > 0


def test_calibrate_fits_a_non_negative_line_from_real_passes(tiny_pair):
    target, _ = tiny_pair
    cost = calibrate(target, token_counts=(1, 4), repeats=1)
    assert cost.fixed_ns >= 0 and cost.per_token_ns >= 0
    assert cost.predict_ns(4) >= cost.predict_ns(1) > 0


def test_step_cost_refits_on_observed_passes():
    cost = StepCost(fixed_ns=1000.0, per_token_ns=10.0)
    for tokens in (1, 64):
        cost.observe(tokens, 2000.0 + 20.0 * tokens)
    assert cost.per_token_ns > 10.0 and cost.fixed_ns > 1000.0
