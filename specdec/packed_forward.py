"""Packed forward passes: several sequences' new tokens in one model call, each row with its own KV cache.

This is what continuous batching runs on. The rows of a step have different cached lengths and different
numbers of new tokens (a prefill, a verify block of γ+1, a single draft step). Their new tokens are packed
into one sequence [1, T] with no padding, so every token-wise layer (projections, MLP, norms, LM head) runs
once over the T tokens; attention, registered with transformers under `PACKED_ATTENTION`, lets each row see
its own keys/values only.

On CPU in float32, the short rows (decode steps, verify blocks) attend in one call per layer to a compiled kernel
(specdec/ragged_attention.py); elsewhere SDPA attends them as follows.

The rows' keys/values live in one KVPool per model (specdec/kv_pool.py), a slot per sequence. Rows of a few
tokens each (decode steps, verify blocks) may share an attention call on a grid: their queries laid out
[slots, n, H, D] over the range of slots they occupy, against that range of the pool up to the grid's longest
row, with a mask that gives each row its own causal window. A grid saves calls but reads positions its shorter
rows and the idle slots between never use, so rows in slot order join a grid only where that reads fewer extra
positions than a call costs (GRID_CALL_POSITIONS): a drafter's lanes of similar lengths in neighbouring slots
share one, verify rows of very different lengths attend one row per call. Long rows (prefills) attend alone.

A sliding-window layer (Mistral, Gemma-2/3's local layers, Qwen2 with use_sliding_window) whose window is shorter
than some row's end attends every row alone with a windowed mask (`_windowed_mask`); a window as long as every row
is full attention and takes the paths above.
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
from specdec.ragged_attention import AttendRows

PACKED_ATTENTION = "specdec_packed"
GRID_MAX_TOKENS = 16  # rows of at most this many new tokens are short: they may attend on grids or in the kernel
# One more attention call costs about what attending this many more slot-positions costs. On CPU, 1 thread, 4
# heads of 64, cold caches: ~15 µs a call against ~0.35 µs a slot-position for 5 queries (11 and 0.15 for one).
GRID_CALL_POSITIONS = 48


@dataclass(frozen=True)
class PackedRow:
    """One row of a packed step: its cache, where its new tokens start and how many there are."""

    kv: SequenceKV
    start: int  # positions already cached = absolute position of the row's first new token
    count: int  # new tokens of this row in the packed sequence


@dataclass(frozen=True)
class AttentionGrid:
    """Where one grid's rows' tokens go on a [hi - lo, n, H, D] query grid, and the mask every layer shares."""

    rows: tuple[int, ...]  # indexes of the step's rows on the grid
    lo: int  # first slot of the range
    hi: int  # one past the last slot of the range
    length: int  # positions attended: the longest grid row's end
    tokens: torch.Tensor | None  # [Tg] packed indexes of the grid rows' tokens (None: all tokens, in order)
    slot_offsets: torch.Tensor  # [Tg] slot - lo of each grid token
    query_positions: torch.Tensor  # [Tg] index of each grid token within its row (0..n-1)
    mask: torch.Tensor  # [hi - lo, 1, n, length] additive: 0 where a query sees a position, -inf elsewhere

    @classmethod
    def plan_all(
        cls,
        rows: Sequence[PackedRow],
        offsets: Sequence[int],
        total_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> list[AttentionGrid]:
        """The grids of a step's short rows. In slot order, a row joins the grid before it where the slot-positions
        the grid would read with it (idle slots and positions past a row's end included) are no more than the two
        read apart plus GRID_CALL_POSITIONS; otherwise it starts a new one. A row left alone gets no grid: it
        attends alone."""
        short = sorted((i for i, row in enumerate(rows) if row.count <= GRID_MAX_TOKENS), key=lambda i: rows[i].kv.slot)
        clusters: list[list[int]] = []
        length = 0  # positions the last cluster attends: its longest row's end
        for i in short:
            end, slot = rows[i].start + rows[i].count, rows[i].kv.slot
            if clusters:
                first_slot, last_slot = rows[clusters[-1][0]].kv.slot, rows[clusters[-1][-1]].kv.slot
                joined = (slot - first_slot + 1) * max(length, end)
                apart = (last_slot - first_slot + 1) * length + GRID_CALL_POSITIONS + end
                if joined <= apart:
                    clusters[-1].append(i)
                    length = max(length, end)
                    continue
            clusters.append([i])
            length = end
        return [
            cls.plan(rows, cluster, offsets, total_tokens, device, dtype) for cluster in clusters if len(cluster) > 1
        ]

    @classmethod
    def plan(
        cls,
        rows: Sequence[PackedRow],
        on_grid: Sequence[int],
        offsets: Sequence[int],
        total_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> AttentionGrid:
        """The grid of the rows `on_grid` (indexes into rows, in slot order)."""
        slots = [rows[i].kv.slot for i in on_grid]
        lo, hi = min(slots), max(slots) + 1
        query_len = max(rows[i].count for i in on_grid)
        length = max(rows[i].start + rows[i].count for i in on_grid)
        starts = [0] * (hi - lo)  # [S] slots outside the step see position 0 onwards
        tokens, slot_offsets, query_positions = [], [], []
        for i in on_grid:
            row = rows[i]
            starts[row.kv.slot - lo] = row.start
            tokens.extend(range(offsets[i], offsets[i] + row.count))
            slot_offsets.extend([row.kv.slot - lo] * row.count)
            query_positions.extend(range(row.count))
        # Query j of slot s sees positions 0..starts[s]+j; padded queries and idle slots see finite values
        # (the pool is zero-filled) and their outputs are never read.
        last_seen = torch.tensor(starts)[:, None] + torch.arange(query_len)  # [S, n]
        visible = torch.arange(length) <= last_seen[:, :, None]  # [S, n, L]
        mask = _additive(visible).unsqueeze(1)  # [S, 1, n, L]
        in_packing_order = tokens == list(range(total_tokens))  # every token of the step, in order
        indexes = torch.tensor([tokens, slot_offsets, query_positions], device=device)  # [3, Tg]
        return cls(
            tuple(on_grid),
            lo,
            hi,
            length,
            None if in_packing_order else indexes[0],
            indexes[1],
            indexes[2],
            mask.to(device, dtype),
        )


def _additive(visible: torch.Tensor) -> torch.Tensor:
    """A boolean visibility mask as an additive one: 0 where visible, -inf elsewhere (float32)."""
    return torch.where(visible, 0.0, float("-inf"))


def _causal_mask(row: PackedRow, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """Query i of a row (position start+i) sees positions 0..start+i: additive [n, start+n], made once per step
    in the queries' dtype so that no layer's attention converts it; None for a single query."""
    if row.count == 1:
        return None
    visible = torch.arange(row.start + row.count, device=device) <= (
        row.start + torch.arange(row.count, device=device)
    ).unsqueeze(1)
    return _additive(visible).to(dtype)


class PackedStep:
    """The rows of one packed forward, in packing order (passed to the attention function as a kwarg)."""

    def __init__(
        self, rows: Sequence[PackedRow], device: torch.device, dtype: torch.dtype, kernel: AttendRows | None = None
    ):
        self.rows = list(rows)
        self.pool: KVPool = self.rows[0].kv.pool
        self.offsets = [0]  # row i's tokens are packed at offsets[i]..offsets[i+1]-1
        for row in self.rows:
            self.offsets.append(self.offsets[-1] + row.count)
        self.pool.reserve(max(row.start + row.count for row in self.rows))
        self.positions = torch.tensor(
            [p for r in self.rows for p in range(r.start, r.start + r.count)], device=device
        )  # [T]
        self.slots = torch.tensor([r.kv.slot for r in self.rows for _ in range(r.count)], device=device)  # [T]
        short = [i for i, row in enumerate(self.rows) if row.count <= GRID_MAX_TOKENS]
        self.kernel = kernel if short else None
        # With the kernel: its short rows as (slot, start, count, offset) [R, 4]; no grids.
        self.kernel_rows = (
            None
            if self.kernel is None
            else torch.tensor(
                [[self.rows[i].kv.slot, self.rows[i].start, self.rows[i].count, self.offsets[i]] for i in short]
            )
        )
        self.grids = (
            []
            if self.kernel is not None
            else AttentionGrid.plan_all(self.rows, self.offsets, self.total_tokens, device, dtype)
        )
        shared = set(short) if self.kernel is not None else {i for grid in self.grids for i in grid.rows}
        # (row index, its causal mask [n, start+n] or None for one token): the rows attending one per call
        self.single_rows = [(i, _causal_mask(row, device, dtype)) for i, row in enumerate(self.rows) if i not in shared]
        self.windowed_masks: dict[int, list[tuple[int, torch.Tensor]]] = {}  # window -> per row (first key, mask)

    @property
    def total_tokens(self) -> int:
        return self.offsets[-1]

    def finish(self) -> None:
        """Every layer has written its keys/values: the rows now hold their new tokens."""
        for row in self.rows:
            row.kv.length = row.start + row.count


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    packed_step: PackedStep | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of each packed row against its own cached + new keys; query [1, H, T, D] and key/value
    [1, H_kv, T, D] hold the new tokens of all rows. Returns [1, T, H, D] like transformers' sdpa path.
    Outside packed_forward (no packed_step) it is transformers' sdpa attention."""
    if packed_step is None:  # a plain transformers call on this model (e.g. generate()): ordinary attention
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("packed attention has no logit soft-capping")
    step = packed_step
    pooled_keys, pooled_values = step.pool.write(
        module.layer_idx, step.slots, step.positions, key[0].transpose(0, 1), value[0].transpose(0, 1)
    )  # [S, H_kv, C, D]
    grouped = query.shape[1] != key.shape[1]
    if sliding_window is not None and any(row.start + row.count > sliding_window for row in step.rows):
        return _windowed_attention(step, query, pooled_keys, pooled_values, sliding_window, scaling, grouped), None
    queries = query[0].transpose(0, 1)  # [T, H, D]
    attended = queries.new_empty(queries.shape)  # [T, H, D]
    if step.kernel is not None:
        step.kernel(
            query[0],
            pooled_keys,
            pooled_values,
            step.kernel_rows,
            scaling if scaling is not None else query.shape[-1] ** -0.5,
            attended,
        )
    for grid in step.grids:
        on_grid = queries if grid.tokens is None else queries[grid.tokens]  # [Tg, H, D]
        grid_queries = queries.new_zeros((grid.hi - grid.lo, grid.mask.shape[2]) + queries.shape[1:])  # [S, n, H, D]
        grid_queries[grid.slot_offsets, grid.query_positions] = on_grid
        grid_out = F.scaled_dot_product_attention(
            grid_queries.transpose(1, 2),
            pooled_keys[grid.lo : grid.hi, :, : grid.length],
            pooled_values[grid.lo : grid.hi, :, : grid.length],
            attn_mask=grid.mask,
            scale=scaling,
            enable_gqa=grouped,
        ).transpose(1, 2)  # [S, n, H, D]
        grid_tokens = slice(None) if grid.tokens is None else grid.tokens
        attended[grid_tokens] = grid_out[grid.slot_offsets, grid.query_positions]
    for i, mask in step.single_rows:
        row, begin, end = step.rows[i], step.offsets[i], step.offsets[i + 1]
        length = row.start + row.count
        slot = slice(row.kv.slot, row.kv.slot + 1)
        attended[begin:end] = F.scaled_dot_product_attention(
            query[:, :, begin:end],
            pooled_keys[slot, :, :length],
            pooled_values[slot, :, :length],
            attn_mask=mask,
            scale=scaling,
            enable_gqa=grouped,
        )[0].transpose(0, 1)  # [n, H, D]
    return attended.unsqueeze(0), None  # [1, T, H, D]


def _windowed_mask(row: PackedRow, window: int, device: torch.device, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """Query i of a row (position p = start+i) sees positions p-window+1..p (transformers' sliding_window_overlay):
    (the first position attended, additive mask [n, start+n-first])."""
    first = max(0, row.start + 1 - window)
    keys = torch.arange(first, row.start + row.count, device=device)  # [L]
    queries = row.start + torch.arange(row.count, device=device).unsqueeze(1)  # [n, 1]
    return first, _additive((keys <= queries) & (keys > queries - window)).to(dtype)


def _windowed_attention(
    step: PackedStep,
    query: torch.Tensor,
    pooled_keys: torch.Tensor,
    pooled_values: torch.Tensor,
    window: int,
    scaling: float | None,
    grouped: bool,
) -> torch.Tensor:
    """A sliding-window layer: each row alone against its window of the pool; query [1, H, T, D] -> [1, T, H, D]."""
    masks = step.windowed_masks.get(window)
    if masks is None:
        masks = step.windowed_masks[window] = [
            _windowed_mask(row, window, query.device, query.dtype) for row in step.rows
        ]
    attended = query.new_empty(query.shape[2:3] + query.shape[1:2] + query.shape[3:])  # [T, H, D]
    for i, (row, (first, mask)) in enumerate(zip(step.rows, masks)):
        slot = slice(row.kv.slot, row.kv.slot + 1)
        attended[step.offsets[i] : step.offsets[i + 1]] = F.scaled_dot_product_attention(
            query[:, :, step.offsets[i] : step.offsets[i + 1]],
            pooled_keys[slot, :, first : row.start + row.count],
            pooled_values[slot, :, first : row.start + row.count],
            attn_mask=mask,
            scale=scaling,
            enable_gqa=grouped,
        )[0].transpose(0, 1)  # [n, H, D]
    return attended.unsqueeze(0)


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)  # the masks plain transformers calls need (sdpa's)


def packed_forward_refusal(config: PretrainedConfig) -> str | None:
    """Why a model's attention is not one packed_attention reproduces (logit soft-capping, layer kinds other than
    full and sliding-window attention), or None: the config allows packing. The start-up self-test
    (specdec/packed_self_test.py) has the last word."""
    if getattr(config, "attn_logit_softcapping", None):
        return f"attention logit soft-capping ({config.attn_logit_softcapping}), which SDPA does not apply"
    kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        return f"layer types {sorted(kinds)}"
    return None


@torch.inference_mode()
def packed_forward(
    model: torch.nn.Module,
    rows: Sequence[tuple[Sequence[int], SequenceKV, int]],
    device: torch.device,
    kernel: AttendRows | None = None,
) -> list[torch.Tensor]:
    """Runs every row's new tokens in one forward pass and extends each row's cache.

    rows: (new token ids, the row's SequenceKV, how many of its last positions need logits), all in one pool.
    kernel: the compiled attention of short rows (specdec/ragged_attention.py), or None for SDPA.
    Returns per row float32 logits [keep, V] for the last `keep` new tokens (no LM head work for the others).
    """
    pool = rows[0][1].pool
    with pool.lock:
        step = PackedStep([PackedRow(kv, kv.length, len(ids)) for ids, kv, _ in rows], device, model.dtype, kernel)
        input_ids = torch.tensor([[t for ids, _, _ in rows for t in ids]], dtype=torch.long, device=device)  # [1, T]
        keep_at = [end - keep for (_, _, keep), end in zip(rows, step.offsets[1:])]
        keep_index = torch.cat([torch.arange(at, end) for at, end in zip(keep_at, step.offsets[1:])])  # [K]
        no_mask = torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device)  # 4D: transformers builds no mask
        output = model(
            input_ids=input_ids,
            position_ids=step.positions.unsqueeze(0),
            attention_mask=no_mask,
            use_cache=False,
            logits_to_keep=keep_index.to(device),
            packed_step=step,
        )
        step.finish()
    logits = output.logits[0].float()  # [K, V]
    return list(torch.split(logits, [keep for _, _, keep in rows]))
