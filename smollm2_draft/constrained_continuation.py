"""A teacher's continuations under constraints, for distilling a draft on the text a constrained request gets.

The teacher is masked as the stack masks it (a grammar matcher per row, the project's `ConstraintCompiler`); what
is recorded at each position is its unmasked distribution, so a draft taught on it stays the teacher's draft on
unconstrained text too. The top-k is named over the ids the constraint allows first, then the rest by
probability: a masked draft must rank the allowed ids as the teacher does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xgrammar
from transformers import DynamicCache, PreTrainedModel

from specdec.sampling.constraints import ConstraintCompiler, ConstraintSpec, apply_bitmask

ALLOWED_FIRST = 1e4  # added to an allowed id's log-probability when ranking which ids to name


@dataclass(frozen=True)
class ConstrainedContinuations:
    """One batch's continuations; rows end where their matcher terminated (the end of text included)."""

    tokens: torch.Tensor  # [B, C] continuation ids, the end of text after a row's end
    top_logprobs: torch.Tensor  # [B, C, K] float16, the teacher's unmasked log-probabilities of the named ids
    top_ids: torch.Tensor  # [B, C, K] int16 or int32
    valid: torch.Tensor  # [B, C] bool: the row had not ended before this position


@torch.inference_mode()
def continue_under_constraints(
    teacher: PreTrainedModel,
    compiler: ConstraintCompiler,
    prompts: list[list[int]],
    constraints: list[ConstraintSpec],
    greedy: bool,
    eos_id: int,
    new_tokens: int,
    top_k: int,
) -> ConstrainedContinuations:
    """The prompts (left-padded with eos_id) continued together, each under its constraint, greedy or sampled at
    temperature 1, for up to new_tokens tokens."""
    batch, width = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.tensor([[eos_id] * (width - len(p)) + p for p in prompts])  # [B, P]
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, P]
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # [B, P]
    matchers = [xgrammar.GrammarMatcher(compiler.compile(spec)) for spec in constraints]
    bitmask = xgrammar.allocate_token_bitmask(batch, compiler.vocab_size)  # [B, ceil(V / 32)] int32
    done = torch.zeros(batch, dtype=torch.bool)
    cache = DynamicCache()
    out = teacher(input_ids=input_ids, attention_mask=attention, position_ids=positions, cache=cache, use_cache=True)
    tokens, top_values, top_ids, valid = [], [], [], []
    for _ in range(new_tokens):
        raw = torch.log_softmax(out.logits[:, -1].float(), dim=-1)  # [B, V]
        bitmask.fill_(-1)  # a finished row allows everything; its tokens are not valid
        for row, matcher in enumerate(matchers):
            if not done[row]:
                matcher.fill_next_token_bitmask(bitmask, row)
        masked = raw.clone()  # [B, V]
        apply_bitmask(masked, bitmask)
        chosen = masked.argmax(-1) if greedy else torch.multinomial(masked.exp(), 1).squeeze(-1)  # [B]
        chosen = torch.where(done, eos_id, chosen)
        named = torch.where(torch.isfinite(masked), raw + ALLOWED_FIRST, raw).topk(top_k, dim=-1).indices  # [B, K]
        tokens.append(chosen)
        top_values.append(raw.gather(-1, named).half())
        top_ids.append(named)
        valid.append(~done)
        for row, matcher in enumerate(matchers):
            if not done[row]:
                matcher.accept_token(int(chosen[row]))
                done[row] = matcher.is_terminated()
        if bool(done.all()):
            break
        attention = torch.cat([attention, torch.ones(batch, 1, dtype=attention.dtype)], dim=1)
        positions = positions[:, -1:] + 1  # [B, 1]
        out = teacher(
            input_ids=chosen[:, None],
            attention_mask=attention,
            position_ids=positions,
            cache=cache,
            use_cache=True,
        )
    return ConstrainedContinuations(
        torch.stack(tokens, dim=1), torch.stack(top_values, dim=1), torch.stack(top_ids, dim=1), torch.stack(valid, 1)
    )
