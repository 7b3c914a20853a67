"""Pinning a service process to chosen CPU cores (like `taskset -c`), so services that share a machine each
compute on cores of their own instead of taking turns on the same ones."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from specdec.common.settings import setting

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuAffinitySettings:
    """The pinning part of a service's settings (a base of each one's settings class)."""

    cpus: str = setting(
        "", "CPU cores this service and the processes it starts run on, e.g. '1' or '0,2-3' (empty: any core)"
    )


def parse_cpus(spec: str, field: str = "cpus") -> set[int]:
    """'0,2-3' -> {0, 2, 3}; ValueError naming `field` when malformed."""
    cores: set[int] = set()
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise ValueError(f"{field}: {spec!r} is not a list of cores like '0,2-3'")
        cores.update(range(int(first), int(last if dash else first) + 1))
    return cores


def pin_cpus(spec: str) -> None:
    """Restricts this process (and the ones it starts later) to the cores in spec; no-op when spec is empty."""
    if not spec:
        return
    cores = parse_cpus(spec)
    os.sched_setaffinity(0, cores)
    log.info("pinned to CPU cores %s", sorted(cores))
