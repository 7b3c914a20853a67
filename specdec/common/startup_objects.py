"""Keeping the objects of a process's start-up out of the garbage collector's full passes.

A service holds about 450,000 tracked objects once it has started (torch's, transformers' and the tokenizer's Python
objects, the protobuf and gRPC modules), and nearly all of them live as long as it does. Python's collector scans
every one of them in each full (generation-2) collection, which request traffic triggers every few seconds: on the
accelerator twin at concurrency 64 such a pass held a service's event loop for 220–280 ms, and the first tokens
that waited behind it made the time to first token's p99 (docs/results.md, "The accelerator twin"). Freezing them
after start-up, as vLLM's engine does, leaves the collector only what requests allocate.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Collects once, then moves every object still alive to the permanent generation, which no collection scans.
    Call it when the process has started (models loaded, servers listening), before it serves."""
    gc.collect()
    gc.freeze()
