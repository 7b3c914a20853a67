"""Shared fixtures: tiny model pairs built once per test session."""

from __future__ import annotations

import pytest
import torch

from specdec.model_runtime import LoadedModel, ModelSettings
from tiny_models import make_pair

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory):
    """(target_dir, draft_dir): vocabulary 64, a draft that is a noisy copy of the target, EOS made likely."""
    return make_pair(tmp_path_factory.mktemp("tiny_pair"), vocab_size=64, noise=0.1, eos_boost=1.6)


@pytest.fixture(scope="session")
def tiny_pair(tiny_pair_dirs):
    """(target, draft) loaded with the project's runtime."""
    target_dir, draft_dir = tiny_pair_dirs
    return LoadedModel.load(ModelSettings(str(target_dir))), LoadedModel.load(ModelSettings(str(draft_dir)))
