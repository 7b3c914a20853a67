"""Fixtures of the twin's tests: a fresh twin cache for the session (tokenizers and draft calibrations are built,
not found), and the llama8b-h100 pair at the demo BPE's width, loaded in this process."""

from __future__ import annotations

import os

import pytest
from twin_models import load_twin


@pytest.fixture(scope="session")
def twin_cache(tmp_path_factory):
    """XDG_CACHE_HOME pointing at a fresh folder (for this process and the services it starts)."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("twin_cache"))
    yield os.environ["XDG_CACHE_HOME"]
    if before is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(scope="session")
def twin_pair(twin_cache):
    """(target, draft) of llama8b-h100 at 8,192 ids, the draft calibrated to α 0.75."""
    return load_twin("target"), load_twin("draft")
