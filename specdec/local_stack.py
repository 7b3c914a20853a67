"""Starts the three services as separate processes on loopback (the CLI's `up` and the end-to-end tests)."""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
_PORT_LINE = re.compile(r"listening on port (\d+)(?:, HTTP on port (\d+))?")


@dataclass
class ServiceProcess:
    """One running service: its process, port and log file."""

    name: str
    process: subprocess.Popen
    port: int
    log_path: pathlib.Path
    http_port: int | None = None  # a coordinator's OpenAI-compatible HTTP API, when it serves one

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (graceful drain), then SIGKILL if it lingers; returns the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_service(
    name: str,
    module: str,
    args: Sequence[str],
    log_dir: pathlib.Path,
    timeout_s: float = 180.0,
    env: dict[str, str] | None = None,
) -> ServiceProcess:
    """Runs `python -m module --address 127.0.0.1:0 args...` and waits for the port it reports."""
    log_path = log_dir / f"{name}.log"
    log_file = open(log_path, "ab")
    process = subprocess.Popen(
        [sys.executable, "-m", module, "--address", "127.0.0.1:0", *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=log_file,
        env={**os.environ, **(env or {})},
        text=True,
    )
    log_file.close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            raise RuntimeError(
                f"{name} exited with {process.returncode} before serving; see {log_path}:\n"
                + log_path.read_text()[-3000:]
            )
        match = _PORT_LINE.search(line)
        if match:
            http_port = int(match.group(2)) if match.group(2) else None
            return ServiceProcess(name, process, int(match.group(1)), log_path, http_port)
    process.kill()
    raise TimeoutError(f"{name} did not report a port within {timeout_s:.0f}s; see {log_path}")


def wait_serving(address: str, timeout_s: float) -> None:
    """Waits until grpc.health.v1 says SERVING for the whole server at `address` (TimeoutError after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} is not SERVING after {timeout_s:.0f}s")
            time.sleep(0.1)


@dataclass
class LocalStack:
    """Draft, verify and coordinator processes wired together on loopback: one of each, or several replicas of the
    model services (`draft`, `draft-2`, ...; `verify`, `verify-2`, ...) behind the coordinator."""

    target: str
    draft: str
    draft_args: Sequence[str] = ()
    verify_args: Sequence[str] = ()
    coordinator_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables for all three processes
    log_dir: pathlib.Path = field(default_factory=lambda: pathlib.Path(tempfile.mkdtemp(prefix="specdec-")))
    services: dict[str, ServiceProcess] = field(default_factory=dict)
    tokenizer: str = ""  # the coordinator's --tokenizer ("": the target)
    draft_replicas: int = 1
    verify_replicas: int = 1
    replica_args: dict[str, Sequence[str]] = field(default_factory=dict)  # replica name -> its own extra flags

    def replica_names(self, kind: str) -> list[str]:
        """`draft`, `draft-2`, ... (or `verify`, ...): the names of a kind's replicas."""
        count = self.draft_replicas if kind == "draft" else self.verify_replicas
        return [kind if index == 0 else f"{kind}-{index + 1}" for index in range(count)]

    def start(self) -> LocalStack:
        """Starts the replicas side by side (importing torch dominates their start-up), then the coordinator."""
        replicas = {
            name: ("draft_service", ["--model", self.draft, *self.draft_args, *self.replica_args.get(name, ())])
            for name in self.replica_names("draft")
        }
        for name in self.replica_names("verify"):
            replicas[name] = (
                "verify_service",
                ["--model", self.target, *self.verify_args, *self.replica_args.get(name, ())],
            )
        try:
            self.start_together(replicas)
            self.start_coordinator("coordinator", *self.coordinator_args)
        except BaseException:
            self.stop()
            raise
        return self

    def start_together(self, services: dict[str, tuple[str, list[str]]]) -> None:
        """Starts services (name -> module, args) side by side into `services`; raises the first failure (those
        that started stay, for stop())."""
        if not services:
            return
        with concurrent.futures.ThreadPoolExecutor(len(services)) as pool:
            started = {
                name: pool.submit(start_service, name, module, args, self.log_dir, env=self.env)
                for name, (module, args) in services.items()
            }
        for name, future in started.items():
            if future.exception() is None:
                self.services[name] = future.result()
        for future in started.values():
            future.result()

    def wiring(self, draft_replicas: int | None = None, verify_replicas: int | None = None) -> list[str]:
        """Coordinator flags naming this stack's tokenizer (the target's) and its draft and verify replicas (all, or
        the first `draft_replicas` and `verify_replicas` of them)."""
        counts = {"draft": draft_replicas, "verify": verify_replicas}
        drafts, verifies = (
            ",".join(self.services[n].address for n in self.replica_names(k)[: counts[k]]) for k in ("draft", "verify")
        )
        return ["--tokenizer", self.tokenizer or self.target, "--draft-replicas", drafts, "--verify-replicas", verifies]

    def start_coordinator(self, name: str, *args: str) -> ServiceProcess:
        """Starts a coordinator on this stack's replicas with extra flags; stop() stops it with the rest."""
        self.services[name] = start_service(name, "coordinator", [*self.wiring(), *args], self.log_dir, env=self.env)
        return self.services[name]

    def start_http_front(self, *extra_args: str) -> ServiceProcess:
        """Starts the HTTP front in a process of its own on this stack's coordinator (python -m specdec serve http)."""
        args = ["--coordinator", self.address, "--tokenizer", self.target, *extra_args]
        self.services["http"] = start_service("http", "coordinator.openai_api", args, self.log_dir, env=self.env)
        return self.services["http"]

    @property
    def address(self) -> str:
        """The coordinator's client-facing address."""
        return self.services["coordinator"].address

    @property
    def http_address(self) -> str:
        """The HTTP API's HOST:PORT: the front's own process, or the coordinator's ('' when neither serves one)."""
        if "http" in self.services:
            return self.services["http"].address
        port = self.services["coordinator"].http_port
        return f"127.0.0.1:{port}" if port else ""

    def stop(self) -> None:
        """Stops the coordinators first, then the replicas."""
        replicas = {*self.replica_names("draft"), *self.replica_names("verify")}
        for name in sorted(self.services, key=lambda name: name in replicas):
            self.services[name].stop()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def twin_stack(device: str, draft_args: Sequence[str] = (), verify_args: Sequence[str] = (), **fields) -> LocalStack:
    """A LocalStack on the accelerator twin: its replicas hold the target and the draft of the twin device
    `sim:PROFILE[:VOCAB]` (docs/architecture.md, "The accelerator twin"), and the coordinator its tokenizer."""
    on_twin = ["--device", device]
    return LocalStack("target", "draft", [*on_twin, *draft_args], [*on_twin, *verify_args], tokenizer=device, **fields)
