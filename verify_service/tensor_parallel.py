"""Tensor parallelism for the verify service: rank 0 leads, the other ranks replay its passes on their shards.

The target is sharded with transformers' native tensor parallelism (`tp_plan="auto"`) over a
torch.distributed group: gloo on CPU, nccl on GPU. Each forward all-reduces inside the model, so every
rank must run the same passes in the same order. Rank 0 serves gRPC and owns the sessions (tokens,
sampling settings, the rejection sampler, which runs once there); every session runs on one MirroredModel
(verify_service/mirrored_model.py), so a step of many sessions is one packed pass and one Step message
(verify_service/tp_protocol.py), which ranks 1..N-1 replay on their mirror of the caches
(verify_service/tp_ranks.py). Continuous batching thus works as on one device.

Failure: every collective has a timeout; a monitor thread on rank 0 watches the ranks' processes and the
length of the step in progress, and sends heartbeats when idle (which also bound how long a worker waits
for rank 0). A dead or hung rank fails the group once: callbacks turn the service NOT_SERVING, in-flight
and later calls raise DownstreamUnavailableError (UNAVAILABLE), the other ranks are stopped and the
process group is destroyed.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

from specdec.common.errors import DownstreamUnavailableError
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from verify_service.mirrored_model import MirroredModel
from verify_service.settings import VerifySettings
from verify_service.tp_protocol import ControlChannel, Heartbeat, Shutdown, Step
from verify_service.tp_ranks import (
    STARTED_KEY,
    RankInfo,
    RankSpec,
    describe_rank,
    destroy_process_group,
    join_group,
    load_shard,
    rank_device,
)

log = logging.getLogger(__name__)

MONITOR_PERIOD_S = 0.2  # how often rank 0 looks at the other ranks
T = TypeVar("T")


class RankLauncher(Protocol):
    """Starts ranks 1..N-1 and watches their processes (verify_service.rank_launchers)."""

    def default_master_addr(self) -> str: ...

    def local_rank(self, rank: int) -> int: ...

    def start(self, specs: Sequence[RankSpec]) -> None: ...

    def exited_ranks(self) -> dict[int, str]:
        """Ranks whose process is gone, with why."""
        ...

    def stop(self, grace_s: float) -> None:
        """Lets the ranks exit for up to grace_s seconds, then kills them; releases what the launcher holds."""
        ...


class TensorParallelLeader:
    """Rank 0: the sharded model, the control channel to the other ranks and the watch over them."""

    def __init__(
        self,
        model: LoadedModel,
        channel: ControlChannel,
        launcher: RankLauncher,
        ranks: list[RankInfo],
        timeout_s: float,
    ):
        self.model = model
        self.ranks = ranks
        self.timeout_s = timeout_s
        self._channel = channel
        self._launcher = launcher
        self._lock = threading.Lock()  # one step on the group at a time (model thread and heartbeats)
        self._step_started: float | None = None
        self._last_step_ended = time.monotonic()
        self._failure: str | None = None
        self._failure_lock = threading.Lock()
        self._on_failure: list[Callable[[str], None]] = []
        self._stopping = threading.Event()
        self._teardown_thread: threading.Thread | None = None
        self.mirrored = MirroredModel(model, self.run_step)  # the model every session on rank 0 runs on
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()

    @classmethod
    def start(cls, settings: VerifySettings, launcher: RankLauncher) -> TensorParallelLeader:
        """Starts ranks 1..N-1, joins them as rank 0, loads the shard; returns once every rank is ready."""
        world_size = settings.tensor_parallel_size
        model_settings = ModelSettings.of(settings)  # every rank's pool has rank 0's budget and block size
        if not settings.device.startswith("cuda") and torch.cuda.is_available():
            raise ValueError(
                "tensor parallelism places shards on the accelerator transformers finds: use --device "
                "cuda, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on CPU"
            )
        master_addr = settings.tp_master_addr or launcher.default_master_addr()
        store = dist.TCPStore(
            master_addr,
            settings.tp_master_port,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=settings.tp_start_timeout_s),
            wait_for_workers=False,
        )
        specs = [
            RankSpec(
                rank,
                world_size,
                master_addr,
                store.port,
                replace(model_settings, device=rank_device(settings.device, launcher.local_rank(rank))),
                launcher.local_rank(rank),
                settings.tp_timeout_s,
                settings.tp_start_timeout_s,
                settings.log_level,
            )
            for rank in range(world_size)
        ]
        started = time.perf_counter()
        log.info(
            "starting %d tensor-parallel ranks (%s launcher, %s, rendezvous %s:%d)",
            world_size,
            type(launcher).__name__,
            specs[0].backend,
            master_addr,
            store.port,
        )
        try:
            launcher.start(specs[1:])
            _wait_for_ranks(store, launcher, world_size, settings.tp_start_timeout_s)
            channel = join_group(specs[0], store)
            model = load_shard(specs[0])
            ranks = channel.gather(describe_rank(specs[0], model))
            channel.set_timeout(settings.tp_timeout_s)
        except BaseException:
            launcher.stop(grace_s=1.0)
            destroy_process_group()
            raise
        for info in ranks:
            log.info(
                "rank %d pid %d on %s (%s): %.2f MiB of weights",
                info.rank,
                info.pid,
                info.host,
                info.device,
                info.weight_bytes / 2**20,
            )
        log.info("%d ranks ready in %.1fs", world_size, time.perf_counter() - started)
        return cls(model, channel, launcher, ranks, settings.tp_timeout_s)

    # --- what VerifyService calls (on its one model thread) -------------------------------------------

    def run_step(self, step: Step, forward: Callable[[], T]) -> T:
        """Sends one pass to every rank, then runs it here (`forward`) and returns what it returns."""
        with self._step():
            self._channel.send(step)
            return forward()

    @property
    def steps_sent(self) -> int:
        """Step messages sent to the ranks so far (one per packed pass)."""
        return self._channel.sent[Step.__name__]

    # --- failure ----------------------------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """Why the group failed, or None while it is healthy."""
        return self._failure

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise DownstreamUnavailableError(f"tensor-parallel ranks unavailable: {self._failure}")

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Calls callback(reason) once, from a monitor or model thread, when the group fails."""
        with self._failure_lock:
            if self._failure is None:
                self._on_failure.append(callback)
                return
        callback(self._failure)

    def fail(self, reason: str) -> None:
        """Marks the group failed (once), tells the callbacks, stops the other ranks, destroys the group."""
        with self._failure_lock:
            if self._failure is not None:
                return
            self._failure = reason
            callbacks, self._on_failure = self._on_failure, []
        log.error("tensor-parallel group failed: %s; the service stops serving", reason)
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - a callback must not stop the teardown
                log.exception("failure callback raised")
        self._teardown_thread = threading.Thread(target=self._teardown, name="tp-teardown", daemon=True)
        self._teardown_thread.start()

    def _teardown(self) -> None:
        self._stopping.set()
        self._launcher.stop(grace_s=1.0)  # the survivors are out of step: stop them (this also unblocks rank 0)
        if self._lock.acquire(timeout=self.timeout_s + 5):  # wait for a step stuck in a collective to give up
            try:
                destroy_process_group()
            finally:
                self._lock.release()
            log.info("process group destroyed")
        else:
            log.error("a step is still stuck in a collective after %.0fs; leaving the process group", self.timeout_s)

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        """One unit of work on the group; an error inside it fails the group (the ranks are out of step)."""
        self.raise_if_failed()
        if not self._lock.acquire(timeout=self.timeout_s):
            self.fail(f"rank 0 waited {self.timeout_s:.0f}s for the previous step")
            self.raise_if_failed()
        try:
            self.raise_if_failed()
            self._step_started = time.monotonic()
            try:
                yield
            except Exception as error:
                self.fail(f"rank 0: {type(error).__name__}: {error}")
                raise DownstreamUnavailableError(f"tensor-parallel ranks unavailable: {self._failure}") from error
        finally:
            self._step_started = None
            self._last_step_ended = time.monotonic()
            self._lock.release()

    def _watch(self) -> None:
        """The monitor thread: dead ranks, steps past the timeout, heartbeats when idle."""
        heartbeat_every = self.timeout_s / 3
        while not self._stopping.wait(MONITOR_PERIOD_S):
            exited = self._launcher.exited_ranks()
            if exited:
                self.fail("; ".join(f"rank {rank} {why}" for rank, why in sorted(exited.items())))
                return
            started = self._step_started
            if started is not None and time.monotonic() - started > self.timeout_s:
                self.fail(f"a step has run for over {self.timeout_s:.0f}s: a rank hangs")
                return
            if time.monotonic() - self._last_step_ended > heartbeat_every and self._lock.acquire(blocking=False):
                try:
                    self._channel.send(Heartbeat())
                    self._channel.barrier()
                except Exception as error:  # noqa: BLE001 - any error here means a rank is gone
                    self._lock.release()
                    self.fail(f"heartbeat: {type(error).__name__}: {error}")
                    return
                self._last_step_ended = time.monotonic()
                self._lock.release()

    # --- shutdown ---------------------------------------------------------------------------------------

    def close(self, grace_s: float = 10.0) -> None:
        """Tells the ranks to leave, waits for them (or, after a failure, for the teardown), destroys the group."""
        self._stopping.set()
        self._monitor.join()
        with self._failure_lock:
            failed = self._failure is not None
            if not failed:
                self._failure = "the service is shutting down"
                self._on_failure = []
        if failed:
            if self._teardown_thread is not None:
                self._teardown_thread.join(self.timeout_s + 10)
            return
        if self._lock.acquire(timeout=self.timeout_s):
            try:
                self._channel.send(Shutdown())
            except Exception as error:  # noqa: BLE001
                log.warning("could not tell the ranks to shut down: %s", error)
            finally:
                self._lock.release()
        self._launcher.stop(grace_s)
        destroy_process_group()


def _wait_for_ranks(store: dist.TCPStore, launcher: RankLauncher, world_size: int, timeout_s: float) -> None:
    """Waits until ranks 1..N-1 reached the rendezvous, failing fast when one of them exits first."""
    keys = [STARTED_KEY.format(rank=rank) for rank in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        exited = launcher.exited_ranks()
        if exited:
            raise RuntimeError(
                "tensor-parallel ranks exited before joining: "
                + "; ".join(f"rank {rank} {why}" for rank, why in sorted(exited.items()))
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"tensor-parallel ranks did not join within {timeout_s:.0f}s")
        time.sleep(MONITOR_PERIOD_S)
