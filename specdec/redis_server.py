"""A throwaway real `redis-server` on a free loopback port (tests and `python -m specdec up` without a URL).

    with RedisServer() as redis:        # redis.url == "redis://127.0.0.1:PORT/0"
        ...

It runs in a temporary directory with persistence off, and `stop()` (or leaving the block) ends it and
removes the directory. `kill()` ends it at once, like a crash; `start()` again brings it back on the same port.
"""

from __future__ import annotations

import pathlib
import shutil
import socket
import subprocess
import tempfile
import time

import redis


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RedisServer:
    """One redis-server process bound to 127.0.0.1 in a temporary directory."""

    def __init__(self, port: int | None = None, executable: str = "redis-server", startup_timeout_s: float = 10.0):
        path = shutil.which(executable)
        if path is None:
            raise FileNotFoundError(
                f"{executable} not found on PATH: install it (apt-get install redis-server, "
                "as scripts/bootstrap.sh does) or give a Redis URL"
            )
        self.executable = path
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self.directory = pathlib.Path(tempfile.mkdtemp(prefix="specdec-redis-"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> RedisServer:
        """Starts the server and waits until it answers PING."""
        if self.running:
            return self
        log = open(self.directory / "redis.log", "ab")
        self.process = subprocess.Popen(
            [
                self.executable,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.directory),
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--protected-mode",
                "yes",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.directory,
        )
        log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, socket_connect_timeout=1)
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}:\n{self.log_tail()}")
                try:
                    if client.ping():
                        return self
                except redis.exceptions.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise TimeoutError(
                        f"redis-server did not answer within {self.startup_timeout_s:.0f}s:\n{self.log_tail()}"
                    )
                time.sleep(0.05)
        finally:
            client.close()

    def log_tail(self, chars: int = 2000) -> str:
        path = self.directory / "redis.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def kill(self) -> None:
        """Ends the server at once (SIGKILL), as a crash would; `start()` brings it back on the same port."""
        if self.running:
            self.process.kill()
            self.process.wait()

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it lingers; removes the temporary directory."""
        if self.running:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
