"""A validated request, ready to run: what it asks for and how its rounds speculate."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.sampling.constraints import ConstraintSpec
from specdec.sampling.rules import SamplingParams

MAX_DRAFT_LANES = 16  # lanes one request may hold on a drafter (its default max_lanes); the least likely guesses go
MAX_RANKED_ALTERNATIVES = 8  # alternatives per drafted position a drafter ranks (its default max_alternatives)
EXTRA_RANKED_ALTERNATIVES = 2  # ranks considered for rejection guesses beyond the guesses per position


@dataclass(frozen=True)
class GenerationPlan:
    """A validated request, ready to run."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    gamma: int  # 0 = plain target decoding through the verifier
    draft_method: int  # common_pb2.DraftMethod
    overlap: bool
    predraft_guesses: int = 2  # overlapped mode: rejection guesses per block position (0: only "all accepted")
    predraft_max_batch: float = 0.0  # overlapped mode: pre-draft only below this verifier batch (0: always)
    chain_rounds: bool = True  # overlapped mode: pre-drafted blocks go to the verifier as drafted (VerifyNext)
    lookup_tokens: int = (
        0  # greedy: lookup tokens a block may try after its drafted ones (specdec/sampling/prompt_lookup.py)
    )
    forced_tokens: int = 0  # with a constraint: tokens it forces that a block may hold beyond γ (within the largest γ)
    top_logprobs: int | None = None  # the tokens' log-probabilities with this many alternatives each; None: none
    constraint: ConstraintSpec | None = None  # what the output must be (specdec/sampling/constraints.py)
    output_start: int = 0  # where the output begins in prompt_ids (0: at its end; a resumed request's is earlier)
    call_streams: bool = True  # calls to the replicas go as messages on one stream per session (CallStream)

    @property
    def rejection_guesses(self) -> int:
        """Rejection guesses per block position: greedy and coupled requests only. There the verifier's token
        after a rejection is the target's argmax (of log p + g under the coupled rule), which the draft's ranking
        (of log q + g) often names; under the rejection rule it is a draw from the residual distribution, which
        the draft's ranking seldom names (pre-draft hit rate 0.08 at temperature 1 on the demo pair, against
        0.69 greedy), so those lanes would cost without paying."""
        guessable = self.params.greedy or self.params.coupled
        return self.predraft_guesses if self.overlap and guessable else 0

    @property
    def ranked_alternatives(self) -> int:
        """The draft's next most likely tokens per position that rejection guesses are chosen from: a few ranks
        deeper than the guesses per position, so a request whose verdicts keep landing deeper gets lanes there
        (coordinator/verdict_guesses.py: VerdictHistory)."""
        if not self.rejection_guesses:
            return 0
        return min(self.rejection_guesses + EXTRA_RANKED_ALTERNATIVES, MAX_RANKED_ALTERNATIVES)

    @property
    def draft_lanes(self) -> int:
        """Draft lanes the request holds: one per guess a pre-draft may make (one when not overlapped)."""
        return min(1 + self.gamma * self.rejection_guesses, MAX_DRAFT_LANES) if self.overlap and self.gamma else 1
