"""Choosing every drafting session's next token at once, on the logits' device, with one read back to the host.

Row by row the same tokens as logits_to_probs then sample_token (greedy, or the rejection rule's DRAFT draw) or the
coupled rule's argmax(log q + g): rows under each rule are served together with specdec/sampling/row_sampling.py, and
what the host needs of every row (its token, its BadLogits code, its most likely tokens) comes back in one int64 tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.sampling.row_sampling import (
    RowSettings,
    batched_probs,
    host_uniforms,
    host_values,
    inverse_cdf,
)
from specdec.sampling.rules import SamplingParams, Stream, coupled_scores


@dataclass(frozen=True)
class RowRequest:
    """What one row's choice depends on besides its logits."""

    params: SamplingParams  # validated
    position: int  # the absolute sequence position of the token chosen
    num_alternatives: int  # the most likely other tokens wanted there


@dataclass(frozen=True)
class RowChoice:
    """One row's choice, on the host; plus the q row it was drawn from, on the device, under the rejection rule."""

    token: int  # meaningless where bad_logits is nonzero
    bad_logits: int  # a BadLogits code
    ranked: list[int]  # the row's most likely tokens, most likely first (up to num_alternatives + 1, or []); only
    # tokens the row allows (a finite logit): a constraint's mask may leave fewer
    probs: torch.Tensor | None  # q [V] of a sampled rejection-rule row; None when greedy or coupled


def choose_rows(logits: torch.Tensor, requests: Sequence[RowRequest]) -> list[RowChoice]:
    """Each row's next token from logits [K, V], as its request says; reads the device back once.

    - greedy rows: the first argmax;
    - sampled rows under the rejection rule: inverse-CDF draws from q at their position's DRAFT uniform;
    - coupled rows: argmax(q / e) with their position's exponential noise e (= argmax(log q + g));
    - ranked: one top-k of width max(num_alternatives) + 1 over the logits, or the coupled rows' scores, without
      the tokens whose logit is -inf (a constraint or min_p refuses them: no verdict can name them).
    """
    device, vocab = logits.device, logits.shape[-1]
    probs, tokens, codes = batched_probs(logits, RowSettings.of([r.params for r in requests], device))  # [K, V], [K]
    sampled = [i for i, r in enumerate(requests) if not r.params.greedy and not r.params.coupled]
    coupled = [i for i, r in enumerate(requests) if r.params.coupled]
    kept_probs = None
    if sampled:
        rows = host_values(sampled, torch.long, device)  # [S]
        kept_probs = probs.index_select(0, rows)  # [S, V]
        uniforms = host_uniforms(
            [(requests[i].params.seed, requests[i].position, Stream.DRAFT) for i in sampled], device
        )
        tokens = tokens.index_copy(0, rows, inverse_cdf(kept_probs, uniforms))  # [K]
    width = min(max(r.num_alternatives for r in requests) + 1, vocab)
    ranking = logits.double() if width > 1 else None  # [K, V]: float64 holds every float logit exactly, in order
    if coupled:
        rows = host_values(coupled, torch.long, device)  # [C]
        draws = [(requests[i].params.seed, requests[i].position) for i in coupled]
        scores = coupled_scores(probs.index_select(0, rows), draws)  # [C, V]: q / e
        tokens = tokens.index_copy(0, rows, scores.argmax(dim=-1))  # [K]
        if ranking is not None:  # a token the rules refuse (logit -inf) ranks last, as by the logits
            refused = logits.index_select(0, rows) == float("-inf")  # [C, V]
            ranking = ranking.index_copy(0, rows, scores.double().masked_fill(refused, float("-inf")))
    columns = [tokens.unsqueeze(-1), codes.long().unsqueeze(-1)]  # [K, 1] each
    if ranking is not None:
        top = ranking.topk(width, dim=-1).indices  # [K, width], largest first
        refused = logits.gather(-1, top) == float("-inf")  # [K, width]
        columns.append(top.masked_fill(refused, -1))
    host = torch.cat(columns, dim=-1).tolist()  # [K, 2 + width or 2]: the step's one read back
    kept = dict(zip(sampled, kept_probs)) if kept_probs is not None else {}
    return [
        RowChoice(row[0], row[1], [t for t in row[2 : 2 + r.num_alternatives + 1] if t >= 0], kept.get(i))
        for i, (row, r) in enumerate(zip(host, requests))
    ]
