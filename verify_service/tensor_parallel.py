"""Tensor parallelism for the verify service: rank 0 mirrors every target forward onto the other ranks.

The target is sharded with transformers' native tensor parallelism (`tp_plan="auto"`) over a
torch.distributed group: gloo on CPU, nccl on GPU. Each forward all-reduces inside the model, so every
rank must run the same forwards in the same order. Rank 0 serves gRPC and owns the sessions (tokens,
sampling settings, the rejection sampler, which runs once there); the other ranks hold only KV caches and
replay what rank 0 sends them, one `broadcast_object_list` per message on a separate gloo "control" group:

    rank 0 (TensorParallelLeader)               ranks 1..N-1 (serve_rank -> CacheMirror)
    Forward(session, start_len, token_ids)  ──▶ crop the session's cache to start_len, run the same forward
    CloseSession(session)                   ──▶ drop the session's cache
    Heartbeat()                             ──▶ monitored barrier: proves every rank is alive and listening
    Shutdown()                              ──▶ leave the loop, destroy the process group

Rank 0's KVSession calls `forward` on a `MirroredModel`, which sends the Forward first. Rollback needs no
message of its own: rank 0's cache only shrinks between forwards, so the next Forward's `start_len`
carries it (the sync invariant, inside one replica). Opening needs none either: a Forward for an unknown
session starts its cache. So a verify round (truncate -> forward -> sample -> commit) costs one message,
and the workers cannot drift from rank 0 whatever the session logic does between forwards.

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
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.distributed as dist

from specdec.errors import DownstreamUnavailableError
from specdec.model_runtime import Cache, LoadedModel, ModelSettings, forward_each_row
from verify_service.settings import VerifySettings

log = logging.getLogger(__name__)

MONITOR_PERIOD_S = 0.2  # how often rank 0 looks at the other ranks
STARTED_KEY = "specdec/started/{rank}"  # set in the rendezvous store by each rank before it joins


# ---------------------------------------------------------------------------------------------------------
# The protocol: what rank 0 sends to the other ranks.


@dataclass(frozen=True)
class Forward:
    """Run token_ids after the first start_len cached positions of a session's cache."""

    session_id: str
    start_len: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class CloseSession:
    """Drop a session's cache."""

    session_id: str


@dataclass(frozen=True)
class Heartbeat:
    """Nothing to run; every rank answers with a monitored barrier."""


@dataclass(frozen=True)
class Shutdown:
    """Leave the loop and destroy the process group."""


Op = Forward | CloseSession | Heartbeat | Shutdown


class ControlChannel:
    """The gloo group that carries ops from rank 0 (a gloo group even when the model's group is nccl)."""

    def __init__(self, timeout_s: float):
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.timeout_s = timeout_s

    def send(self, op: Op) -> None:
        dist.broadcast_object_list([op], src=0, group=self.group)

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


# ---------------------------------------------------------------------------------------------------------
# What every rank does: join the group, load its shard.


@dataclass(frozen=True)
class RankSpec:
    """What one rank needs to join the group and load its shard (picklable: it travels to the ranks)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    model: ModelSettings  # device is this rank's own (cuda:LOCAL_RANK on GPU)
    local_rank: int
    timeout_s: float
    start_timeout_s: float
    log_level: str = "INFO"

    @property
    def backend(self) -> str:
        return "nccl" if self.model.device.startswith("cuda") else "gloo"


@dataclass(frozen=True)
class RankInfo:
    """What a rank reports once its shard is loaded."""

    rank: int
    pid: int
    host: str
    device: str
    weight_bytes: int  # parameters and buffers held by this rank (its shards)


def rank_device(device: str, local_rank: int) -> str:
    """The device of the rank with that local rank: cpu stays cpu, cuda[:N] becomes cuda:LOCAL_RANK."""
    return f"cuda:{local_rank}" if device.startswith("cuda") else device


def join_group(spec: RankSpec, store: dist.Store | None = None) -> ControlChannel:
    """Joins the process group (with the start-up timeout: loading shards may be skewed) and the control group."""
    os.environ["LOCAL_RANK"] = str(spec.local_rank)  # transformers and DeviceMesh bind the accelerator by it
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.local_rank)
    start_timeout = datetime.timedelta(seconds=spec.start_timeout_s)
    if store is None:
        store = dist.TCPStore(
            spec.master_addr, spec.master_port, spec.world_size, is_master=False, timeout=start_timeout
        )
        store.set(STARTED_KEY.format(rank=spec.rank), str(os.getpid()))
    dist.init_process_group(
        spec.backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=start_timeout
    )
    return ControlChannel(spec.start_timeout_s)


def load_shard(spec: RankSpec) -> LoadedModel:
    """This rank's shard of the target (transformers' tp_plan="auto" over the whole group)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)  # standalone tp_plan= is deprecated but works
        return LoadedModel.load(spec.model, tp_plan="auto", tp_size=spec.world_size)


def local_weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters and buffers this process holds (a DTensor counts its local shard only)."""
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def describe_rank(spec: RankSpec, model: LoadedModel) -> RankInfo:
    return RankInfo(spec.rank, os.getpid(), socket.gethostname(), spec.model.device, local_weight_bytes(model.model))


def destroy_process_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as error:  # noqa: BLE001 - a broken group may fail to tear down; nothing else to do
            log.warning("destroying the process group failed: %s", error)


# ---------------------------------------------------------------------------------------------------------
# Ranks 1..N-1.


class RankOutOfStepError(RuntimeError):
    """A worker's cache is shorter than the Forward assumes: it missed a message."""


class CacheMirror:
    """A worker rank's state: one KV cache per session, extended by the forwards rank 0 sends."""

    def __init__(self, model: LoadedModel):
        self.model = model
        self.caches: dict[str, Cache] = {}

    def apply(self, op: Op) -> None:
        if isinstance(op, Forward):
            cache = self.caches.get(op.session_id)
            if cache is None:
                cache = self.caches[op.session_id] = self.model.new_cache()
            surplus = cache.get_seq_length() - op.start_len
            if surplus < 0:
                raise RankOutOfStepError(
                    f"session {op.session_id!r}: cache holds {cache.get_seq_length()} "
                    f"positions, rank 0 starts at {op.start_len}"
                )
            if surplus > 0:
                cache.crop(-surplus)
            self.model.forward(torch.tensor([op.token_ids], dtype=torch.long), cache)  # [1, T] -> same all-reduces
        elif isinstance(op, CloseSession):
            self.caches.pop(op.session_id, None)
        else:
            raise TypeError(f"not an op a mirror applies: {op!r}")


def serve_rank(spec: RankSpec) -> None:
    """A worker rank's whole life: join, load the shard, report, replay rank 0's ops until Shutdown."""
    logging.basicConfig(
        level=spec.log_level.upper(), format=f"%(asctime)s %(levelname)s rank{spec.rank} %(name)s: %(message)s"
    )
    channel = join_group(spec)
    try:
        model = load_shard(spec)
        channel.gather(describe_rank(spec, model))
        channel.set_timeout(spec.timeout_s)
        mirror = CacheMirror(model)
        while True:
            op = channel.receive()  # times out when rank 0 sends nothing, not even a heartbeat
            if isinstance(op, Shutdown):
                log.info("shutting down")
                return
            if isinstance(op, Heartbeat):
                channel.barrier()
            else:
                mirror.apply(op)
    except Exception:
        log.exception("rank %d leaves the group", spec.rank)
        raise
    finally:
        destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# Rank 0.


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


class MirroredModel:
    """Rank 0's model inside one session's KVSession: each forward is first sent, so every rank runs it."""

    def __init__(self, leader: TensorParallelLeader, session_id: str):
        self._leader = leader
        self._session_id = session_id

    def forward(self, input_ids: torch.Tensor, cache: Cache) -> torch.Tensor:
        return self._leader.forward(self._session_id, input_ids, cache)

    def forward_rows(self, rows: Sequence[tuple[Sequence[int], Cache, int]]) -> list[torch.Tensor]:
        """One mirrored forward per row (rows of one session; the ranks replay single-row forwards)."""
        return forward_each_row(self.forward, rows)

    def __getattr__(self, name: str):  # new_cache, max_context_tokens, vocab_size, ...: the real model's
        return getattr(self._leader.model, name)


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
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()

    @classmethod
    def start(cls, settings: VerifySettings, launcher: RankLauncher) -> TensorParallelLeader:
        """Starts ranks 1..N-1, joins them as rank 0, loads the shard; returns once every rank is ready."""
        world_size = settings.tensor_parallel_size
        model_settings = ModelSettings(
            settings.model, settings.device, settings.dtype, settings.threads, settings.attention_kernel
        )
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

    def session_model(self, session_id: str) -> MirroredModel:
        """The model a session's KVSession runs on."""
        return MirroredModel(self, session_id)

    def forward(self, session_id: str, input_ids: torch.Tensor, cache: Cache) -> torch.Tensor:
        """Sends the forward to every rank, then runs it here: input_ids [1, T] -> logits [T, V]."""
        op = Forward(session_id, cache.get_seq_length(), tuple(input_ids[0].tolist()))
        with self._step():
            self._channel.send(op)
            return self.model.forward(input_ids, cache)

    def close_session(self, session_id: str) -> None:
        with self._step():
            self._channel.send(CloseSession(session_id))

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
