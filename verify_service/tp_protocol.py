"""What rank 0 sends the other ranks of the tensor-parallel verify service, and the channel it goes over.

One message per unit of work on the group (docs/architecture.md, "Tensor parallelism"):

    Step(cache_events, rows)   one packed pass: replay the caches opened/released since the last step, in
                               order, crop each row's cache to its start_len, run the same forward_rows
    Heartbeat()                nothing to run: a monitored barrier proves every rank is alive and listening
    Shutdown()                 leave the loop and destroy the process group

Ranks name caches by the number rank 0 gave them when it opened them, never by pool internals (slots,
blocks): each rank replays the same opens, releases, crops and passes in the same order on its own pool.
"""

from __future__ import annotations

import collections
import datetime
import logging
from dataclasses import dataclass

import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheEvent:
    """Rank 0 opened (new_cache) or released (the cache was garbage) the cache with this number."""

    cache_id: int
    opened: bool


@dataclass(frozen=True)
class RowForward:
    """One row of a packed pass: its cache cropped to start_len, then token_ids fed; logits of the last
    logit_rows positions (every rank computes them: the LM head's gather is a collective)."""

    cache_id: int
    start_len: int
    token_ids: tuple[int, ...]
    logit_rows: int


@dataclass(frozen=True)
class Step:
    """One packed pass on every rank, after replaying the cache events since the previous step."""

    cache_events: tuple[CacheEvent, ...]
    rows: tuple[RowForward, ...]


@dataclass(frozen=True)
class Heartbeat:
    """Nothing to run; every rank answers with a monitored barrier."""


@dataclass(frozen=True)
class Shutdown:
    """Leave the loop and destroy the process group."""


Op = Step | Heartbeat | Shutdown


class ControlChannel:
    """The gloo group that carries ops from rank 0 (a gloo group even when the model's group is nccl)."""

    def __init__(self, timeout_s: float):
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.timeout_s = timeout_s
        self.sent: collections.Counter[str] = collections.Counter()  # ops sent from here, by type name

    def send(self, op: Op) -> None:
        dist.broadcast_object_list([op], src=0, group=self.group)
        self.sent[type(op).__name__] += 1

    def receive(self) -> Op:
        box: list[Op | None] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def barrier(self) -> None:
        """Returns once every rank reached it; on rank 0 raises naming a rank that did not within the timeout."""
        dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=self.timeout_s))

    def gather(self, item: object) -> list[object] | None:
        """Every rank's item on rank 0 (None elsewhere)."""
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(item, gathered, dst=0, group=self.group)
        return gathered

    def set_timeout(self, timeout_s: float) -> None:
        """The steady-state timeout for this group and the model's (start-up allowed a longer one)."""
        self.timeout_s = timeout_s
        for group in (self.group, None):
            try:
                dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)
            except (AttributeError, RuntimeError, ValueError) as error:  # private API: keep the start-up timeout
                log.warning("could not shorten the collective timeout to %.0fs: %s", timeout_s, error)
