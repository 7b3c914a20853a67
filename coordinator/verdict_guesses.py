"""Guessed verdicts of the block being verified (overlapped mode), and which of them get draft lanes.

While the verifier judges block k, the drafter already drafts block k+1 for several guesses of the verdict,
one draft lane per guess (draft_service/lanes.py), all in one batched ProposeLanes call. A guess says how many
of block k's tokens are accepted and which token follows:

- "all accepted": the bonus token is the drafter's own next token, so that lane drafts it first, then block k+1;
- "rejected at position i, the verifier's token is t": t is one of the draft's next most likely tokens at i
  after the one it drafted (returned with the block), and the lane drafts block k+1 after block[:i] + [t].

The verdict selects at most one guess; its lane's block goes straight to the verifier. Every lane knows the
sequence its cache holds, so the next call on it sends base_len = where that sequence and the one it must hold
part, and the drafter rolls the rest back (the sync invariant).

There are more possible guesses than lanes. Which ones get lanes follows the request's own verdicts so far
(VerdictHistory): a text repeats its patterns, so the draft tends to stumble in the same way at the same kinds
of places, and the verifier's token keeps landing on the same position and rank.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

from coordinator.draft_lanes import DraftLane

ALL_ACCEPTED = (-1, 0)  # VerdictHistory's key for "all accepted", whatever the block's length


@dataclass(frozen=True)
class Guess:
    """A guessed verdict: `accepted` drafted tokens kept, then `next_token` (None: all kept and the bonus
    token is whatever the drafter drafts first)."""

    accepted: int
    next_token: int | None
    rank: int = field(default=0, compare=False)  # next_token's rank among the draft's alternatives (0: all accepted)

    def sequence(self, committed: Sequence[int], block: Sequence[int]) -> list[int]:
        """The sequence the lane must hold to draft the next block under this guess."""
        guessed = [] if self.next_token is None else [self.next_token]
        return [*committed, *block[: self.accepted], *guessed]

    def verdict(self, drafted: Sequence[int]) -> tuple[int, int] | None:
        """The verdict (accepted count, next token) this guess stands for, given what its lane drafted: "all
        accepted" names the lane's first token; None when that lane drafted nothing."""
        if self.next_token is None:
            return (self.accepted, drafted[0]) if drafted else None
        return self.accepted, self.next_token


def guesses(block: Sequence[int], alternatives: Sequence[Sequence[int]], per_position: int) -> list[Guess]:
    """ "All accepted" first, then rejections: the draft's most likely other token at every position, then its
    second most likely at every position, and so on (per_position ranks); most useful first."""
    ranked = [Guess(len(block), None)]
    for rank in range(per_position):
        ranked.extend(
            Guess(position, others[rank], rank + 1)
            for position, others in enumerate(alternatives[: len(block)])
            if rank < len(others)
        )
    return ranked


class VerdictHistory:
    """How often a request's verdicts fell on each guessable outcome, to give lanes to the likeliest guesses.

    A rejection is keyed by (tokens accepted, rank of the verifier's token among the draft's alternatives at the
    rejected position); "all accepted" by one key for blocks of every length, since their lengths vary (lookup
    tokens, a constraint's forced text) while whether a block is accepted whole is the request's habit; a verdict
    whose token the draft did not rank counts nowhere.
    """

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[int, int]] = collections.Counter()

    def observe(self, drafted: int, alternatives: Sequence[Sequence[int]], accepted: int, next_token: int) -> None:
        """Records one verdict on a block of `drafted` tokens with the draft's `alternatives` per position."""
        if accepted == drafted:
            self.counts[ALL_ACCEPTED] += 1
        elif accepted < len(alternatives) and next_token in alternatives[accepted]:
            self.counts[accepted, list(alternatives[accepted]).index(next_token) + 1] += 1

    def rank(self, candidates: Sequence[Guess]) -> list[Guess]:
        """The candidates, most often matched first; equals (at first, all) keep their order from `guesses`."""
        return sorted(candidates, key=lambda guess: -self.counts[_key(guess)])


def _key(guess: Guess) -> tuple[int, int]:
    """The outcome a guess stands for, as VerdictHistory counts it."""
    return ALL_ACCEPTED if guess.next_token is None else (guess.accepted, guess.rank)


def assign_lanes(ranked: Sequence[Guess], lanes: Sequence[DraftLane], block_lane: int) -> list[tuple[Guess, DraftLane]]:
    """A lane for each of the first len(lanes) guesses: "all accepted" continues the lane that drafted the block
    (it already holds it); the others take the other lanes, and that one too when "all accepted" is not chosen."""
    ranked = ranked[: len(lanes)]
    own = lanes[block_lane]
    others = [lane for lane in lanes if lane is not own]
    if all(guess.next_token is not None for guess in ranked):
        others.append(own)
    free = iter(others)
    return [(guess, own if guess.next_token is None else next(free)) for guess in ranked]
