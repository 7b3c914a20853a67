"""Sampling for many rows at once on their device, each row with its own settings, without reading anything back.

The batched counterpart of specdec/sampling/rules.py's one-row functions: `RowSettings` holds every row's temperature,
top-k and top-p as tensors; `batched_probs` turns logits [K, V] into the probabilities `logits_to_probs` gives row by
row, with a per-row code instead of an exception for bad logits; `inverse_cdf` draws as `sample_token` does from
uniforms made on the host (pure functions of seed and position, so no device value is read to make them); the coupled
rule's noise is made on the device (specdec/sampling/coupled_noise.py). A step
that judges or drafts many rows calls these and reads its results back once (docs/architecture.md, "A step
without host syncs").
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.common.host_copies import to_device
from specdec.sampling.rules import SamplingParams, Stream, position_uniform


class BadLogits(enum.IntEnum):
    """Why a row's logits admit no draw (0: they do)."""

    NONE = 0
    NAN_OR_POSINF = 1  # logits contain NaN or +inf
    ALL_NEGINF = 2  # every token masked


BAD_LOGITS_MESSAGES = {
    BadLogits.NAN_OR_POSINF: "logits contain NaN or +inf",
    BadLogits.ALL_NEGINF: "a row of logits is all -inf, so no token is possible",
}


def host_values(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Values made on the host, as a tensor on `device`, copied there without waiting."""
    return to_device(torch.tensor(values, dtype=dtype), device)


@dataclass(frozen=True)
class RowSettings:
    """Per-row sampling settings of a batch: tensors [K] on the rows' device, and what the host knows of them."""

    greedy: torch.Tensor | None  # [K] bool; None (as the three below) when every row is greedy
    temperature: torch.Tensor | None  # [K] float32; 1 on greedy rows (unused there)
    top_k: torch.Tensor | None  # [K] long; 0 = off
    top_p: torch.Tensor | None  # [K] float32; 1 = off
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    all_top_p: bool  # every sampled row uses top-p

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device) -> RowSettings:
        """The settings of rows whose params are `params` (one per row), on `device` (no tensors when every row is
        greedy: none is needed)."""
        for row_params in params:
            row_params.validate()
        flags = dict(
            all_greedy=all(p.greedy for p in params),
            any_top_k=any(p.top_k > 0 and not p.greedy for p in params),
            any_top_p=any(p.top_p < 1 and not p.greedy for p in params),
            all_top_p=all(p.top_p < 1 for p in params if not p.greedy),
        )
        if flags["all_greedy"]:
            return cls(greedy=None, temperature=None, top_k=None, top_p=None, **flags)

        return cls(
            greedy=host_values([p.greedy for p in params], torch.bool, device),
            temperature=host_values([p.temperature if not p.greedy else 1.0 for p in params], torch.float32, device),
            top_k=host_values([p.top_k for p in params], torch.long, device),
            top_p=host_values([p.top_p for p in params], torch.float32, device),
            **flags,
        )


def bad_logits_codes(largest: torch.Tensor) -> torch.Tensor:
    """BadLogits per row [K] (int8) from each row's largest logit [K]: NaN propagates through max, +inf is the max
    where present, and the max is -inf only where every token is masked."""
    codes = torch.where(largest.isneginf(), int(BadLogits.ALL_NEGINF), int(BadLogits.NONE))
    return torch.where(largest.isnan() | largest.isposinf(), int(BadLogits.NAN_OR_POSINF), codes).to(torch.int8)


def batched_probs(logits: torch.Tensor, rows: RowSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [K, V] -> (float32 probabilities [K, V] of the sampled rows, each row's first argmax [K], BadLogits
    codes [K]).

    - sampled rows: what logits_to_probs gives row by row: temperature, top-k (every token tied with the k-th
      largest kept), top-p (the smallest most-likely set reaching top_p);
    - greedy rows: their token is the first argmax; their probability rows hold nothing meaningful (and when every
      row is greedy the probabilities are [K, 0]);
    - a row with a nonzero code holds no meaningful probabilities.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    largest, first_largest = logits.max(dim=-1)  # [K] each
    codes = bad_logits_codes(largest)
    if rows.all_greedy:
        return logits.new_empty((logits.shape[0], 0)), first_largest, codes
    # Shift the max to 0 first: a tiny temperature then sends the others to -inf instead of the max to +inf.
    scaled = (logits - largest.unsqueeze(-1)) / rows.temperature.unsqueeze(-1)  # [K, V]
    if rows.any_top_k:
        uses_k = (rows.top_k > 0) & (rows.top_k < vocab)  # [K]
        ordered = scaled.sort(dim=-1, descending=True).values  # [K, V]
        kth_largest = ordered.gather(-1, (rows.top_k.clamp(1, vocab) - 1).unsqueeze(-1))  # [K, 1]
        scaled = scaled.masked_fill(uses_k.unsqueeze(-1) & (scaled < kth_largest), -math.inf)
    probs = scaled.softmax(dim=-1)  # [K, V]
    if rows.any_top_p:
        uses_p = rows.top_p < 1  # [K]
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [K, V]
        mass_before = F.pad(sorted_probs.cumsum(dim=-1)[..., :-1], (1, 0))  # [K, V]
        drop_sorted = (mass_before >= rows.top_p.unsqueeze(-1)) & uses_p.unsqueeze(-1)  # [K, V]; first token stays
        kept = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), 0.0)
        renormalised = kept / kept.sum(dim=-1, keepdim=True)
        probs = renormalised if rows.all_top_p else torch.where(uses_p.unsqueeze(-1), renormalised, probs)
    return probs, first_largest, codes


def joined_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Row blocks [k_i, V] as one [sum k_i, V]: a view where they lie one after another in one storage (as the
    rows of one packed pass's logits do), else a copy."""
    first = tensors[0]
    rows = sum(t.shape[0] for t in tensors)
    offset, consecutive = first.storage_offset(), True
    for t in tensors:
        consecutive &= (
            t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and t.stride() == first.stride()
            and t.shape[1:] == first.shape[1:]
            and t.storage_offset() == offset
        )
        offset += t.shape[0] * first.stride(0)
    if consecutive and first.dim() == 2:
        return first.as_strided((rows, first.shape[1]), first.stride(), first.storage_offset())
    return torch.cat(list(tensors))


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [R, V] (non-negative, positive sum) at its uniform [R] (float64): located in the
    float64 cumulative sum, as sample_token does, so zero-probability tokens are never drawn. Returns [R] long."""
    cdf = probs.double().cumsum(dim=-1)  # [R, V]
    total = cdf[:, -1:].contiguous()  # [R, 1]
    token = torch.searchsorted(cdf, uniforms.unsqueeze(-1) * total, right=True)  # [R, 1]
    last_with_mass = torch.searchsorted(cdf, total)  # [R, 1]: where the point rounded up to the total
    return torch.where(token == cdf.shape[-1], last_with_mass, token).squeeze(-1)


def host_uniforms(draws: Sequence[tuple[int, int, Stream]], device: torch.device) -> torch.Tensor:
    """position_uniform of each (seed, position, stream), as float64 [len(draws)] on `device`."""
    values = [position_uniform(seed, position, stream) for seed, position, stream in draws]
    return host_values(values, torch.float64, device)
