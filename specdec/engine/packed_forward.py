"""Packed forward passes: several sequences' new tokens in one model call, each row with its own KV cache.

This is what continuous batching runs on. The rows of a step have different cached lengths and different
numbers of new tokens (a prefill, a verify block of γ+1, a single draft step). Their new tokens are packed
into one sequence [1, T] with no padding, so every token-wise layer (projections, MLP, norms, LM head) runs
once over the T tokens; attention, registered with transformers under `PACKED_ATTENTION`, lets each row see
its own keys/values only.

The rows' keys/values live in one paged KVPool per model (specdec/engine/kv/pool.py): each row reads its positions
through its block table. How a layer's attention reads them is the model's attention backend
(specdec/engine/attention/selection.py): the compiled CPU kernel, SDPA on grids and single rows, or FlexAttention in one
call per layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdec.common.host_copies import to_device
from specdec.engine.direct_forward import direct_forward_refusal, direct_logits
from specdec.engine.kv.pool import SequenceKV
from specdec.engine.packed_step import AttentionBackend, PackedRow, PackedStep, StaticStep

PACKED_ATTENTION = "specdec_packed"


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    packed_step: PackedStep | StaticStep | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of each packed row against its own cached + new keys; query [1, H, T, D] and key/value [1, H_kv, T, D]
    hold the new tokens of all rows. Returns [1, T, H, D] like transformers' sdpa path. The step is a PackedStep, or a
    bucketed step's StaticStep (specdec/engine/bucketed_step.py). Outside a packed pass (no packed_step) it is
    transformers' sdpa attention."""
    if packed_step is None:  # a plain transformers call on this model (e.g. generate()): ordinary attention
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("packed attention has no logit soft-capping")
    step = packed_step
    pooled_keys, pooled_values = step.pool.write(
        module.layer_idx, step.write_at[0], step.write_at[1], key[0].transpose(0, 1), value[0].transpose(0, 1)
    )  # [H_kv, N, B, D]
    attended = step.backend.attend(step, query, pooled_keys, pooled_values, scaling, sliding_window)  # [T, H, D]
    return attended.unsqueeze(0), None  # [1, T, H, D]


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)  # the masks plain transformers calls need (sdpa's)


def packed_forward_refusal(config: PretrainedConfig) -> str | None:
    """Why a model's attention is not one packed_attention reproduces (logit soft-capping, layer kinds other than
    full and sliding-window attention), or None: the config allows packing. The start-up self-test
    (specdec/engine/packed_self_test.py) has the last word."""
    if getattr(config, "attn_logit_softcapping", None):
        return f"attention logit soft-capping ({config.attn_logit_softcapping}), which SDPA does not apply"
    kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        return f"layer types {sorted(kinds)}"
    return None


def packed_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    step: PackedStep | StaticStep,
    logits_to_keep: torch.Tensor | int = 0,
) -> torch.Tensor:
    """The model over a step's tokens input_ids [T] at positions [T], attending through the step; returns the logits
    [K, V] of the tokens logits_to_keep indexes (0: all T). Llama models run direct
    (specdec/engine/direct_forward.py)."""
    if direct_forward_refusal(model) is None:
        return direct_logits(model, packed_attention, input_ids, positions, step, logits_to_keep)
    no_mask = torch.empty((1, 1, 0, 0), dtype=torch.bool, device=input_ids.device)  # 4D: transformers builds none
    output = model(
        input_ids=input_ids.unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        attention_mask=no_mask,
        use_cache=False,
        logits_to_keep=logits_to_keep,
        packed_step=step,
    )
    return output.logits[0]


@contextlib.contextmanager
def reserved_rows(rows: Sequence[tuple[Sequence[int], SequenceKV, int]]) -> Iterator[None]:
    """Holds the pool for one pass over rows (token ids, cache, logits kept), each with blocks for its new tokens;
    a pass that fails (e.g. out of memory) grows no row and gives the blocks reserved for it back."""
    with rows[0][1].pool.lock:
        try:
            for ids, kv, _ in rows:
                kv.reserve(kv.length + len(ids))  # already done where the forward was planned (KVSession)
            yield
        except BaseException:
            for _, kv, _ in rows:
                kv.trim()
            raise


@torch.inference_mode()
def packed_forward(
    model: torch.nn.Module,
    rows: Sequence[tuple[Sequence[int], SequenceKV, int]],
    device: torch.device,
    backend: AttentionBackend,
) -> list[torch.Tensor]:
    """Runs every row's new tokens in one forward pass and extends each row's cache.

    rows: (new token ids, the row's SequenceKV, how many of its last positions need logits), all in one pool.
    backend: how each layer attends the rows (specdec/engine/attention/selection.py).
    Returns per row float32 logits [keep, V] for the last `keep` new tokens (no LM head work for the others).
    """
    with reserved_rows(rows):
        step = PackedStep([PackedRow(kv, kv.length, len(ids)) for ids, kv, _ in rows], device, model.dtype, backend)
        input_ids = torch.tensor([t for ids, _, _ in rows for t in ids], dtype=torch.long)  # [T]
        keep_at = [end - keep for (_, _, keep), end in zip(rows, step.offsets[1:])]
        keep_index = torch.cat([torch.arange(at, end) for at, end in zip(keep_at, step.offsets[1:])])  # [K]
        logits = packed_logits(
            model,
            to_device(input_ids, device),
            step.positions,
            step,
            to_device(keep_index, device),
        ).float()  # [K, V]
        step.finish()
    return list(torch.split(logits, [keep for _, _, keep in rows]))
