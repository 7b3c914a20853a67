"""The in-process reference: speculative decoding with both models in one process, and plain decoding.

Tests and benchmarks compare the services against these. The loop follows the algorithm's pseudocode:
draft γ -> verify once -> accept/resample -> both caches roll back to the committed length. Both loops follow
the request's sampling rule (SamplingParams.rule); under the coupled rule their tokens are identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec.decoding.drafting import draft_with_model
from specdec.decoding.verification import verify_round
from specdec.engine.kv.session import KVSession
from specdec.engine.model_runtime import LoadedModel
from specdec.sampling.rules import SamplingParams, logits_to_probs, plain_token
from specdec.sampling.sequence_rules import SequenceRules
from specdec.sampling.speculation_stats import SpeculationStats


@dataclass
class GenerationResult:
    """Generated tokens (prompt excluded) and the speculation stats."""

    token_ids: list[int]
    stats: SpeculationStats
    finished_by_eos: bool
    dead_end: bool = False  # the constraint allowed no token after token_ids


def speculative_generate(
    target: LoadedModel,
    draft: LoadedModel,
    prompt_ids: Sequence[int],
    gamma: int,
    sampling: SamplingParams,
    max_new_tokens: int,
    target_rules: SequenceRules | None = None,
    draft_rules: SequenceRules | None = None,
) -> GenerationResult:
    """Generates up to max_new_tokens tokens from the target's distribution with γ-token drafts; each side applies
    its rules (penalties, min_p, a constraint: a cursor of its own) when given."""
    target_session = KVSession(target, prompt_ids)
    draft_session = KVSession(draft, prompt_ids)
    target_session.prefill()
    draft_session.prefill()
    stats = SpeculationStats()
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        base_len = len(target_session)
        block = min(gamma, max_new_tokens - len(generated) - 1)  # never draft past the budget
        forced = max_new_tokens - len(generated) - 1 - block  # forced tokens the block may hold, within the budget
        drafted = draft_with_model(draft_session, block, sampling, rules=draft_rules, forced_tokens=forced)
        draft_tokens, draft_probs = drafted.token_ids, drafted.probs
        verdict, _ = verify_round(
            target_session, "reference", base_len, draft_tokens, draft_probs, sampling, rules=target_rules
        )
        stats.record(len(draft_tokens), verdict.num_accepted)
        # Sync the draft to the committed sequence: roll back to the accepted prefix, add the new token.
        draft_session.truncate(base_len + verdict.num_accepted)
        draft_session.append(verdict.tokens[verdict.num_accepted :])
        if draft_rules is not None:
            draft_rules.observe_committed(draft_session.tokens)
        for token in verdict.tokens:
            generated.append(token)
            if token in target.eos_token_ids:
                return GenerationResult(generated, stats, finished_by_eos=True)
        if verdict.dead_end:
            return GenerationResult(generated, stats, finished_by_eos=False, dead_end=True)
    return GenerationResult(generated, stats, finished_by_eos=False)


def target_only_generate(
    target: LoadedModel,
    prompt_ids: Sequence[int],
    sampling: SamplingParams,
    max_new_tokens: int,
    rules: SequenceRules | None = None,
) -> GenerationResult:
    """Plain autoregressive decoding with the target alone (the project's own plain path), under the request's
    sampling rule (sampling.rule) and its rules (penalties, min_p, a constraint) when given: what a verifier emits
    for rounds with no draft."""
    session = KVSession(target, prompt_ids)
    session.prefill()
    generated: list[int] = []
    stats = SpeculationStats()
    pending: list[int] = []
    while len(generated) < max_new_tokens:
        logits = session.extend(pending, score_previous=not pending)[-1:]  # [1, V]
        if rules is not None:
            shaped = rules.shape(logits, session.tokens, len(session))
            if shaped.dead_row is not None:
                return GenerationResult(generated, stats, finished_by_eos=False, dead_end=True)
            logits = shaped.logits
        probs = logits_to_probs(logits[0], sampling)  # [V]
        token = plain_token(probs, sampling, position=len(session))
        stats.record(0, 0)
        generated.append(token)
        pending = [token]
        if token in target.eos_token_ids:
            return GenerationResult(generated, stats, finished_by_eos=True)
    return GenerationResult(generated, stats, finished_by_eos=False)
