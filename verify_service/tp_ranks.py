"""Every rank of the tensor-parallel verify service: joining the group, loading a shard, and (ranks 1..N-1)
replaying rank 0's steps on a mirror of its caches until told to stop."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specdec.common.startup_objects import freeze_startup_objects
from specdec.engine.model_runtime import Cache, LoadedModel, ModelSettings
from verify_service.tp_protocol import ControlChannel, Heartbeat, Shutdown, Step

log = logging.getLogger(__name__)

STARTED_KEY = "specdec/started/{rank}"  # set in the rendezvous store by each rank before it joins


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


class RankOutOfStepError(RuntimeError):
    """A worker's caches do not match what a Step assumes: it missed a message."""


class CacheMirror:
    """A worker rank's caches, numbered as rank 0 numbered them, each step replayed as rank 0 ran it."""

    def __init__(self, model: LoadedModel):
        self.model = model
        self.caches: dict[int, Cache] = {}

    def apply(self, step: Step) -> None:
        """Replays the step's cache opens and releases in order, crops its rows' caches, runs the same pass."""
        for event in step.cache_events:
            if event.opened:
                self.caches[event.cache_id] = self.model.new_cache()
            else:
                self.caches.pop(event.cache_id, None)
        rows = []
        for row in step.rows:
            cache = self.caches.get(row.cache_id)
            held = -1 if cache is None else cache.get_seq_length()
            if held < row.start_len:
                raise RankOutOfStepError(
                    f"cache {row.cache_id}: holds {'nothing' if cache is None else held} "
                    f"positions, rank 0 starts at {row.start_len}"
                )
            if held > row.start_len:
                cache.crop(row.start_len - held)
            rows.append((row.token_ids, cache, row.logit_rows))
        if rows:
            self.model.forward_rows(rows)  # the same pass as rank 0's, so the same collectives


def serve_rank(spec: RankSpec) -> None:
    """A worker rank's whole life: join, load the shard, report, replay rank 0's steps until Shutdown."""
    logging.basicConfig(
        level=spec.log_level.upper(), format=f"%(asctime)s %(levelname)s rank{spec.rank} %(name)s: %(message)s"
    )
    channel = join_group(spec)
    try:
        model = load_shard(spec)
        channel.gather(describe_rank(spec, model))
        channel.set_timeout(spec.timeout_s)
        mirror = CacheMirror(model)
        freeze_startup_objects()
        while True:
            op = channel.receive()  # times out when rank 0 sends nothing, not even a heartbeat
            if isinstance(op, Shutdown):
                log.info("shutting down")
                return
            if isinstance(op, Heartbeat):
                channel.barrier()
            elif isinstance(op, Step):
                mirror.apply(op)
            else:
                raise TypeError(f"not an op a rank runs: {op!r}")
    except Exception:
        log.exception("rank %d leaves the group", spec.rank)
        raise
    finally:
        destroy_process_group()
