"""What one round hands around: drafted blocks, the lane calls that draft them, and pre-drafted next rounds."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from coordinator.draft_lanes import DraftLane
from coordinator.verdict_guesses import Guess
from specdec.v1 import common_pb2, drafter_pb2


@dataclass
class DraftBlock:
    """Drafted tokens with their q (None = one-hot) as returned by the drafter, per position the draft's next
    most likely other tokens, and the lane that drafted them."""

    token_ids: list[int]
    probs: common_pb2.ProbabilityMatrix | None
    alternatives: list[list[int]] = field(default_factory=list)
    lane: int = 0

    def tail(self) -> DraftBlock:
        """The block without its first token (the bonus guess of an "all accepted" pre-draft)."""
        probs = None
        if self.probs is not None and self.probs.rows:
            row_bytes = self.probs.vocab_size * 4
            probs = common_pb2.ProbabilityMatrix(
                rows=self.probs.rows - 1,
                vocab_size=self.probs.vocab_size,
                float32_data=self.probs.float32_data[row_bytes:],
            )
        return DraftBlock(self.token_ids[1:], probs, self.alternatives[1:], self.lane)

    @classmethod
    def from_reply(cls, reply: drafter_pb2.ProposeResponse, lane: int) -> DraftBlock:
        """One lane's reply: alternative_token_ids [drafted, k] row-major become one list per position (without
        the -1 that pads a position with fewer)."""
        probs = reply.draft_probs if reply.HasField("draft_probs") and reply.draft_probs.rows else None
        tokens = list(reply.draft_token_ids)
        width = len(reply.alternative_token_ids) // len(tokens) if tokens else 0
        rows = (reply.alternative_token_ids[i * width : (i + 1) * width] for i in range(len(tokens)))
        alternatives = [[token for token in row if token >= 0] for row in rows]
        return cls(tokens, probs, alternatives if width else [], lane)


@dataclass(frozen=True)
class LaneCall:
    """What one lane is asked to hold and draft in a ProposeLanes call."""

    lane: DraftLane
    sequence: list[int]
    num_tokens: int
    lookup_tokens: int = 0  # greedy: lookup tokens the drafter may try after them (the block grows by up to + 1)
    forced_tokens: int = 0  # with a constraint: tokens it forces that the block may hold beyond them, with no pass


@dataclass(frozen=True)
class Candidate:
    """A pre-drafted next block and the verdict of the current block it follows."""

    num_accepted: int
    next_token: int
    block: DraftBlock


@dataclass
class ChainedRound:
    """A round the verifier runs by itself once the previous verdict is known (VerifyNext): the call, and which
    of its candidates the verdict selects (PLAIN_STEP: the plain step)."""

    call: asyncio.Future  # -> verifier_pb2.VerifyNextResponse
    index: int
    verify_epoch: int = 0  # ReplicaSessions.verify_epoch when it was sent: a move since voids it


@dataclass
class Predraft:
    """The next block being drafted under guessed verdicts of the current one; what follows a verdict that matches
    none of them: a block drafted afresh, or (plain_on_miss) a plain step at once; and in chained mode the
    VerifyNext call that hands the drafted blocks (and that plain step) to the verifier as soon as they exist."""

    guesses: list[Guess]
    plain_on_miss: bool
    future: asyncio.Future = field(init=False)  # -> [Candidate]: the usable blocks, as VerifyNext lists them
    next_round: asyncio.Future | None = None  # chained mode: -> VerifyNextResponse, set before `future` resolves
    verify_epoch: int = 0  # ReplicaSessions.verify_epoch when next_round was sent

    def cancel(self) -> None:
        self.future.cancel()
        if self.next_round is not None:
            self.next_round.cancel()
