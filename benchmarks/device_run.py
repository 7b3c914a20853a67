"""What a run on a lent GPU machine needs around its measurements: a budget that counts everything (loading, cold
compiles, each attempt) and cuts the run short at its end, and a report written into `--out-dir` after every phase,
so a run stopped at any point leaves every result it reached (benchmarks/gpu_check.py, benchmarks/gpu_step.py).

Imports only torch at module level: the GPU machine has torch, transformers and triton, not the serving packages.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import signal
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable

import torch

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


class BudgetSpent(BaseException):
    """The run's budget ran out (raised in the main thread by the budget's alarm). Not an Exception, so the code
    under measurement, which turns failures into reasons (a self-test, a capture), lets it through."""


class Clock:
    """Seconds since the run started against its budget, progress lines stamped with both, and an alarm that
    raises BudgetSpent in the main thread when the budget is spent, whatever runs then."""

    def __init__(self, budget_s: float):
        self.started = time.monotonic()
        self.budget_s = budget_s
        self.deadline = self.started + budget_s
        self._handler = signal.SIG_DFL

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)

    def arm(self) -> None:
        """Raise BudgetSpent at the deadline (a budget of 0 or less raises at the next check instead)."""

        def spent(signum, frame) -> None:
            raise BudgetSpent(f"budget of {self.budget_s:g}s spent")

        self._handler = signal.signal(signal.SIGALRM, spent)
        signal.setitimer(signal.ITIMER_REAL, max(self.left(), 0.001))

    def disarm(self) -> None:
        """No alarm any more; SIGALRM's handler as it was before arm."""
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._handler)


class PhasedReport:
    """A report of named phases, written whole to out_dir/name after each phase (and when a run is cut short)."""

    def __init__(self, path: pathlib.Path, clock: Clock, **header):
        self.path, self.clock = path, clock
        self.data: dict = {**header, "phases": {}, "phases_s": {}}
        path.parent.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, phase: Callable[[], dict]) -> dict | None:
        """Runs one phase: its figures, or its error (the run goes on), into the report, written at once. A spent
        budget is recorded as this phase's and raised on."""
        started = time.monotonic()
        self.clock.log(f"phase {name}")
        try:
            figures = phase()
        except BudgetSpent as error:
            self.data["phases"][name] = {**self._partial(name), "error": f"cut short: {error}"}
            self.write()
            raise
        except Exception as error:  # a phase that fails on this machine is reported, not fatal
            figures = {
                **self._partial(name),
                "error": f"{type(error).__name__}: {error}"[:2000],
                "traceback": traceback.format_exc()[-3000:],
            }
            self.clock.log(f"phase {name} failed: {figures['error']}")
        self.data["phases"][name] = figures
        self.data["phases_s"][name] = round(time.monotonic() - started, 2)
        self.write()
        return None if "error" in figures else figures

    def _partial(self, name: str) -> dict:
        """What a phase put in the report itself before it stopped (a phase may fill its entry as it goes)."""
        partial = self.data["phases"].get(name)
        return dict(partial) if isinstance(partial, dict) else {}

    def skip(self, name: str, why: str) -> None:
        self.data["phases"][name] = {"skipped": why}
        self.write()

    def write(self) -> None:
        self.data["wall_s"] = round(time.monotonic() - self.clock.started, 2)
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")


def run_within_budget(report: PhasedReport, body: Callable[[], None]) -> dict:
    """Runs `body` (which runs the phases) with the budget's alarm armed; a spent budget ends it there, saying so
    in the report (`cut_short`). The report is written whatever happens; returns its data."""
    clock = report.clock
    clock.arm()
    try:
        body()
    except BudgetSpent as error:
        report.data["cut_short"] = str(error)
        clock.log(f"stopped: {error}")
    finally:
        clock.disarm()
        report.write()
    clock.log(f"wrote {report.path}")
    return report.data


def out_dir_of(given: pathlib.Path | None, name: str) -> pathlib.Path:
    """--out-dir, else $OUT (what a lent machine sends back), else a temporary folder: never the repository,
    whose results are committed deliberately."""
    if given is not None:
        return given
    return pathlib.Path(os.environ.get("OUT") or tempfile.gettempdir()) / name


def environment(device: torch.device) -> dict:
    """What the figures were measured on: device, versions, commit."""
    import importlib.metadata

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    figures = {
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **{name: version(name) for name in ("transformers", "triton", "grpcio", "protobuf")},
        "git_commit": commit.stdout.strip() or None,
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        figures["capability"] = f"sm{properties.major}{properties.minor}"
        figures["memory_gib"] = round(properties.total_memory / 2**30, 1)
    return figures
