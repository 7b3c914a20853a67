"""The interface every drafter implements: a per-session token sequence that can be synced and proposes tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class Proposal:
    """Tokens x_1..x_γ a drafter proposes and the distributions q they were drawn from."""

    token_ids: list[int]
    probs: torch.Tensor | None  # [γ, V]; None when q is one-hot (greedy or model-free drafting)
    alternatives: list[list[int]] = field(default_factory=list)  # per position, other likely tokens (if asked)


class DraftSession(Protocol):
    """One request's sequence on a drafter. After `propose`, the drafted tokens are part of the sequence,
    so the next call's `truncate(base_len)` is what rolls back whatever the verifier rejected."""

    def __len__(self) -> int: ...

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens held in this session's KV cache (0 for model-free drafters)."""
        ...

    def truncate(self, length: int) -> None: ...

    def append(self, token_ids: Sequence[int]) -> None: ...

    def fork(self) -> DraftSession:
        """An independent copy of the session (a new lane starting where this one stands)."""
        ...

    def propose(self, num_tokens: int) -> Proposal:
        """Drafts up to num_tokens tokens after the current sequence and appends them to it."""
        ...
