"""An LM head whose products come out in float32 for a model with 16-bit weights on CUDA (`--float32-logits`,
docs/architecture.md "Exactness in 16-bit weights").

A bfloat16 head accumulates each logit in float32 and then rounds it to 8 bits of mantissa: logits within ~0.4 %
of each other become equal or swap, and the argmax between them then follows the rounding. Here the same product
(cuBLAS, 16-bit inputs, float32 accumulation) is written out in float32: no extra weight copy, about the same cost.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


class Float32LogitsHead(nn.Linear):
    """An nn.Linear with 16-bit weights whose output is float32. Parameters and state_dict stay the nn.Linear's."""

    @classmethod
    def convert(cls, linear: nn.Linear) -> Float32LogitsHead:
        """Turns `linear` itself into a Float32LogitsHead (its weight may be tied to the embeddings)."""
        linear.__class__ = cls
        return linear

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., in_features] -> float32 [..., out_features]."""
        flat = hidden.reshape(-1, self.in_features)  # [N, E]
        if flat.is_cuda:
            logits = torch.mm(flat, self.weight.t(), out_dtype=torch.float32)  # [N, V]
        else:  # no 16-bit product with a float32 output here: the inputs widened (exact), then multiplied
            logits = F.linear(flat.float(), self.weight.float())
        if self.bias is not None:
            logits = logits + self.bias.float()
        return logits.view(*hidden.shape[:-1], self.out_features)

    def revert(self) -> None:
        """Turns this layer back into an nn.Linear."""
        self.__class__ = nn.Linear


def float32_head_refusal(model: nn.Module) -> str | None:
    """Why `model`'s LM head keeps its own output dtype, or None: it can write float32 logits."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head._forward_hooks or head._forward_pre_hooks:
        return f"the LM head is a {type(head).__name__} of its own (or hooked, e.g. sharded)"
    if head.weight.dtype not in SIXTEEN_BIT:
        return f"its weights are {head.weight.dtype}, already as wide as float32 logits need"
    if head.weight.device.type != "cuda":
        return f"16-bit products with float32 outputs run on CUDA, not {head.weight.device.type}"
    if type(head.weight.data) is not torch.Tensor:
        return "its weight is sharded"
    try:
        probe = torch.ones((1, 8), dtype=head.weight.dtype, device=head.weight.device)
        torch.mm(probe, probe.t(), out_dtype=torch.float32)
    except (RuntimeError, TypeError) as error:
        return f"this torch has no 16-bit product with a float32 output ({type(error).__name__})"
    return None


def use_float32_head(model: nn.Module) -> bool:
    """Makes the LM head of a 16-bit CUDA model write float32 logits; logs the outcome. Returns whether it did."""
    refusal = float32_head_refusal(model)
    if refusal is not None:
        log.info("LM head keeps its output dtype: %s", refusal)
        return False
    Float32LogitsHead.convert(model.get_output_embeddings())
    log.info("LM head writes float32 logits (--float32-logits)")
    return True
