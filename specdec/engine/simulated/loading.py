"""Building a twin model from a service's settings: the profile's placement for its role, the synthetic pair, and
for a draft the noise scale calibrated to the requested acceptance (cached per machine)."""

from __future__ import annotations

import torch

from specdec.engine.model_runtime import ModelSettings
from specdec.engine.simulated.acceptance import CALIBRATION_VERSION, calibrated_noise_scale
from specdec.engine.simulated.profiles import ROLES, parse_twin_device
from specdec.engine.simulated.simulated_model import SimulatedModel
from specdec.engine.simulated.synthetic_pair import PAIR_VERSION, SyntheticPair
from specdec.engine.simulated.tokenizer import load_twin_tokenizer
from specdec.engine.simulated.twin_cache import cached_value


def load_simulated(settings: ModelSettings, role: str, acceptance: float, seed: int) -> SimulatedModel:
    """The twin's `role` ("target" or "draft") on the device `settings.device` names; `settings.model` must name
    the same role (ValueError naming the field otherwise)."""
    twin = parse_twin_device(settings.device)
    if role not in ROLES or settings.model != role:
        raise ValueError(
            f"model: with --device {settings.device} this service holds the profile's {role}: "
            f"pass --model {role}, got {settings.model!r}"
        )
    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    tokenizer = load_twin_tokenizer(twin.served_vocab)
    pair = SyntheticPair(twin.served_vocab, seed, masked_ids=[tokenizer.eos_token_id])
    noise_scale = None
    if role == "draft":
        noise_scale = cached_value(
            f"noise-scale-v{PAIR_VERSION}.{CALIBRATION_VERSION}-{twin.served_vocab}-seed{seed}-acceptance{acceptance:g}",
            lambda: calibrated_noise_scale(pair, acceptance),
        )
    return SimulatedModel(settings, twin, role, tokenizer, pair, noise_scale)
