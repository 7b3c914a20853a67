"""Rank 0's model under tensor parallelism: every session's forwards, sent to the other ranks as one Step per pass.

Every session on rank 0 runs on the one MirroredModel, so a step's rows of many sessions (opens, rounds) share
one packed pass (specdec/engine/kv/session.py: run_forwards groups plans by model), and that pass is one Step message.
The cache opens and releases since the previous pass ride in it, in the order they happened, and each row
carries the length its cache starts from: a rollback on rank 0 only shrinks a cache between passes, so the
row's start_len replays it (the sync invariant, inside one replica).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from specdec.engine.model_runtime import Cache, LoadedModel
from verify_service.tp_protocol import CacheEvent, RowForward, Step

T = TypeVar("T")
StepRunner = Callable[[Step, Callable[[], T]], T]  # sends the step to the ranks, then runs the pass here


class MirroredModel:
    """A LoadedModel whose caches are numbered and whose passes are first sent as a Step (see the module doc)."""

    def __init__(self, model: LoadedModel, run_step: StepRunner):
        self.model = model
        self._run_step = run_step
        self._cache_ids: dict[int, int] = {}  # id(cache) -> the number the ranks know it by
        self._events: list[CacheEvent] = []  # opens and releases since the last step, in order
        self._next_id = 0
        self._lock = threading.RLock()  # releases come from the garbage collector: any thread, or this one inside

    def new_cache(self) -> Cache:
        """An empty cache, opened on every rank with the next step."""
        cache = self.model.new_cache()
        with self._lock:
            cache_id, self._next_id = self._next_id, self._next_id + 1
            self._cache_ids[id(cache)] = cache_id
            self._events.append(CacheEvent(cache_id, opened=True))
        weakref.finalize(cache, self._release, id(cache))
        return cache

    def _release(self, cache_key: int) -> None:
        with self._lock:
            self._events.append(CacheEvent(self._cache_ids.pop(cache_key), opened=False))

    def forward_rows(self, rows: Sequence[tuple[Sequence[int], Cache, int]]) -> list[torch.Tensor]:
        """LoadedModel.forward_rows on every rank: one Step, then the pass here; per row float32 logits [keep, V]."""
        with self._lock:
            events, self._events = tuple(self._events), []
            step = Step(
                events,
                tuple(
                    RowForward(self._cache_ids[id(cache)], cache.get_seq_length(), tuple(ids), keep)
                    for ids, cache, keep in rows
                ),
            )
        return self._run_step(step, lambda: self.model.forward_rows(rows))

    def forward(self, input_ids: torch.Tensor, cache: Cache) -> torch.Tensor:
        """input_ids [1, T] after the cached prefix -> float32 logits [T, V], on every rank."""
        return self.forward_rows([(input_ids[0].tolist(), cache, input_ids.shape[1])])[0]

    def __getattr__(self, name: str):  # max_context_tokens, vocab_size, settings, ...: the real model's
        return getattr(self.model, name)
