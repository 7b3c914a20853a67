"""Two ways to start ranks 1..N-1 of the tensor-parallel verify service; rank 0 is always this process.

- `LocalLauncher`: spawned processes on this node (rank r on cuda:r on GPU). For one machine or one pod.
- `RayLauncher`: a placement group with one bundle per rank (bundle 0 holds rank 0's share, which this
  process uses) and one actor per other rank in its bundle; the actors join the process group over
  TCP. The path for multi-node and for Kubernetes with KubeRay. Bundle 0 asks for a custom resource that only
  this process's Ray node offers (`--tp-ray-rank0-resource`), so the GPU it reserves is one of this node's.

Both report ranks whose process is gone (`exited_ranks`), which the leader's monitor polls.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Sequence

from verify_service.settings import VerifySettings
from verify_service.tensor_parallel import RankLauncher
from verify_service.tp_ranks import RankSpec, serve_rank

log = logging.getLogger(__name__)


def make_launcher(settings: VerifySettings) -> RankLauncher:
    if settings.tp_launcher == "ray":
        return RayLauncher(
            settings.tensor_parallel_size,
            settings.tp_ray_address,
            settings.tp_ray_placement_strategy,
            use_gpus=settings.device.startswith("cuda"),
            start_timeout_s=settings.tp_start_timeout_s,
            rank0_resource=settings.tp_ray_rank0_resource,
        )
    return LocalLauncher()


def _stdout_to_stderr() -> None:
    """A rank writes nothing to stdout: the service's stdout carries only its port line."""
    sys.stdout.flush()
    os.dup2(2, 1)


class LocalLauncher:
    """Ranks 1..N-1 as processes spawned on this node; they die with this process (Linux parent-death signal)."""

    def __init__(self) -> None:
        self.processes: dict[int, multiprocessing.Process] = {}

    def default_master_addr(self) -> str:
        return "127.0.0.1"

    def local_rank(self, rank: int) -> int:
        return rank

    def start(self, specs: Sequence[RankSpec]) -> None:
        context = multiprocessing.get_context("spawn")
        for spec in specs:
            process = context.Process(target=_run_local_rank, args=(spec,), name=f"verify-rank{spec.rank}", daemon=True)
            process.start()
            self.processes[spec.rank] = process

    def exited_ranks(self) -> dict[int, str]:
        return {
            rank: f"exited with code {process.exitcode} (pid {process.pid})"
            for rank, process in self.processes.items()
            if not process.is_alive()
        }

    def stop(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes.values():
            if process.is_alive():
                process.kill()  # SIGKILL also ends a stopped (hung) process
            process.join(5)


def _run_local_rank(spec: RankSpec) -> None:
    if sys.platform.startswith("linux"):  # die with rank 0 even when it is SIGKILLed
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    _stdout_to_stderr()
    serve_rank(spec)


class RankActor:
    """One rank in a Ray actor: `run` is the rank's whole life (it returns at Shutdown, raises on failure)."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, spec: RankSpec) -> int:
        _stdout_to_stderr()
        serve_rank(spec)
        return spec.rank


class RayLauncher:
    """Ranks 1..N-1 as Ray actors, one per bundle of a placement group with one bundle per rank."""

    def __init__(
        self,
        world_size: int,
        address: str = "",
        strategy: str = "PACK",
        use_gpus: bool = False,
        start_timeout_s: float = 300.0,
        rank0_resource: str = "",
    ):
        self.world_size = world_size
        self.address = address
        self.strategy = strategy
        self.use_gpus = use_gpus
        self.start_timeout_s = start_timeout_s
        self.rank0_resource = rank0_resource  # a Ray custom resource only this process's node offers
        self.placement_group = None
        self.actors: dict[int, object] = {}
        self.runs: dict[int, object] = {}  # rank -> ObjectRef of RankActor.run
        self._exited: dict[int, str] = {}
        self._started_ray = False
        self._rank0_gpu = 0  # the GPU index bundle 0 holds, which rank 0 (this process) uses

    def _connect(self) -> None:
        import ray

        if ray.is_initialized():
            return
        if self.address:
            ray.init(address=self.address, logging_level=logging.WARNING)
        else:  # a local Ray instance sized to the ranks: one CPU per rank
            ray.init(
                num_cpus=self.world_size,
                num_gpus=self.world_size if self.use_gpus else 0,
                resources={self.rank0_resource: 1} if self.rank0_resource else None,
                include_dashboard=False,
                logging_level=logging.WARNING,
            )
            self._started_ray = True

    def _check_rank0_resource(self) -> None:
        """Refuses (RuntimeError) to start where this process's Ray node does not offer the rank-0 resource: bundle 0
        would then wait for a node that never comes, or hold a GPU of another node."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        offering = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(self.rank0_resource, 0) >= 1]
        if here not in offering:
            raise RuntimeError(
                f"tp_ray_rank0_resource: this process's Ray node {here} does not offer the resource "
                f"{self.rank0_resource!r} (nodes that do: {', '.join(offering) or 'none'}); start its Ray node with "
                f"--resources='{{\"{self.rank0_resource}\": 1}}' (KubeRay: the head group's `resources`), run the "
                "verify service in the node that has it, or set tp_ray_rank0_resource to ''"
            )

    def _reserve(self) -> None:
        """Reserves the placement group (once) and finds where bundle 0, rank 0's share, landed."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.placement_group is not None:
            return
        self._connect()
        bundle = {"CPU": 1, **({"GPU": 1} if self.use_gpus else {})}
        bundles = [dict(bundle) for _ in range(self.world_size)]
        if self.rank0_resource:
            self._check_rank0_resource()
            bundles[0][self.rank0_resource] = 1
        self.placement_group = placement_group(bundles, strategy=self.strategy)
        ray.get(self.placement_group.ready(), timeout=self.start_timeout_s)

        def bundle_zero() -> tuple[str, list]:  # a nested function travels by value: the probe imports only ray
            return ray.get_runtime_context().get_node_id(), ray.get_gpu_ids()

        probe = ray.remote(bundle_zero).options(
            num_cpus=1,
            num_gpus=1 if self.use_gpus else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=0),
        )
        node_id, gpu_ids = ray.get(probe.remote(), timeout=self.start_timeout_s)
        here = ray.get_runtime_context().get_node_id()
        if node_id != here:
            self.stop(0)
            raise RuntimeError(
                f"bundle 0 (the GPU rank 0 uses) was reserved on Ray node {node_id}, but rank 0 is this process on "
                f"node {here}: its GPU could be another rank's; pin bundle 0 with tp_ray_rank0_resource"
            )
        self._rank0_gpu = int(gpu_ids[0]) if gpu_ids else 0

    def default_master_addr(self) -> str:
        import ray

        self._connect()
        return ray.util.get_node_ip_address()

    def local_rank(self, rank: int) -> int:
        """Rank 0 uses bundle 0's GPU; an actor sees only its own GPU (Ray sets CUDA_VISIBLE_DEVICES): cuda:0."""
        if rank == 0:
            self._reserve()
            return self._rank0_gpu
        return 0

    def start(self, specs: Sequence[RankSpec]) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._reserve()
        actor_class = ray.remote(RankActor)
        for spec in specs:
            actor = actor_class.options(
                num_cpus=1,
                num_gpus=1 if self.use_gpus else 0,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=spec.rank
                ),
            ).remote()
            self.actors[spec.rank] = actor
            self.runs[spec.rank] = actor.run.remote(spec)
        log.info(
            "placed %d rank actors in a %s placement group of %d bundles", len(specs), self.strategy, self.world_size
        )

    def exited_ranks(self) -> dict[int, str]:
        import ray

        pending = [ref for rank, ref in self.runs.items() if rank not in self._exited]
        if pending:
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
            for rank, ref in self.runs.items():
                if ref in done and rank not in self._exited:
                    try:
                        ray.get(ref, timeout=0)
                        self._exited[rank] = "left the group"
                    except Exception as error:  # noqa: BLE001 - RayActorError, RayTaskError...
                        self._exited[rank] = f"actor failed: {type(error).__name__}: {str(error).splitlines()[0]}"
        return dict(self._exited)

    def stop(self, grace_s: float) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        if self.runs:
            ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=grace_s)
        for actor in self.actors.values():
            try:
                ray.kill(actor)
            except Exception as error:  # noqa: BLE001
                log.debug("ray.kill: %s", error)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
        self.actors.clear()
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
