"""Process harness of the contract suite: real `python -m specdec serve ...` processes and a real redis-server.

Everything here is what a user of the public API has: the command line, the port line a service prints on
stdout ("... listening on port N"), the generated gRPC stubs and grpc.health.v1. Nothing imports the services'
code. Every process binds 127.0.0.1, every wait is bounded, and `ProcessGroup.close()` ends whatever is left.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import pathlib
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from specdec.local_stack import wait_serving
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, drafter_pb2_grpc, verifier_pb2_grpc

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGET_DIR = REPO_ROOT / "models" / "demo-target"
DRAFT_DIR = REPO_ROOT / "models" / "demo-draft"
LOOPBACK = "127.0.0.1"
PORT_LINE = re.compile(r"listening on port (\d+)")
T = TypeVar("T")
START_TIMEOUT_S = 240.0  # a cold start builds the attention kernel; two cores are shared by every process
# Journal settings every coordinator of the suite runs with: a SIGKILLed coordinator's lease runs out fast.
JOURNAL_ARGS = ("--lease-s", "2", "--lease-wait-s", "8", "--registry-ttl-s", "3", "--registry-refresh-s", "0.5")


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


@dataclass
class Process:
    """One child process, its log file and (for a gRPC service) the port it reported."""

    name: str
    popen: subprocess.Popen
    log_path: pathlib.Path
    port: int = 0

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash: no drain, no cleanup."""
        if self.alive:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (the service drains), then SIGKILL if it lingers."""
        if self.alive:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def _pump(stream, log_path: pathlib.Path, ports: queue.Queue) -> None:
    """Copies a child's stdout into its log and hands over the first port line (runs on a daemon thread)."""
    with open(log_path, "a", encoding="utf-8", errors="replace") as log:
        for line in stream:
            log.write(line)
            log.flush()
            match = PORT_LINE.search(line)
            if match:
                ports.put(int(match.group(1)))
    ports.put(None)  # stdout closed: the process is gone


@dataclass
class ProcessGroup:
    """Every process the suite starts, so that one `close()` ends them all."""

    log_dir: pathlib.Path = field(default_factory=lambda: pathlib.Path(tempfile.mkdtemp(prefix="specdec-contract-")))
    processes: list[Process] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        atexit.register(self.close)  # also when pytest ends without running its finalizers

    def _log_path(self, name: str) -> pathlib.Path:
        with self._lock:
            index = sum(1 for p in self.processes if p.name.split("#")[0] == name)
        return self.log_dir / f"{name}-{index}-{time.monotonic_ns()}.log"

    def _register(self, process: Process) -> Process:
        with self._lock:
            self.processes.append(process)
        return process

    def serve(self, kind: str, *args: str, name: str = "", timeout_s: float = START_TIMEOUT_S) -> Process:
        """`python -m specdec serve KIND --address 127.0.0.1:0 ARGS`; waits for its port line."""
        name = name or kind
        log_path = self._log_path(name)
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "specdec", "serve", kind, "--address", f"{LOOPBACK}:0", *args],
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,  # a Ctrl-C of pytest reaches it through close(), not twice
            )
        process = self._register(Process(name, popen, log_path))
        ports: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(popen.stdout, log_path, ports), daemon=True).start()
        try:
            port = ports.get(timeout=timeout_s)
        except queue.Empty:
            process.kill()
            raise TimeoutError(f"{name} reported no port within {timeout_s:.0f}s:\n{process.log_tail()}") from None
        if port is None:
            popen.wait(timeout=10)
            raise RuntimeError(f"{name} exited with {popen.returncode} before serving:\n{process.log_tail()}")
        process.port = port
        wait_serving(process.address, timeout_s=30)
        return process

    def redis(self, timeout_s: float = 15.0) -> RedisProcess:
        """A real redis-server on a free loopback port, persistence off, in a directory of its own."""
        executable = shutil.which("redis-server")
        if executable is None:
            raise FileNotFoundError("redis-server is not on PATH (apt-get install redis-server)")
        directory = pathlib.Path(tempfile.mkdtemp(prefix="redis-", dir=self.log_dir))
        port = free_port()
        log_path = directory / "redis.log"
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                [executable, "--port", str(port), "--bind", LOOPBACK, "--dir", str(directory), "--save", ""]
                + ["--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=directory,
                start_new_session=True,
            )
        process = self._register(RedisProcess("redis", popen, log_path, port))
        deadline = time.monotonic() + timeout_s
        while not process.ping():
            if not process.alive or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"redis-server did not answer PING:\n{process.log_tail()}")
            time.sleep(0.05)
        return process

    def close(self) -> None:
        """SIGKILLs every process still running (the suite keeps no state worth draining)."""
        with self._lock:
            processes = list(self.processes)
        for process in processes:
            if process.alive:
                process.popen.send_signal(signal.SIGKILL)
        for process in processes:
            try:
                process.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


class RedisProcess(Process):
    """The redis-server child; `url` is what coordinators take as --redis-url."""

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def ping(self) -> bool:
        try:
            with socket.create_connection((LOOPBACK, self.port), timeout=1) as connection:
                connection.sendall(b"PING\r\n")
                return connection.recv(64).startswith(b"+PONG")
        except OSError:
            return False


def in_parallel(*starts: Callable[[], T]) -> list[T]:
    """Runs several starts at once (each mostly waits for imports and model loading)."""
    with concurrent.futures.ThreadPoolExecutor(len(starts)) as pool:
        return [future.result() for future in [pool.submit(start) for start in starts]]


# --- the public API -------------------------------------------------------------------------------------------


def request(
    prompt: str | Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    num_speculative_tokens: int | None = None,
    **fields,
) -> coordinator_pb2.GenerateRequest:
    """A GenerateRequest: a str prompt is text, a sequence of ints is token ids; unset optional fields stay
    unset; `fields` are GenerateRequest's other fields (stop, draft_method, request_id, include_stats)."""
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    prompt_field = (
        dict(text=prompt) if isinstance(prompt, str) else dict(token_ids=coordinator_pb2.TokenIds(ids=prompt))
    )
    if num_speculative_tokens is not None:
        fields["num_speculative_tokens"] = num_speculative_tokens
    return coordinator_pb2.GenerateRequest(
        max_new_tokens=max_new_tokens,
        sampling=common_pb2.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
        **prompt_field,
        **fields,
    )


class Coordinator:
    """A channel to a coordinator and its stub."""

    def __init__(self, address: str, process: Process | None = None):
        self.address = address
        self.process = process
        self.channel = grpc.insecure_channel(address)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)

    def info(self) -> coordinator_pb2.CoordinatorInfo:
        return self.stub.Info(common_pb2.InfoRequest(), timeout=10)

    def generate(self, message: coordinator_pb2.GenerateRequest, timeout_s: float = 120.0):
        return self.stub.Generate(message, timeout=timeout_s)

    def stream(self, message: coordinator_pb2.GenerateRequest, timeout_s: float = 120.0):
        return self.stub.GenerateStream(message, timeout=timeout_s)

    def stream_all(self, message: coordinator_pb2.GenerateRequest, timeout_s: float = 120.0) -> list:
        return list(self.stream(message, timeout_s))

    def close(self) -> None:
        self.channel.close()


def joined(chunks: Iterable) -> tuple[list[int], str]:
    """The token ids and text of stream chunks, concatenated."""
    chunks = list(chunks)
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)


def replica_info(address: str) -> common_pb2.ServiceInfo:
    """A Drafter's or Verifier's Info."""
    with grpc.insecure_channel(address) as channel:
        for stub_type in (verifier_pb2_grpc.VerifierStub, drafter_pb2_grpc.DrafterStub):
            try:
                return stub_type(channel).Info(common_pb2.InfoRequest(), timeout=5)
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
    raise RuntimeError(f"{address} serves neither Verifier nor Drafter")


def replica_load(address: str) -> tuple[int, int]:
    """(active_sessions, kv_cache_tokens) of a Drafter or Verifier."""
    info = replica_info(address)
    return info.active_sessions, info.kv_cache_tokens
