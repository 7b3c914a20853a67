"""The twin's part of a model service's settings (a base of each one's settings class); read only when `--device`
names a twin device (`sim:PROFILE[:VOCAB]`)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.common.settings import setting


@dataclass(frozen=True)
class TwinSettings:
    """How the twin's synthetic pair is drawn: both services of a stack need the same seed."""

    sim_acceptance: float = setting(
        0.75,
        "twin draft (--device sim:...): the greedy acceptance rate its noise is calibrated to, the per-token "
        "probability that its argmax is the target's",
    )
    sim_seed: int = setting(0, "twin devices: the seed of the synthetic pair's tables (the same on draft and verify)")
