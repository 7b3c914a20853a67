"""A CPU model's LM head through oneDNN, with its weight reordered once at load time.

The LM head is a causal LM's widest matmul: [rows, hidden] x [hidden, vocab]. On CPU, torch's default fp32
GEMM (MKL) runs it well below the core's rate for the row counts serving produces: a draft step over a batch of
sessions, a verify block of γ+1 positions per session. oneDNN with a prepacked weight computes the same products
faster (demo target's 256 -> 8192 head, 1 thread: 5 rows 2.8 -> 0.75 ms, 16 rows 4.1 -> 2.3 ms, 80 rows 10.2 ->
6.5 ms). The summation order differs, so logits can differ from the default kernel's in the last bits (as they
do between row counts with either kernel). Other layers keep the default kernel: at their sizes oneDNN's
per-call overhead cancels its gain.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN linear ops used here."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class OneDnnLinear(nn.Linear):
    """An fp32 nn.Linear on CPU computed by oneDNN from a reordered copy of its weight, taken when it was
    converted (serving weights do not change). Parameters and state_dict stay those of the nn.Linear."""

    packed_weight: torch.Tensor  # oneDNN's layout of weight [out_features, in_features]

    @classmethod
    def convert(cls, linear: nn.Linear) -> OneDnnLinear:
        """Turns `linear` itself into a OneDnnLinear (its weight may be tied to other modules)."""
        linear.__class__ = cls
        linear.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        return linear

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., in_features] -> [..., out_features], as nn.Linear computes it."""
        return torch.ops.mkldnn._linear_pointwise(hidden, self.packed_weight, self.bias, "none", [], "")


def use_onednn_lm_head(model: nn.Module) -> bool:
    """Runs a CPU float32 model's LM head (its output embeddings) on oneDNN; returns whether it does."""
    head = model.get_output_embeddings()
    if (
        not onednn_available()
        or type(head) is not nn.Linear
        or head.weight.device.type != "cpu"
        or head.weight.dtype != torch.float32
    ):
        return False
    OneDnnLinear.convert(head)
    log.info("LM head (%d -> %d) runs on oneDNN", head.in_features, head.out_features)
    return True
