"""Prompt lookup: what followed the most recent earlier copy of a sequence's last few tokens.

The draft service extends a greedy block with such tokens and keeps them only as far as the draft's own greedy
choice agrees (docs/architecture.md, "Lookup tokens").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

LONGEST_SUFFIX = 4  # the longest suffix looked up; shorter ones are tried when it has no earlier copy


def lookup_continuation(token_ids: Sequence[int], limit: int, longest: int = LONGEST_SUFFIX) -> list[int]:
    """Up to `limit` tokens that followed the most recent earlier copy of the longest suffix (of at most
    `longest` tokens) that occurs earlier; [] when none does."""
    if limit <= 0 or len(token_ids) < 2:
        return []
    sequence = np.asarray(token_ids)  # [L]
    for size in range(min(longest, len(sequence) - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(sequence[:-1], size)  # [L - size, size]
        starts = np.flatnonzero((windows == sequence[-size:]).all(axis=1))
        if len(starts):
            after = int(starts[-1]) + size
            return sequence[after : after + limit].tolist()
    return []
