"""The accelerator twin's models for tests: the llama8b-h100 pair at the demo BPE's width, loaded in-process as the
replicas build them (specdec/engine/simulated/loading.py)."""

from __future__ import annotations

from specdec.engine.model_runtime import ModelSettings
from specdec.engine.simulated.loading import load_simulated
from specdec.engine.simulated.simulated_model import SimulatedModel

TWIN = "sim:llama8b-h100:8192"


def load_twin(role: str, device: str = TWIN, acceptance: float = 0.75, seed: int = 0, **settings) -> SimulatedModel:
    """The twin's `role` ("target" or "draft") on `device`, the draft calibrated to `acceptance`."""
    return load_simulated(ModelSettings(role, device=device, threads=1, **settings), role, acceptance, seed)
