"""The start-up self-test of a model's forward paths: a short probe run packed and with a plain cache, its logits
compared with one ordinary forward pass of the whole probe.

A model is served packed (specdec/engine/packed_forward.py: many sessions per pass) when its config allows it and the
probe's packed passes reproduce the ordinary pass: two sequences side by side, prefills, a decode step beside a
verify block, rollbacks, and a window outgrown where the model has a short one. Otherwise it is served one
sequence per pass on a transformers DynamicCache, kept whole (no sliding layers, so a rollback past a window
works; the model's own masks apply the window), once the same probe shows that path reproduces the pass. A model
neither path reproduces is refused at start-up, with both reasons. See the README's table of models served.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from specdec.engine.draft_kernels import Bf16Linear
from specdec.engine.kv.pool import KVPool
from specdec.engine.packed_forward import packed_forward
from specdec.engine.packed_step import AttentionBackend

PROBE_TOKENS = (
    24  # past a tiny model's window; a real model's window is checked by tests/specdec/engine/test_model_coverage.py
)
# Largest |logit difference| accepted, relative to the largest |logit| of the ordinary pass.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}
# The probe as (sequence, its end after the pass) per pass, with rollbacks (sequence, positions dropped) between:
# prefills; a decode step beside a verify block; a verify block after a rollback beside a prefill's remainder;
# a long block after a deep rollback beside a short one.
PROBE_PASSES = (
    ((), ((0, 10), (1, 3))),
    ((), ((0, 11), (1, 8))),
    (((0, 4),), ((0, 12), (1, 20))),
    (((1, 9),), ((1, PROBE_TOKENS), (0, 16))),
)


class UnsupportedModelError(ValueError):
    """Neither the packed nor the cached forward reproduces the model's own forward pass."""


def probe_tokens(vocab_size: int) -> list[int]:
    """PROBE_TOKENS ids spread over the ids served (deterministic)."""
    return [(7919 * i + 13) % vocab_size for i in range(PROBE_TOKENS)]


@torch.inference_mode()
def plain_logits(model: torch.nn.Module, ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """The model's own forward pass over the whole probe, no cache: float32 logits [T, V]."""
    return model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False).logits[0].float()


def logits_dtype(model: torch.nn.Module) -> torch.dtype:
    """The precision a model's logits are computed in: its dtype, or bfloat16 where its head runs in bfloat16 (a
    draft's kernels), whose rounding the tolerance must allow for."""
    return torch.bfloat16 if any(isinstance(m, Bf16Linear) for m in model.modules()) else model.dtype


def _mismatch(got: torch.Tensor, want: torch.Tensor, what: str, dtype: torch.dtype) -> str | None:
    """Why logits got [n, V] are not want [n, V] within TOLERANCE, or None."""
    if got.shape != want.shape:
        return f"{what}: logits of shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    masked = want.isneginf()  # ids a model never proposes (a draft's subset head): -inf on both sides
    if not torch.equal(got.isneginf(), masked):
        return f"{what}: logits are -inf at other ids than the model's own pass"
    got, want = got.masked_fill(masked, 0.0), want.masked_fill(masked, 0.0)
    difference = float((got - want).abs().max())
    allowed = TOLERANCE.get(dtype, 3e-2) * max(1.0, float(want.abs().max()))
    if not difference <= allowed:  # also catches NaN
        return f"{what}: logits differ by up to {difference:.3g} (allowed {allowed:.3g})"
    return None


def packed_mismatch(
    model: torch.nn.Module,
    backend: AttentionBackend,
    block_size: int,
    device: torch.device,
    ids: Sequence[int],
    reference: torch.Tensor,
) -> str | None:
    """How the packed passes of the probe through `backend`, on blocks of the served block_size (in a pool of the
    probe's own), differ from the reference logits [T, V], or None when they agree."""
    pool = KVPool(model.config.num_hidden_layers, 2 * (PROBE_TOKENS // block_size + 2), block_size)
    sequences = [pool.new_sequence(), pool.new_sequence()]
    try:
        for rollbacks, rows in PROBE_PASSES:
            for sequence, dropped in rollbacks:
                sequences[sequence].crop(-dropped)
            runs = [(sequences[s], sequences[s].length, end) for s, end in rows]
            logits = packed_forward(
                model, [(ids[start:end], kv, end - start) for kv, start, end in runs], device, backend
            )
            for (_, start, end), got in zip(runs, logits):
                reason = _mismatch(
                    got, reference[start:end], f"packed positions {start}..{end - 1}", logits_dtype(model)
                )
                if reason is not None:
                    return reason
    except Exception as error:  # noqa: BLE001 - any failure of the packed path refuses it, with the reason
        return f"a packed pass raises {type(error).__name__}: {error}"
    return None


def cached_mismatch(
    forward: Callable[[torch.Tensor, Any], torch.Tensor],
    cache: Any,
    dtype: torch.dtype,
    ids: Sequence[int],
    reference: torch.Tensor,
) -> str | None:
    """How one sequence fed in blocks through `forward(input_ids [1, T], cache)` -> logits [T, V] on an empty cache
    of the cached path (with the probe's rollbacks) differs from the reference."""
    try:
        for rollbacks, rows in PROBE_PASSES:
            for sequence, dropped in rollbacks:
                if sequence == 0:
                    cache.crop(-dropped)
            for _, end in (row for row in rows if row[0] == 0):
                start = cache.get_seq_length()
                got = forward(torch.tensor([list(ids[start:end])]), cache)
                reason = _mismatch(got, reference[start:end], f"cached positions {start}..{end - 1}", dtype)
                if reason is not None:
                    return reason
    except Exception as error:  # noqa: BLE001
        return f"a cached pass raises {type(error).__name__}: {error}"
    return None
