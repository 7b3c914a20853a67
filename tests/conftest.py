"""Shared fixtures: tiny model pairs built once per test session."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_pair

from specdec.engine.attention.ragged_attention import load_kernel
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.sampling.coupled_noise import load_noise_kernel

torch.set_num_threads(1)


def pytest_sessionstart(session):
    """Builds the compiled attention and noise kernels once (or finds them cached) before any test starts servers,
    whose processes then load them instead of each waiting for one build within its start-up time."""
    load_kernel()
    load_noise_kernel()


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory):
    """(target_dir, draft_dir): vocabulary 64, a draft that is a noisy copy of the target, EOS made likely."""
    return make_pair(tmp_path_factory.mktemp("tiny_pair"), vocab_size=64, noise=0.1, eos_boost=1.6)


@pytest.fixture(scope="session")
def long_pair_dirs(tmp_path_factory):
    """(target_dir, draft_dir) of a tiny pair whose EOS logit is zeroed: completions run their whole budget."""
    return make_pair(tmp_path_factory.mktemp("long_pair"), vocab_size=64, noise=0.1, eos_boost=0.0)


@pytest.fixture(scope="session")
def tiny_pair(tiny_pair_dirs):
    """(target, draft) loaded with the project's runtime."""
    target_dir, draft_dir = tiny_pair_dirs
    return LoadedModel.load(ModelSettings(str(target_dir))), LoadedModel.load(ModelSettings(str(draft_dir)))
