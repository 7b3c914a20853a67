"""The twin's roofline: each profile's step is what docs/architecture.md works out, and a pass costs more with more
tokens, more cached positions and more rows, as on the device."""

from __future__ import annotations

import pytest

from specdec.engine.simulated.cost_model import CostModel, PassRow
from specdec.engine.simulated.profiles import LLAMA_1B, LLAMA_8B, LLAMA_70B, PROFILES, SMALL_DRAFT

# (profile, role) -> the decode step docs/architecture.md states, in ms
DOCUMENTED_STEPS_MS = {
    ("llama70b-tp4-h100", "target"): 14.9,
    ("llama70b-tp4-h100", "draft"): 3.6,
    ("llama8b-h100", "target"): 5.9,
    ("llama8b-h100", "draft"): 0.98,
}


def test_model_shapes_have_the_published_sizes():
    assert LLAMA_70B.params == pytest.approx(70.55e9, rel=0.01)
    assert LLAMA_8B.params == pytest.approx(8.03e9, rel=0.01)
    assert LLAMA_1B.params == pytest.approx(1.236e9, rel=0.01)
    assert SMALL_DRAFT.params == pytest.approx(0.32e9, rel=0.02)
    assert LLAMA_70B.weight_bytes == pytest.approx(141e9, rel=0.01)


@pytest.mark.parametrize("profile, role", sorted(DOCUMENTED_STEPS_MS))
def test_a_decode_step_costs_what_the_docs_work_out(profile, role):
    step_ms = CostModel(PROFILES[profile].placement(role)).decode_step_s(cached=100) * 1e3
    assert step_ms == pytest.approx(DOCUMENTED_STEPS_MS[(profile, role)], abs=0.05)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_cost_grows_with_tokens_cached_positions_and_rows(profile):
    model = CostModel(PROFILES[profile].target)
    step = model.decode_step_s(cached=100)
    assert model.seconds([PassRow(5, 100, 5)]) > step  # a verify block reads the same weights, computes more
    assert model.seconds([PassRow(2048, 0)]) > 2 * step  # a long prefill is bound by compute
    assert model.decode_step_s(cached=8000) > step  # more keys and values to read
    assert model.decode_step_s(cached=100, rows=64) > model.decode_step_s(cached=100, rows=8) > step
    small, large = model.pass_cost([PassRow(1, 100)]), model.pass_cost([PassRow(4096, 0)])
    assert small.memory_s > small.compute_s and large.compute_s > large.memory_s  # both sides of the roofline


def test_only_tensor_parallel_placements_pay_all_reduces():
    rows = [PassRow(1, 100)]
    assert CostModel(PROFILES["llama70b-tp4-h100"].target).pass_cost(rows).all_reduce_s > 1e-3  # 160 of them
    assert CostModel(PROFILES["llama8b-h100"].target).pass_cost(rows).all_reduce_s == 0


def test_ideal_plain_decoding_is_a_prefill_and_a_step_per_further_token():
    model = CostModel(PROFILES["llama8b-h100"].target)
    prefill = model.seconds([PassRow(64, 0)])
    steps = sum(model.decode_step_s(cached) for cached in range(64, 64 + 15))
    assert model.plain_decoding_s(64, 16) == pytest.approx(prefill + steps)
