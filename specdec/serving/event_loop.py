"""Which asyncio event loop a service runs on: uvloop (libuv's, written in Cython) by default, or asyncio's own.

Each round of a request wakes the event loops of the coordinator and both replicas several times (a call's
arrival, the model thread's answer, the reply); on an accelerator, where a step takes milliseconds, that host work
adds up per token (docs/architecture.md, "The serving path's cost per round"). uvloop runs the same callbacks with
less Python per wake-up, as vLLM's and SGLang's API servers run theirs; grpc.aio works on any asyncio loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from specdec.common.settings import setting

EVENT_LOOPS = ("uvloop", "asyncio")


@dataclass(frozen=True)
class EventLoopSettings:
    """The event-loop part of a service's settings (a base of each service's settings class)."""

    event_loop: str = setting("uvloop", "the service's asyncio event loop: uvloop or asyncio (the standard one)")


def run_service(main: Coroutine[Any, Any, None], event_loop: str) -> None:
    """Runs a service's main coroutine to completion on the chosen event loop."""
    if event_loop not in EVENT_LOOPS:
        main.close()
        raise ValueError(f"event_loop must be one of {', '.join(EVENT_LOOPS)}, got {event_loop!r}")
    if event_loop == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)
