"""Repetition, frequency and presence penalties and min_p on rows of logits, each row over its own history.

As vLLM defines them: the repetition penalty (CTRL, arXiv:1909.05858) divides the positive logits of every token
seen in the prompt or the output by r and multiplies the negative ones by r; the frequency penalty subtracts f times
a token's count in the output, the presence penalty p once for a token the output holds; min_p drops the tokens
whose probability after temperature is under min_p times the largest one's (applied to logits here: a token
stays when (logit - max) / T >= log(min_p)). The rows of a block share a history up to their first row, and row j
also sees the first j drafted tokens, so every position of a block is penalised as plain decoding would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specdec.sampling.rules import SamplingParams


def penalise_block(
    logits: torch.Tensor, tokens: Sequence[int], output_start: int, first: int, params: SamplingParams
) -> torch.Tensor:
    """Penalised logits [n, V] of a block: row j follows tokens[:first + j] (the prompt up to output_start, the
    output after it). Returns `logits` itself when the params penalise nothing."""
    if not params.penalised:
        return logits
    rows, vocab = logits.shape
    device = logits.device
    history = torch.tensor(list(tokens[: first + rows - 1]), dtype=torch.long, device=device)  # [first + n - 1]
    before = torch.bincount(history[output_start:first], minlength=vocab).to(logits.dtype)  # [V]: output so far
    drafted = F.one_hot(history[first:], vocab).to(logits.dtype)  # [n - 1, V]: row j also counts the first j
    counts = before + F.pad(drafted.cumsum(0), (0, 0, 1, 0))  # [n, V]
    if params.repetition_penalty != 1.0:
        in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        in_prompt[history[:output_start]] = True
        seen = in_prompt | (counts > 0)  # [n, V]
        r = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [n, V] with the tokens min_p drops at -inf (sampled rows only: the argmax always stays)."""
    if params.min_p <= 0 or params.greedy:
        return logits
    largest = logits.max(dim=-1, keepdim=True).values  # [n, 1]
    return logits.masked_fill((logits - largest) / params.temperature < math.log(params.min_p), -math.inf)
