"""Calibrating the synthetic draft: the noise scale at which its greedy choice agrees with the target's at a
requested rate.

Greedy α here is the per-token acceptance probability, P(argmax draft = argmax target) at a position both models
see the same context: the α of E = (1 - α^(γ+1)) / (1 - α), and what the coordinator's policy estimates as
accepted over judged tokens. Positions' keys are hashes, so agreement at one position is independent of the next.

At a position with target logits T (argmax t) and noise row N, the draft's logits T + sN keep t as their argmax
until the scale s reaches the position's *departure scale*, min over ids j with N_j > N_t of (T_t - T_j) / (N_j -
N_t); past it some j stays ahead of t for good. So the agreement at scale s is the share of positions whose
departure scale exceeds s, and the scale for a rate α is the (1 - α) quantile of departure scales over a fixed
sample of keys: one pass over the sample, no search.
"""

from __future__ import annotations

import math

import torch

from specdec.engine.simulated.synthetic_pair import SyntheticPair

SAMPLE_VALUES = 2**26  # logits looked at in all (samples x V): 8,192 positions at V 8,192
CALIBRATION_VERSION = 1  # bump when a calibration gives another scale (cached ones name it)
MIN_SAMPLES = 2048
_CHUNK = 256  # positions per tensor, bounding the memory the calibration takes


def sample_keys(pair: SyntheticPair) -> list[int]:
    """A fixed sample of position keys (independent of the positions served)."""
    count = max(MIN_SAMPLES, SAMPLE_VALUES // pair.vocab)
    generator = torch.Generator().manual_seed(pair.seed + 1)
    return torch.randint(0, 2**62, (count,), generator=generator).tolist()


def departure_scales(pair: SyntheticPair, keys: list[int]) -> torch.Tensor:
    """Per key the noise scale past which the draft's argmax is no longer the target's [len(keys)]."""
    scales = []
    for start in range(0, len(keys), _CHUNK):
        chunk = keys[start : start + _CHUNK]
        target = pair.target_logits(chunk)  # [C, V], masked ids at -inf
        noise = pair.noise(chunk)  # [C, V]
        best = target.argmax(dim=-1, keepdim=True)  # [C, 1]
        gap = target.gather(1, best) - target  # [C, V], >= 0 (inf at masked ids)
        rise = noise - noise.gather(1, best)  # [C, V]: how much faster id j gains than the argmax
        crossing = torch.where(rise > 0, gap / rise, math.inf)  # [C, V]
        scales.append(crossing.min(dim=-1).values)  # [C]
    return torch.cat(scales)


def calibrated_noise_scale(pair: SyntheticPair, acceptance: float) -> float:
    """The noise scale at which greedy agreement is `acceptance` (in (0, 1]) on the fixed sample of keys."""
    if not 0.0 < acceptance <= 1.0:
        raise ValueError(f"sim_acceptance must lie in (0, 1], got {acceptance}")
    if acceptance == 1.0:
        return 0.0
    scales = departure_scales(pair, sample_keys(pair)).double()
    return float(torch.quantile(scales, 1.0 - acceptance))
