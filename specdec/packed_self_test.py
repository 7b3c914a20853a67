"""The start-up self-test of a model's forward paths: a short probe run packed and with a plain cache, its logits
compared with one ordinary forward pass of the whole probe.

A model is served packed (specdec/packed_forward.py: many sessions per pass) when its config allows it and the
probe's packed passes reproduce the ordinary pass: two sequences side by side, prefills, a decode step beside a
verify block, rollbacks, and a window outgrown where the model has a short one. Otherwise it is served one
sequence per pass on a transformers DynamicCache, kept whole (no sliding layers, so a rollback past a window
works; the model's own masks apply the window), once the same probe shows that path reproduces the pass. A model
neither path reproduces is refused at start-up, with both reasons. See the README's table of models served.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdec.kv_pool import KVPool
from specdec.packed_forward import packed_forward, packed_forward_refusal

if TYPE_CHECKING:
    from specdec.model_runtime import LoadedModel

PROBE_TOKENS = (
    24  # past a tiny model's window; a real model's window is checked by tests/specdec/test_model_coverage.py
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


def _mismatch(got: torch.Tensor, want: torch.Tensor, what: str, dtype: torch.dtype) -> str | None:
    """Why logits got [n, V] are not want [n, V] within TOLERANCE, or None."""
    if got.shape != want.shape:
        return f"{what}: logits of shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    difference = float((got - want).abs().max())
    allowed = TOLERANCE.get(dtype, 3e-2) * max(1.0, float(want.abs().max()))
    if not difference <= allowed:  # also catches NaN
        return f"{what}: logits differ by up to {difference:.3g} (allowed {allowed:.3g})"
    return None


def packed_mismatch(loaded: LoadedModel, ids: Sequence[int], reference: torch.Tensor) -> str | None:
    """How the packed passes of the probe differ from the reference logits [T, V], or None when they agree."""
    block_size = loaded.kv_pool.block_size  # the served block size, in a pool of the probe's own
    pool = KVPool(loaded.model.config.num_hidden_layers, 2 * (PROBE_TOKENS // block_size + 2), block_size)
    sequences = [pool.new_sequence(), pool.new_sequence()]
    try:
        for rollbacks, rows in PROBE_PASSES:
            for sequence, dropped in rollbacks:
                sequences[sequence].crop(-dropped)
            runs = [(sequences[s], sequences[s].length, end) for s, end in rows]
            logits = packed_forward(
                loaded.model,
                [(ids[start:end], kv, end - start) for kv, start, end in runs],
                loaded.device,
                loaded.attention_backend,
            )
            for (_, start, end), got in zip(runs, logits):
                reason = _mismatch(
                    got, reference[start:end], f"packed positions {start}..{end - 1}", loaded.model.dtype
                )
                if reason is not None:
                    return reason
    except Exception as error:  # noqa: BLE001 - any failure of the packed path refuses it, with the reason
        return f"a packed pass raises {type(error).__name__}: {error}"
    return None


def cached_mismatch(loaded: LoadedModel, ids: Sequence[int], reference: torch.Tensor) -> str | None:
    """How one sequence fed in blocks on the cached path (with the probe's rollbacks) differs from the reference."""
    try:
        cache = loaded.new_cache()
        for rollbacks, rows in PROBE_PASSES:
            for sequence, dropped in rollbacks:
                if sequence == 0:
                    cache.crop(-dropped)
            for _, end in (row for row in rows if row[0] == 0):
                start = cache.get_seq_length()
                got = loaded.forward(torch.tensor([list(ids[start:end])]), cache)
                reason = _mismatch(
                    got, reference[start:end], f"cached positions {start}..{end - 1}", loaded.model.dtype
                )
                if reason is not None:
                    return reason
    except Exception as error:  # noqa: BLE001
        return f"a cached pass raises {type(error).__name__}: {error}"
    return None


def choose_forward_path(loaded: LoadedModel) -> str | None:
    """Runs the probe and leaves `loaded` on the packed path (returns None) or on the cached one (returns why not
    packed). Raises UnsupportedModelError when neither reproduces the model's own pass."""
    ids = probe_tokens(loaded.vocab_size)
    reference = plain_logits(loaded.model, ids, loaded.device)[:, : loaded.vocab_size]  # [T, V served]
    reason = packed_forward_refusal(loaded.model.config)
    if reason is None:
        own_attention = loaded.model.config._attn_implementation
        loaded.use_packed_forward()
        reason = packed_mismatch(loaded, ids, reference)
        if reason is not None:
            loaded.use_cached_forward(own_attention)
    if reason is not None:
        broken = cached_mismatch(loaded, ids, reference)
        if broken is not None:
            raise UnsupportedModelError(
                f"model {loaded.settings.model!r} cannot be served: packed forward refused ({reason}); "
                f"cached forward refused ({broken})"
            )
    return reason
