"""Pre-drafting under guessed verdicts (overlapped mode).

While the verifier judges block k, the drafter already drafts block k+1 for several guesses of the verdict,
one draft lane per guess (draft_service/lanes.py), all in one batched ProposeLanes call. A guess says how many
of block k's tokens are accepted and which token follows:

- "all accepted": the bonus token is the drafter's own next token, so that lane drafts it first, then block k+1;
- "rejected at position i, the verifier's token is t": t is one of the draft's next most likely tokens at i
  after the one it drafted (returned with the block), and the lane drafts block k+1 after block[:i] + [t].

The verdict selects at most one guess; its lane's block goes straight to the verifier. Every lane knows the
sequence its cache holds, so the next call on it sends base_len = where that sequence and the one it must hold
part, and the drafter rolls the rest back (the sync invariant).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Guess:
    """A guessed verdict: `accepted` drafted tokens kept, then `next_token` (None: all kept and the bonus
    token is whatever the drafter drafts first)."""

    accepted: int
    next_token: int | None

    def sequence(self, committed: Sequence[int], block: Sequence[int]) -> list[int]:
        """The sequence the lane must hold to draft the next block under this guess."""
        guessed = [] if self.next_token is None else [self.next_token]
        return [*committed, *block[:self.accepted], *guessed]

    def matches(self, accepted: int, next_token: int, drafted: Sequence[int]) -> bool:
        """Whether a verdict (accepted count, next token) is this guess; `drafted` is what the lane drafted."""
        if self.next_token is None:
            return bool(drafted) and drafted[0] == next_token and accepted == self.accepted
        return accepted == self.accepted and next_token == self.next_token


def guesses(block: Sequence[int], alternatives: Sequence[Sequence[int]], per_position: int) -> list[Guess]:
    """"All accepted" first, then rejections: the draft's most likely other token at every position, then its
    second most likely at every position, and so on (per_position ranks); most useful first."""
    ranked = [Guess(len(block), None)]
    for rank in range(per_position):
        ranked.extend(Guess(position, others[rank]) for position, others in enumerate(alternatives[:len(block)])
                      if rank < len(others))
    return ranked


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
