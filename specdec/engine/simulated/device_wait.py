"""Waiting for a modelled pass as a host waits for a GPU: the calling thread sleeps, holding no lock and not the
interpreter's, until the pass's end.

Linux lets a sleeping thread wake up to 50 µs late (its timer slack) so that wake-ups can be batched; against a
1 ms draft step that is 5 %. The waiting thread asks for a slack of 1 µs once (prctl PR_SET_TIMERSLACK), as a
GPU's completion interrupt would not wait either; elsewhere it keeps the default.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time

_PR_SET_TIMERSLACK = 29
_SLACK_NS = 1000
_tight = threading.local()


def _tighten_timer_slack() -> None:
    """Once per thread: a 1 µs timer slack where the platform has one to set."""
    if getattr(_tight, "done", False):
        return
    _tight.done = True
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, _SLACK_NS, 0, 0, 0)


def wait_until(deadline: float) -> None:
    """Sleeps until time.perf_counter() reaches `deadline` (returns at once if it has)."""
    _tighten_timer_slack()
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)
