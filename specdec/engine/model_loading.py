"""Loading a service's model: the one place a model backend is chosen, by the settings' device (a twin device
`sim:PROFILE[:VOCAB]`, specdec/engine/simulated/, or a real one)."""

from __future__ import annotations

from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.engine.simulated.loading import load_simulated
from specdec.engine.simulated.profiles import is_simulated
from specdec.engine.simulated.simulated_model import SimulatedModel


def load_model(service_settings: object, role: str) -> LoadedModel | SimulatedModel:
    """The model a service's settings name; `role` ("target" or "draft") is what the service holds, which a twin
    device needs to know. ValueError naming the field for settings a twin cannot take."""
    settings = ModelSettings.of(service_settings)
    if not is_simulated(settings.device):
        return LoadedModel.load(settings)
    if getattr(service_settings, "model_process", False):
        raise ValueError("model_process: a twin's passes already wait without holding the interpreter; leave it off")
    return load_simulated(settings, role, service_settings.sim_acceptance, service_settings.sim_seed)
