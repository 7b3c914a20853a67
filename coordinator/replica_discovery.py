"""Live replica discovery: every refresh, a pool's replicas follow what its dns:/// entries resolve to.

A new address joins placement once its replica is ready and its Info passes the coordinator's check; an address
gone from DNS leaves placement at once (the pool's last replica only once another joined) and its channel closes
when its last session ends (coordinator/replicas.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from coordinator.replica_targets import ReplicaTargets
from coordinator.replicas import Replica, ReplicaPool
from specdec.common.errors import DownstreamUnavailableError

log = logging.getLogger(__name__)


def diff_addresses(current: Iterable[str], wanted: Iterable[str]) -> tuple[list[str], list[str]]:
    """(added, removed): the wanted addresses not current, in wanted's order; the current ones not wanted."""
    current, wanted = list(current), list(wanted)
    return [a for a in wanted if a not in current], [a for a in current if a not in wanted]


class ReplicaDiscovery:
    """Keeps one pool in step with its targets; `check` raises ValueError for a replica that must not join
    (a different vocabulary); such an address is not tried again while DNS still names it."""

    def __init__(
        self,
        pool: ReplicaPool,
        targets: ReplicaTargets,
        refresh_s: float,
        ready_timeout_s: float,
        check: Callable[[Replica], None],
    ):
        self.pool = pool
        self.targets = targets
        self.refresh_s = refresh_s
        self.ready_timeout_s = ready_timeout_s
        self.check = check
        self._joining: dict[str, asyncio.Task] = {}  # address -> its join, until it is in placement or failed
        self._refused: set[str] = set()
        self._wanted = [r.address for r in pool.replicas]
        self._kept: set[str] = set()  # the pool's last replica, gone from DNS, kept until another joins
        self._loop: asyncio.Task | None = None

    def start(self) -> None:
        self._loop = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        tasks = [t for t in [self._loop, *self._joining.values()] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception:  # a bug here must not end discovery for the coordinator's lifetime
                log.exception("%s replicas: refresh failed", self.pool.kind)

    async def refresh(self) -> None:
        """Resolves the targets once and applies the difference: joins started, replicas retired."""
        self._wanted = await self.targets.addresses()
        added, removed = diff_addresses([*(r.address for r in self.pool.replicas), *self._joining], self._wanted)
        for address in removed:
            if address in self._joining:
                log.info("%s replica %s left DNS before it joined", self.pool.kind, address)
                self._joining.pop(address).cancel()
        self._retire_unwanted()
        self._refused &= set(self._wanted)
        for address in added:
            if address not in self._refused:
                log.info("%s replica %s appeared in DNS; joining once ready", self.pool.kind, address)
                self._joining[address] = asyncio.ensure_future(self._join(address))

    def _retire_unwanted(self) -> None:
        """Retires the replicas DNS no longer names, but never the last one: it serves until a replacement joins."""
        self._kept &= {r.address for r in self.pool.replicas if r.address not in self._wanted}
        for replica in [r for r in self.pool.replicas if r.address not in self._wanted]:
            if len(self.pool.replicas) > 1:
                self.pool.retire(replica)
            elif replica.address not in self._kept:
                self._kept.add(replica.address)
                log.info("%s replica %s left DNS; it stays until another joins", self.pool.kind, replica.address)

    async def _join(self, address: str) -> None:
        replica = self.pool.open(address)
        try:
            await self.pool.ready(replica, self.ready_timeout_s)
            self.check(replica)
        except (DownstreamUnavailableError, ValueError) as error:
            if isinstance(error, ValueError):
                self._refused.add(address)
            log.warning("%s replica %s not joining: %s", self.pool.kind, address, error)
            await replica.channel.close()
            return
        except asyncio.CancelledError:
            with contextlib.suppress(asyncio.CancelledError):
                await replica.channel.close()
            raise
        finally:
            if self._joining.get(address) is asyncio.current_task():
                del self._joining[address]
        self.pool.join(replica)
        self._retire_unwanted()
