"""What one request's rounds did: speculation counts, where the time went, how pre-drafting fared."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.sampling.speculation_stats import SpeculationStats


@dataclass
class RequestStats(SpeculationStats):
    """Speculation counts plus where the time went (ns) and how pre-drafting fared."""

    draft_ns: int = 0
    verify_ns: int = 0
    sampling_ns: int = 0
    wire_ns: int = 0
    prefill_ns: int = 0
    total_ns: int = 0
    predraft_attempts: int = 0
    predraft_hits: int = 0
    predraft_guesses: int = 0  # guessed verdicts drafted, over all pre-drafted rounds
    chained_rounds: int = 0  # rounds the verifier ran right after the previous verdict (VerifyNext)
    draft_fallbacks: int = 0  # times the drafter failed and the request went on by plain decoding
    verify_moves: int = 0  # times the verify session moved to another replica (coordinator/session_moves.py)
    draft_moves: int = 0  # times the draft session did
    wire_bytes: int = 0  # serialized request + response bytes of the rounds' ProposeLanes, Verify, VerifyNext calls
    round_timeline: list[tuple[str, int, int]] = field(default_factory=list)  # (stage, start_ns, end_ns)
