"""Packed forward passes: several sequences' new tokens in one model call, each row with its own KV buffers.

This is what continuous batching runs on. The rows of a step have different cached lengths and different
numbers of new tokens (a prefill, a verify block of γ+1, a single draft step). Their new tokens are packed
into one sequence [1, T] with no padding, so every token-wise layer (projections, MLP, norms, LM head) runs
once over the T tokens; attention runs per row, against that row's own keys/values only, through an
attention function registered with transformers under `PACKED_ATTENTION`.

A row's keys/values live in `SequenceKV`: one preallocated [H_kv, capacity, D] buffer per layer that grows
by doubling. A step writes only the new positions in place, and rollback (`crop`) only lowers the length,
so no step copies a sequence's whole cache (a DynamicCache concatenates on every step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_ATTENTION = "specdec_packed"
_MIN_CAPACITY = 64


class SequenceKV:
    """One sequence's keys and values for every layer: [H_kv, capacity, D] buffers and the length they hold.

    Behaves like a transformers cache where the rest of the code looks (`get_seq_length`, `crop(-n)`).
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # per layer [H_kv, capacity, D]
        self.values: list[torch.Tensor | None] = [None] * num_layers  # per layer [H_kv, capacity, D]
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last -tokens_to_remove positions (DynamicCache's convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to drop, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def __deepcopy__(self, memo: dict) -> SequenceKV:
        """An independent copy of the positions held (buffers sized to them, not to the capacity; they grow
        again on write)."""
        twin = SequenceKV(len(self.keys))
        twin.keys = [None if k is None else k[:, :self.length].clone() for k in self.keys]
        twin.values = [None if v is None else v[:, :self.length].clone() for v in self.values]
        twin.length = self.length
        return twin

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores keys/values [H_kv, n, D] at positions start..start+n-1 of a layer; returns views of all
        positions up to the new end ([H_kv, start+n, D] each)."""
        end = start + keys.shape[1]
        held = self.keys[layer]
        if held is None or held.shape[1] < end:
            capacity = max(_MIN_CAPACITY, end, 2 * (held.shape[1] if held is not None else 0))
            self.keys[layer] = self._grown(held, keys, capacity, start)
            self.values[layer] = self._grown(self.values[layer], values, capacity, start)
        self.keys[layer][:, start:end] = keys
        self.values[layer][:, start:end] = values
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    @staticmethod
    def _grown(held: torch.Tensor | None, like: torch.Tensor, capacity: int, keep: int) -> torch.Tensor:
        grown = like.new_empty((like.shape[0], capacity, like.shape[2]))  # [H_kv, capacity, D]
        if held is not None and keep:
            grown[:, :keep] = held[:, :keep]
        return grown


@dataclass(frozen=True)
class PackedRow:
    """One row of a packed step: its buffers, where its new tokens start and how many there are."""

    kv: SequenceKV
    start: int  # positions already cached = absolute position of the row's first new token
    count: int  # new tokens of this row in the packed sequence


class PackedStep:
    """The rows of one packed forward, in packing order (passed to the attention function as a kwarg)."""

    def __init__(self, rows: Sequence[PackedRow]):
        self.rows = list(rows)
        self.offsets = [0]  # row i's tokens are packed at offsets[i]..offsets[i+1]-1
        for row in self.rows:
            self.offsets.append(self.offsets[-1] + row.count)

    @property
    def total_tokens(self) -> int:
        return self.offsets[-1]

    def position_ids(self) -> torch.Tensor:
        """Absolute positions of the packed tokens, [1, T]."""
        return torch.cat([torch.arange(r.start, r.start + r.count) for r in self.rows]).unsqueeze(0)

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
    outputs = []
    for row, begin, end in zip(packed_step.rows, packed_step.offsets, packed_step.offsets[1:]):
        keys, values = row.kv.write(module.layer_idx, row.start, key[0, :, begin:end], value[0, :, begin:end])
        mask = None
        if row.count > 1:  # query i (position start+i) sees positions 0..start+i
            mask = torch.arange(keys.shape[1]) <= (row.start + torch.arange(row.count)).unsqueeze(1)  # [n, start+n]
        outputs.append(F.scaled_dot_product_attention(
            query[:, :, begin:end], keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scaling,
            enable_gqa=query.shape[1] != keys.shape[0]))  # [1, H, n, D]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None  # [1, T, H, D]


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
    """Runs every row's new tokens in one forward pass and extends each row's buffers.

    rows: (new token ids, the row's SequenceKV, how many of its last positions need logits). Returns per row
    float32 logits [keep, V] for the last `keep` new tokens (no LM head work for the others).
    """
    step = PackedStep([PackedRow(kv, kv.length, len(ids)) for ids, kv, _ in rows])
    input_ids = torch.tensor([[t for ids, _, _ in rows for t in ids]], dtype=torch.long, device=device)  # [1, T]
    keep_at = [end - keep for (_, _, keep), end in zip(rows, step.offsets[1:])]
    keep_index = torch.cat([torch.arange(at, end) for at, end in zip(keep_at, step.offsets[1:])])  # [K]
    no_mask = torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device)  # 4D: transformers builds no mask
    output = model(input_ids=input_ids, position_ids=step.position_ids().to(device), attention_mask=no_mask,
                   use_cache=False, logits_to_keep=keep_index.to(device), packed_step=step)
    step.finish()
    logits = output.logits[0].float()  # [K, V]
    return list(torch.split(logits, [keep for _, _, keep in rows]))
