"""Drafting γ tokens autoregressively from a draft model's session."""

from __future__ import annotations

import torch

from specdec.kv_session import KVSession
from specdec.sampling import SamplingParams, Stream, logits_to_probs, sample_token


def draft_with_model(session: KVSession, num_tokens: int, params: SamplingParams) -> tuple[list[int], torch.Tensor | None]:
    """Samples num_tokens tokens after the session's sequence and appends them to it.

    Returns the tokens and the distributions q they were drawn from ([γ, V]), or None under greedy
    decoding, where q is one-hot at the drafted token. The last drafted token is left pending: the
    next extend feeds it, or a rollback drops it without it ever being computed.
    """
    if num_tokens == 0:
        return [], None
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    logits = session.extend()[-1]  # [V]
    for i in range(num_tokens):
        probs = logits_to_probs(logits, params)  # [V]
        token = sample_token(probs, params, position=len(session), stream=Stream.DRAFT)
        tokens.append(token)
        rows.append(probs)
        if i + 1 < num_tokens:
            logits = session.extend([token], score_previous=False)[-1]  # [V]
        else:
            session.append([token])
    if params.greedy or not rows:
        return tokens, None
    return tokens, torch.stack(rows)  # [γ, V]
