"""What one model pass costs: time ≈ fixed + per_token × tokens fed, measured, never assumed.

A service calibrates its model at start-up (a few packed passes of different sizes) and publishes the fit
in its ServiceInfo; the coordinator then refines the fit from the timings every reply carries (forward_ns
and batch_tokens of the pass that served it). Speculation policy reads costs from here
(coordinator/speculation_policy.py).
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

from specdec.engine.model_runtime import LoadedModel

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = (1, 4, 16, 64)  # tokens per calibration pass
CALIBRATION_ROW_TOKENS = 5  # most tokens a calibration row feeds: a γ 4 verify block, as live decode passes feed


class StepCost:
    """A least-squares line of pass time (ns) against tokens fed, over the calibration points and recent passes.

    The fit is kept as running sums (count, Σx, Σy, Σx², Σxy) that each pass adds to and the pass leaving the
    window subtracts from, so a coordinator refits on every reply at no cost that grows with the window.
    """

    def __init__(self, fixed_ns: float, per_token_ns: float, window: int = 256):
        # The calibration line, as two anchor points that stay in every fit (they keep the slope defined when
        # live passes all have the same size); live observations come and go with the window.
        self._live: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        self._sums = [0.0] * 5  # count, Σx, Σy, Σx², Σxy over the anchors and the live passes
        for tokens in (1.0, 64.0):
            self._add(tokens, fixed_ns + tokens * per_token_ns, 1.0)
        self.fixed_ns = float(fixed_ns)
        self.per_token_ns = float(per_token_ns)

    def _add(self, tokens: float, ns: float, sign: float) -> None:
        for index, term in enumerate((1.0, tokens, ns, tokens * tokens, tokens * ns)):
            self._sums[index] += sign * term

    def observe(self, tokens: int, ns: float) -> None:
        """Adds one measured pass and refits."""
        if tokens <= 0 or ns <= 0:
            return
        if len(self._live) == self._live.maxlen:
            self._add(*self._live[0], -1.0)
        self._live.append((float(tokens), float(ns)))
        self._add(float(tokens), float(ns), 1.0)
        count, sum_x, sum_y, sum_xx, sum_xy = self._sums
        spread = count * sum_xx - sum_x * sum_x
        if spread <= 0:
            return
        per_token = (count * sum_xy - sum_x * sum_y) / spread
        self.per_token_ns = max(per_token, 0.0)
        self.fixed_ns = max((sum_y - per_token * sum_x) / count, 0.0)

    def predict_ns(self, tokens: float) -> float:
        """Expected time of a pass feeding `tokens` tokens."""
        return self.fixed_ns + self.per_token_ns * tokens


def synchronized_clock_ns(device: torch.device) -> int:
    """perf_counter_ns once `device` has finished the work queued on it: CUDA runs kernels asynchronously, so a
    clock read without a synchronize times the launches, not the pass."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter_ns()


def calibrate(
    model: LoadedModel, one_token_rows: bool = False, token_counts: Sequence[int] = CALIBRATION_TOKENS, repeats: int = 3
) -> StepCost:
    """Times passes of each token count on fresh caches (median of `repeats`) and fits the line.

    The tokens of a pass are rows of verify blocks (at most CALIBRATION_ROW_TOKENS each) or, with one_token_rows,
    rows of one token each (a batched draft position): decode passes as live steps feed them, so every point is
    served the way those are (from CUDA graphs where the model has them), never some eagerly and some not. The
    clock is read after the device has synchronised. Passes whose caches the KV budget cannot hold are left out.
    """
    token_counts = _fitting_budget(model, token_counts, one_token_rows)
    medians = []
    for count in token_counts:
        shape = _row_tokens(count, one_token_rows)
        times = []
        for _ in range(repeats):
            rows = [([1] * tokens, model.new_cache(), 1) for tokens in shape]
            started = synchronized_clock_ns(model.device)
            model.forward_rows(rows)
            times.append(synchronized_clock_ns(model.device) - started)
        medians.append(statistics.median(times))
    if len(token_counts) > 1:
        per_token, fixed = np.polyfit(np.array(token_counts, dtype=float), np.array(medians, dtype=float), 1)
    else:  # a budget of a block or two: one point, all of it fixed cost
        per_token, fixed = 0.0, medians[0]
    cost = StepCost(max(float(fixed), 0.0), max(float(per_token), 0.0))
    log.info(
        "pass cost of %s: %.2f ms + %.3f ms per %s",
        model.settings.model,
        cost.fixed_ns / 1e6,
        cost.per_token_ns / 1e6,
        "session" if one_token_rows else "token",
    )
    return cost


def _fitting_budget(model: LoadedModel, token_counts: Sequence[int], one_token_rows: bool) -> list[int]:
    """The token counts whose calibration pass the model's free KV blocks hold (a row per token with
    one_token_rows, else one row); at least the smallest."""
    if not model.packed:
        return list(token_counts)
    pool = model.kv_pool
    fitting = [c for c in token_counts if sum(map(pool.blocks_for, _row_tokens(c, one_token_rows))) <= pool.blocks.free]
    return fitting or [min(token_counts)]


def _row_tokens(count: int, one_token_rows: bool) -> list[int]:
    """Tokens per row of a calibration pass of `count` tokens."""
    width = 1 if one_token_rows else CALIBRATION_ROW_TOKENS
    return [width] * (count // width) + ([count % width] if count % width else [])
