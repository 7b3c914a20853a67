"""A draft's LM head over a subset of the vocabulary: logits for the ids it keeps, -inf for the rest.

With a large vocabulary (SmolLM2's 49,152 ids) the output head is most of a small draft's pass: a 256-wide draft
reads 50 MB of head weights per step in float32. A draft whose model directory holds `head_token_ids.json` (the
ids its training kept, e.g. those the target writes most) gets this head at load time: one product over those
rows only, scattered into a full-width row of -inf (FR-Spec's frequency-ranked head). The draft's q is then 0
outside the subset, which every rule handles exactly (the rejection rule recovers such tokens from p - q), and the
verifier and drafter keep one width: the tokenizer's (docs/architecture.md, "Models served, and the start-up
self-test"). The directory's weights stay an ordinary full-vocabulary model for any other loader.
"""

from __future__ import annotations

import json
import logging
import pathlib

import torch
from torch import nn

from specdec.engine.cpu_linears import OneDnnLinear
from specdec.engine.draft_kernels import Bf16Linear

log = logging.getLogger(__name__)

HEAD_IDS_FILE = "head_token_ids.json"


class SubsetHead(nn.Module):
    """Logits [..., vocab] of which only `kept_ids` are computed (by `kept`, an nn.Linear over their rows); the
    others are -inf."""

    def __init__(self, kept: nn.Linear, kept_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.kept = kept
        self.register_buffer("kept_ids", kept_ids, persistent=False)  # [K] long
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> float logits [..., V], -inf outside the kept ids."""
        kept_logits = self.kept(hidden)  # [..., K]
        logits = kept_logits.new_full((*kept_logits.shape[:-1], self.vocab_size), -torch.inf)  # [..., V]
        return logits.index_copy_(-1, self.kept_ids, kept_logits)


def read_head_ids(model_dir: str) -> list[int] | None:
    """The ids a draft directory's head keeps, or None when it has no `head_token_ids.json` (a full head)."""
    path = pathlib.Path(model_dir) / HEAD_IDS_FILE
    return json.loads(path.read_text())["token_ids"] if path.is_file() else None


def write_head_ids(model_dir: pathlib.Path, token_ids: list[int], how_chosen: str) -> None:
    (model_dir / HEAD_IDS_FILE).write_text(json.dumps({"chosen": how_chosen, "token_ids": token_ids}) + "\n")


def use_subset_head(model: nn.Module, token_ids: list[int]) -> SubsetHead:
    """Replaces `model`'s LM head by a SubsetHead over `token_ids`: its rows copied into an nn.Linear that runs on
    the kernel the old head ran on (oneDNN float32 or bfloat16). The input embeddings are left alone."""
    head = model.get_output_embeddings()
    vocab_size = head.out_features
    if not token_ids or min(token_ids) < 0 or max(token_ids) >= vocab_size or len(set(token_ids)) != len(token_ids):
        raise ValueError(f"{HEAD_IDS_FILE}: ids must be distinct and in [0, {vocab_size})")
    kept_ids = torch.tensor(token_ids, dtype=torch.long, device=head.weight.device)
    kept = nn.Linear(head.in_features, len(token_ids), bias=head.bias is not None, device=head.weight.device)
    kept = kept.to(head.weight.dtype).requires_grad_(False)
    kept.weight.copy_(head.weight.detach()[kept_ids])
    if head.bias is not None:
        kept.bias.copy_(head.bias.detach()[kept_ids])
    if isinstance(head, Bf16Linear):
        Bf16Linear.convert(kept)
    elif isinstance(head, OneDnnLinear):
        OneDnnLinear.convert(kept)
    subset = SubsetHead(kept, kept_ids, vocab_size)
    model.set_output_embeddings(subset)
    log.info("LM head over %d of %d ids (%s)", len(token_ids), vocab_size, type(kept).__name__)
    return subset
