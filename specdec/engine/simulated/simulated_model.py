"""A model on the twin: LoadedModel's interface (specdec/engine/model_runtime.py) over a synthetic pair, whose passes
take the cost model's time.

A pass reserves its rows' blocks in the twin's paged pool as a real pass does, stores the fed token ids there, makes
the kept positions' logits from the synthetic pair (target, or draft with its calibrated noise), advances the rows,
and then waits until the pass's modelled time has passed since it began: the host time it spent making logits
counts towards the pass, and the wait holds neither the pool's lock nor the interpreter's, as a host waiting for a
GPU holds neither. A pass whose host work outlasts its modelled time is *late*, and counted.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from specdec.engine.kv.pool import SequenceKV
from specdec.engine.model_runtime import ModelSettings, VocabularyIdentity, tokenizer_sha256
from specdec.engine.packed_forward import reserved_rows
from specdec.engine.simulated.cost_model import CostModel, PassRow
from specdec.engine.simulated.device_wait import wait_until
from specdec.engine.simulated.profiles import TwinDevice
from specdec.engine.simulated.synthetic_pair import CONTEXT_TOKENS, SyntheticPair, position_key
from specdec.engine.simulated.token_pool import TokenPool

log = logging.getLogger(__name__)
LATE_WARNING_EVERY_S = 30.0


@dataclass
class TwinPassStats:
    """What the twin's passes cost so far: modelled time, host time spent inside them, late passes."""

    passes: int = 0
    modelled_s: float = 0.0
    host_s: float = 0.0
    late_passes: int = 0
    late_s: float = 0.0  # host time past the modelled end, summed over late passes


class SimulatedModel:
    """One model of a twin profile (its target or its draft), served packed on a TokenPool."""

    packed = True  # many sequences per pass, through the paged pool
    unpacked_reason = None
    attention_backend = None
    graph_steps = None

    def __init__(
        self,
        settings: ModelSettings,
        twin: TwinDevice,
        role: str,
        tokenizer: PreTrainedTokenizerBase,
        pair: SyntheticPair,
        noise_scale: float | None,
    ):
        placement = twin.profile.placement(role)
        self.settings = dataclasses.replace(settings, dtype="bfloat16")  # what the profile's GPUs hold
        self.twin, self.role = twin, role
        self.device = torch.device("cpu")  # where the logits live
        self.cost = CostModel(placement)
        self.pair = pair
        self.noise_scale = noise_scale  # None: the target's logits, else the draft's
        self.tokenizer = tokenizer
        self.vocab_size = twin.served_vocab
        self.max_context_tokens = placement.model.max_context
        self.identity = VocabularyIdentity(f"{twin.spec}/{role}", self.vocab_size, tokenizer_sha256(self.tokenizer))
        self.eos_token_ids = frozenset({self.tokenizer.eos_token_id})
        self.kv_pool = TokenPool(placement.model.layers, self._budget_blocks(), settings.kv_block_size)
        self.stats = TwinPassStats()
        self._stats_lock = threading.Lock()
        self._warned_at = -LATE_WARNING_EVERY_S
        log.info(
            "twin %s %s: %s on %d x %s, a decode step %.2f ms; KV pool of %d blocks of %d positions",
            twin.spec,
            role,
            placement.model.name,
            placement.tensor_parallel,
            placement.gpu.name,
            self.cost.decode_step_s() * 1e3,
            self.kv_pool.blocks.num_blocks,
            settings.kv_block_size,
        )

    def _budget_blocks(self) -> int:
        """Blocks the KV budget buys on the profile's GPUs: bytes, or (at most 1) that share of the memory beside
        the weights."""
        placement, settings = self.cost.placement, self.settings
        if settings.kv_cache_budget <= 0:
            raise ValueError(f"kv_cache_budget must be > 0, got {settings.kv_cache_budget}")
        budget = settings.kv_cache_budget
        budget_bytes = budget * placement.free_memory_bytes if budget <= 1 else budget
        return max(1, int(budget_bytes // (placement.model.kv_bytes_per_position * settings.kv_block_size)))

    def new_cache(self) -> SequenceKV:
        return self.kv_pool.new_sequence()

    def forward(self, input_ids: torch.Tensor, cache: SequenceKV) -> torch.Tensor:
        """input_ids [1, T] after the cached prefix; returns float32 logits [T, V]."""
        return self.forward_rows([(input_ids[0].tolist(), cache, input_ids.shape[1])])[0]

    def forward_rows(self, rows: Sequence[tuple[Sequence[int], SequenceKV, int]]) -> list[torch.Tensor]:
        """One modelled pass over rows (token ids, cache, logits kept); per row float32 logits [keep, V]."""
        started = time.perf_counter()
        pool, seed = self.kv_pool, self.pair.seed
        with reserved_rows(rows):
            modelled = self.cost.seconds([PassRow(len(ids), kv.length, keep) for ids, kv, keep in rows])
            keys = []
            for ids, kv, keep in rows:
                context = pool.tail(kv, CONTEXT_TOKENS - 1) + list(ids)  # positions end - len(context) .. end - 1
                end = kv.length + len(ids)
                first = end - len(context)
                keys += [position_key(seed, at, context[: at - first + 1]) for at in range(end - keep, end)]
                pool.store(kv, ids)
            if self.noise_scale is None:
                logits = self.pair.target_logits(keys)  # [K, V]
            else:
                logits = self.pair.draft_logits(keys, self.noise_scale)  # [K, V]
            for ids, kv, _ in rows:
                kv.length += len(ids)
        self._count(modelled, time.perf_counter() - started)
        wait_until(started + modelled)
        return list(torch.split(logits, [keep for _, _, keep in rows]))

    def _count(self, modelled: float, host: float) -> None:
        with self._stats_lock:
            stats = self.stats
            stats.passes += 1
            stats.modelled_s += modelled
            stats.host_s += host
            if host > modelled:
                stats.late_passes += 1
                stats.late_s += host - modelled
                now = time.monotonic()
                if now - self._warned_at >= LATE_WARNING_EVERY_S:
                    self._warned_at = now
                    log.warning(
                        "twin %s: a pass's host work took %.2f ms, past its modelled %.2f ms (%d late of %d passes)",
                        self.role,
                        host * 1e3,
                        modelled * 1e3,
                        stats.late_passes,
                        stats.passes,
                    )
