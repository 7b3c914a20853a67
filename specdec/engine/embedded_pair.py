"""Where the embedded demo pair lives: the stack's default models (trained by `python -m demo_pair.train`)."""

from __future__ import annotations

import pathlib

MODELS_DIR = pathlib.Path(__file__).resolve().parents[2] / "models"
DEMO_TARGET_DIR = MODELS_DIR / "demo-target"
DEMO_DRAFT_DIR = MODELS_DIR / "demo-draft"
