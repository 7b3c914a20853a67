"""Service processes at fixed loopback ports that a benchmark kills, drains and restarts (benchmarks/survival.py).

A restarted process comes back at the address its callers know, as a pod behind a stable Service name would. Every
process is pinned to the cores its role gets (benchmarks/stack_runs.pinned_cores) and logs into one folder.
"""

from __future__ import annotations

import pathlib
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from specdec.local_stack import start_service, wait_serving
from specdec.redis_server import free_port

MODULES = {"draft": "draft_service", "verify": "verify_service", "coordinator": "coordinator"}


@dataclass
class FleetProcess:
    """One service: its kind, name, flags, fixed port, and the process running it now (None while down)."""

    kind: str
    name: str
    args: tuple[str, ...]
    log_dir: pathlib.Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    starts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout_s: float = 300.0) -> FleetProcess:
        """Starts it and waits until it reports its port and says SERVING."""
        with self.lock:
            self.starts += 1
            name = f"{self.name}-{self.starts}"
            args = [*self.args, "--address", self.address]
            self.process = start_service(name, MODULES[self.kind], args, self.log_dir, timeout_s).process
        wait_serving(self.address, timeout_s)
        return self

    def kill(self) -> None:
        """SIGKILL: a crash, nothing drained."""
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)

    def terminate(self, timeout_s: float) -> tuple[int, float]:
        """SIGTERM and the wait for the process to exit by itself: (exit code, seconds it took)."""
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=timeout_s)
        return code, time.monotonic() - started


def stop_all(processes: list[FleetProcess]) -> None:
    """SIGKILLs whatever is still running (coordinators first)."""
    for process in sorted(processes, key=lambda p: p.kind != "coordinator"):
        process.kill()
