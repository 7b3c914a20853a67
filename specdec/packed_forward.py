"""Packed forward passes: several sequences' new tokens in one model call, each row with its own KV cache.

This is what continuous batching runs on. The rows of a step have different cached lengths and different
numbers of new tokens (a prefill, a verify block of γ+1, a single draft step). Their new tokens are packed
into one sequence [1, T] with no padding, so every token-wise layer (projections, MLP, norms, LM head) runs
once over the T tokens; attention, registered with transformers under `PACKED_ATTENTION`, lets each row see
its own keys/values only.

The rows' keys/values live in one KVPool per model (specdec/kv_pool.py), a slot per sequence. Rows of a few
tokens each (decode steps, verify blocks) attend in one call: their queries are laid out on a grid
[slots, n, H, D] over the contiguous range of slots they occupy, against that range of the pool, with a mask
that gives each row its own causal window. Long rows (prefills), or rows spread thinly over the pool, attend
one row per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdec.kv_pool import KVPool, SequenceKV

PACKED_ATTENTION = "specdec_packed"
GRID_MAX_TOKENS = 16  # rows of at most this many new tokens attend together on the grid
GRID_MAX_SPREAD = 2  # ...when the slot range they span is at most this many times their number


@dataclass(frozen=True)
class PackedRow:
    """One row of a packed step: its cache, where its new tokens start and how many there are."""

    kv: SequenceKV
    start: int  # positions already cached = absolute position of the row's first new token
    count: int  # new tokens of this row in the packed sequence


@dataclass(frozen=True)
class AttentionGrid:
    """Where the grid rows' tokens go on a [hi - lo, n, H, D] query grid, and the mask every layer shares."""

    rows: tuple[int, ...]  # indexes of the step's rows on the grid
    lo: int  # first slot of the range
    hi: int  # one past the last slot of the range
    length: int  # positions attended: the longest grid row's end
    tokens: torch.Tensor | None  # [Tg] packed indexes of the grid rows' tokens (None: all tokens, in order)
    slot_offsets: torch.Tensor  # [Tg] slot - lo of each grid token
    query_positions: torch.Tensor  # [Tg] index of each grid token within its row (0..n-1)
    mask: torch.Tensor  # [hi - lo, 1, n, length] additive: 0 where a query sees a position, -inf elsewhere

    @classmethod
    def plan(cls, rows: Sequence[PackedRow], offsets: Sequence[int], total_tokens: int,
             device: torch.device) -> AttentionGrid | None:
        """The grid for the short rows of a step, or None when they are too few or too spread out for one."""
        short = [i for i, row in enumerate(rows) if row.count <= GRID_MAX_TOKENS]
        if not short:
            return None
        slots = [rows[i].kv.slot for i in short]
        lo, hi = min(slots), max(slots) + 1
        if hi - lo > GRID_MAX_SPREAD * len(short) and len(short) > 1:
            return None
        query_len = max(rows[i].count for i in short)
        length = max(rows[i].start + rows[i].count for i in short)
        starts = torch.zeros(hi - lo, dtype=torch.long)  # [S] slots outside the step see position 0 onwards
        tokens, slot_offsets, query_positions = [], [], []
        for i in short:
            row = rows[i]
            starts[row.kv.slot - lo] = row.start
            tokens.extend(range(offsets[i], offsets[i] + row.count))
            slot_offsets.extend([row.kv.slot - lo] * row.count)
            query_positions.extend(range(row.count))
        # Query j of slot s sees positions 0..starts[s]+j; padded queries and idle slots see finite values
        # (the pool is zero-filled) and their outputs are never read.
        visible = torch.arange(length) <= (starts[:, None] + torch.arange(query_len))[:, :, None]  # [S, n, L]
        mask = torch.zeros(visible.shape, dtype=torch.float32).masked_fill_(~visible, float("-inf"))
        every_token = len(tokens) == total_tokens
        return cls(tuple(short), lo, hi, length, None if every_token else torch.tensor(tokens, device=device),
                   torch.tensor(slot_offsets, device=device), torch.tensor(query_positions, device=device),
                   mask.unsqueeze(1).to(device))


def _causal_mask(row: PackedRow, device: torch.device) -> torch.Tensor | None:
    """Query i of a row (position start+i) sees positions 0..start+i: [n, start+n]; None for a single query."""
    if row.count == 1:
        return None
    return torch.arange(row.start + row.count, device=device) <= (
        row.start + torch.arange(row.count, device=device)).unsqueeze(1)


class PackedStep:
    """The rows of one packed forward, in packing order (passed to the attention function as a kwarg)."""

    def __init__(self, rows: Sequence[PackedRow], device: torch.device):
        self.rows = list(rows)
        self.pool: KVPool = self.rows[0].kv.pool
        self.offsets = [0]  # row i's tokens are packed at offsets[i]..offsets[i+1]-1
        for row in self.rows:
            self.offsets.append(self.offsets[-1] + row.count)
        self.pool.reserve(max(row.start + row.count for row in self.rows))
        self.positions = torch.cat([torch.arange(r.start, r.start + r.count) for r in self.rows]).to(device)  # [T]
        self.slots = torch.tensor([r.kv.slot for r in self.rows for _ in range(r.count)], device=device)  # [T]
        self.grid = AttentionGrid.plan(self.rows, self.offsets, self.total_tokens, device)
        on_grid = set(self.grid.rows) if self.grid is not None else set()
        # (row index, its causal mask [n, start+n] or None for one token): the rows attending one per call
        self.single_rows = [(i, _causal_mask(row, device)) for i, row in enumerate(self.rows) if i not in on_grid]

    @property
    def total_tokens(self) -> int:
        return self.offsets[-1]

    def finish(self) -> None:
        """Every layer has written its keys/values: the rows now hold their new tokens."""
        for row in self.rows:
            row.kv.length = row.start + row.count


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     packed_step: PackedStep | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of each packed row against its own cached + new keys; query [1, H, T, D] and key/value
    [1, H_kv, T, D] hold the new tokens of all rows. Returns [1, T, H, D] like transformers' sdpa path.
    Outside packed_forward (no packed_step) it is transformers' sdpa attention."""
    if packed_step is None:  # a plain transformers call on this model (e.g. generate()): ordinary attention
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    step = packed_step
    pooled_keys, pooled_values = step.pool.write(module.layer_idx, step.slots, step.positions,
                                                 key[0].transpose(0, 1), value[0].transpose(0, 1))  # [S, H_kv, C, D]
    grouped = query.shape[1] != key.shape[1]
    queries = query[0].transpose(0, 1)  # [T, H, D]
    attended = torch.empty_like(queries)  # [T, H, D]
    grid = step.grid
    if grid is not None:
        on_grid = queries if grid.tokens is None else queries[grid.tokens]  # [Tg, H, D]
        grid_queries = queries.new_zeros((grid.hi - grid.lo, grid.mask.shape[2]) + queries.shape[1:])  # [S, n, H, D]
        grid_queries[grid.slot_offsets, grid.query_positions] = on_grid
        grid_out = F.scaled_dot_product_attention(
            grid_queries.transpose(1, 2), pooled_keys[grid.lo:grid.hi, :, :grid.length],
            pooled_values[grid.lo:grid.hi, :, :grid.length], attn_mask=grid.mask, scale=scaling,
            enable_gqa=grouped).transpose(1, 2)  # [S, n, H, D]
        grid_tokens = slice(None) if grid.tokens is None else grid.tokens
        attended[grid_tokens] = grid_out[grid.slot_offsets, grid.query_positions]
    for i, mask in step.single_rows:
        row, begin, end = step.rows[i], step.offsets[i], step.offsets[i + 1]
        length = row.start + row.count
        slot = slice(row.kv.slot, row.kv.slot + 1)
        attended[begin:end] = F.scaled_dot_product_attention(
            query[:, :, begin:end], pooled_keys[slot, :, :length], pooled_values[slot, :, :length], attn_mask=mask,
            scale=scaling, enable_gqa=grouped)[0].transpose(0, 1)  # [n, H, D]
    return attended.unsqueeze(0), None  # [1, T, H, D]


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)  # the masks plain transformers calls need (sdpa's)


def supports_packed_forward(config: PretrainedConfig) -> bool:
    """Whether a model's attention is plain causal attention that packed_attention reproduces exactly
    (no sliding window, no logit soft-capping, no attention sinks, a transformers attention backend)."""
    if getattr(config, "sliding_window", None) or getattr(config, "attn_logit_softcapping", None):
        return False
    layer_types = getattr(config, "layer_types", None)
    return not layer_types or all(kind == "full_attention" for kind in layer_types)


@torch.inference_mode()
def packed_forward(model: torch.nn.Module, rows: Sequence[tuple[Sequence[int], SequenceKV, int]],
                   device: torch.device) -> list[torch.Tensor]:
    """Runs every row's new tokens in one forward pass and extends each row's cache.

    rows: (new token ids, the row's SequenceKV, how many of its last positions need logits), all in one pool.
    Returns per row float32 logits [keep, V] for the last `keep` new tokens (no LM head work for the others).
    """
    pool = rows[0][1].pool
    with pool.lock:
        step = PackedStep([PackedRow(kv, kv.length, len(ids)) for ids, kv, _ in rows], device)
        input_ids = torch.tensor([[t for ids, _, _ in rows for t in ids]], dtype=torch.long, device=device)  # [1, T]
        keep_at = [end - keep for (_, _, keep), end in zip(rows, step.offsets[1:])]
        keep_index = torch.cat([torch.arange(at, end) for at, end in zip(keep_at, step.offsets[1:])])  # [K]
        no_mask = torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device)  # 4D: transformers builds no mask
        output = model(input_ids=input_ids, position_ids=step.positions.unsqueeze(0), attention_mask=no_mask,
                       use_cache=False, logits_to_keep=keep_index.to(device), packed_step=step)
        step.finish()
    logits = output.logits[0].float()  # [K, V]
    return list(torch.split(logits, [keep for _, _, keep in rows]))
