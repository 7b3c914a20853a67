"""One verification round on the target's session: sync to base_len, score the draft, judge, commit."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.errors import StaleBaseLenError
from specdec.kv_session import KVSession
from specdec.sampling import SamplingParams, Verdict, logits_to_probs, rejection_sample


@dataclass(frozen=True)
class VerifyTiming:
    """Where a round's time went inside the verifier, in nanoseconds."""

    forward_ns: int
    sampling_ns: int


def verify_round(session: KVSession, session_id: str, base_len: int, draft_tokens: Sequence[int],
                 draft_probs: torch.Tensor | None, params: SamplingParams) -> tuple[Verdict, VerifyTiming]:
    """Truncates to base_len, scores x_1..x_γ in one forward pass, runs the rejection sampler and commits.

    draft_probs: q [γ, V], or None for one-hot q. After the call the session holds exactly the committed
    sequence: base_len tokens + the accepted tokens + the recovered or bonus token.
    """
    if len(session) < base_len:
        raise StaleBaseLenError(session_id, base_len, len(session))
    session.truncate(base_len)
    started = time.perf_counter_ns()
    logits = session.extend(draft_tokens)  # [γ+1, V]
    scored = time.perf_counter_ns()
    p = logits_to_probs(logits, params)  # [γ+1, V]
    verdict = rejection_sample(draft_tokens, draft_probs, p, params, start_position=base_len)
    session.truncate(base_len + verdict.num_accepted)
    session.append([verdict.next_token])
    return verdict, VerifyTiming(forward_ns=scored - started, sampling_ns=time.perf_counter_ns() - scored)
