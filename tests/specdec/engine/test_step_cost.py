"""Step-cost calibration: the device-synchronised clock it reads, and the line it fits on the tiny target."""

from __future__ import annotations

import torch

from specdec.engine.attention.selection import AttentionBackendChoice
from specdec.engine.cuda_graph_steps import CudaGraphSteps
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.engine.step_cost import CALIBRATION_TOKENS, StepCost, calibrate, synchronized_clock_ns


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


def test_every_calibration_pass_is_served_as_live_decode_steps_are(tiny_pair_dirs):
    """With graphs (here prepared eagerly from their buffers, as on a CPU), every calibration pass of the default
    token counts replays a graph, as live decode and verify steps do: the fitted line mixes no eager passes (a row of
    64 tokens, as calibration fed before, would run eagerly)."""
    model = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0]), attention_backend=AttentionBackendChoice.FLEX))
    steps = CudaGraphSteps(model.model, model.kv_pool, model.attention_backend, 64, model.max_context_tokens)
    steps.capture(cuda_graphs=False)
    model.graph_steps = steps
    calibrate(model, repeats=2)
    calibrate(model, one_token_rows=True, repeats=2)
    assert steps.replays == 2 * 2 * len(CALIBRATION_TOKENS)
