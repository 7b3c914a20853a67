"""A request's draft lanes as the coordinator tracks them: what sequence each lane's cache holds, and the base_len and
appended tokens that bring it to another (the sync invariant, per lane)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class DraftLane:
    """One lane of the request's draft session and the sequence its cache holds."""

    index: int
    held: list[int]  # what the lane was last synced to, then the tokens it drafted
    committed_len: int  # a prefix of `held` that is committed, so it never needs comparing again

    def sync_to(self, sequence: Sequence[int]) -> tuple[int, list[int]]:
        """(base_len, appended tokens) that bring the lane to `sequence`."""
        base = self.committed_len
        limit = min(len(self.held), len(sequence))
        while base < limit and self.held[base] == sequence[base]:
            base += 1
        return base, list(sequence[base:])

    def synced(self, sequence: Sequence[int], drafted: Sequence[int], committed_len: int) -> None:
        """Records a Propose that synced the lane to `sequence` and drafted `drafted` after it."""
        self.held = [*sequence, *drafted]
        self.committed_len = committed_len
