"""The `overlay` fixture: every overlay of k8s/, and the GPU ones with the monitoring component added."""

from __future__ import annotations

import pytest
from rendered import VARIANTS


@pytest.fixture(params=VARIANTS)
def overlay(request) -> str:
    return request.param
