"""A CPU model's linear layers through oneDNN, each weight reordered once at load time.

For the row counts serving produces (a plain step of one position, a draft step over a batch of sessions, a verify
block of γ+1 positions), torch's default fp32 kernels (MKL) run small products below the core's rate, and oneDNN
with a prepacked weight computes the same products faster: the demo target's 256 -> 8192 head, 1 thread, 5 rows
2.8 -> 0.75 ms; its 24 decoder layers' 168 linears, weights streamed from memory, 5 rows 13.5 -> 7.8 ms. At one row
too, where a whole pass streams its weights from memory: a one-position pass of the demo target 9.8 -> 8.2 ms, of
SmolLM2-135M 34.6 -> 25.4 ms (docs/results.md, "Attention kernels and other per-pass costs"). So every linear runs
on oneDNN at every row count. The summation order differs, so logits can differ from the default kernel's in the
last bits (as they do between row counts with either kernel). Each converted layer holds its weight twice: the
parameter, and oneDNN's layout of it.
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

    def revert(self) -> None:
        """Turns this layer back into an nn.Linear, dropping oneDNN's copy of its weight."""
        del self.packed_weight
        self.__class__ = nn.Linear


def use_onednn_linears(model: nn.Module) -> int:
    """Runs a CPU float32 model's nn.Linear layers, its LM head (output embeddings) among them, on oneDNN; returns
    how many layers it converted (0: a head on another device or dtype, or no oneDNN)."""
    head = model.get_output_embeddings()
    if (
        not onednn_available()
        or type(head) is not nn.Linear
        or head.weight.device.type != "cpu"
        or head.weight.dtype != torch.float32
    ):
        return 0
    linears = [layer for layer in model.modules() if type(layer) is nn.Linear and layer.weight.dtype == torch.float32]
    for linear in linears:
        OneDnnLinear.convert(linear)
    log.info(
        "%d linears on oneDNN, the LM head (%d -> %d) among them", len(linears), head.in_features, head.out_features
    )
    return len(linears)


def drop_onednn_copies(model: nn.Module) -> None:
    """Turns a model's OneDnnLinear layers back into nn.Linear, dropping oneDNN's copies of their weights (which
    cannot follow the parameters, e.g. to the meta device)."""
    for module in model.modules():
        if isinstance(module, OneDnnLinear):
            module.revert()
