"""Decode and verify steps replayed from CUDA graphs, one graph per bucket of tokens (docs/architecture.md,
"CUDA graphs").

At start-up every bucket's step (specdec/engine/bucketed_step.py) runs twice eagerly (compiling its attention,
allocating the KV pool) and is then captured; all graphs share one memory pool, captured largest first. A step whose
rows each feed at most GRAPH_ROW_TOKENS tokens and that fits the largest bucket is staged into the smallest bucket that
holds it and replayed: one launch for the whole forward instead of one per kernel. Prefills and larger steps run
eagerly. Prepared without graphs (`capture(cuda_graphs=False)`), the buckets run eagerly from the same buffers on any
device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from specdec.engine.bucketed_step import KEPT, BucketInputs, bucketed_logits, token_buckets
from specdec.engine.kv.pool import KVPool, SequenceKV
from specdec.engine.packed_forward import reserved_rows
from specdec.engine.packed_step import AttentionBackend

log = logging.getLogger(__name__)

GRAPH_ROW_TOKENS = 32  # most tokens a row of a replayed step feeds (a verify block is γ + 1; prefills run eagerly)


def cuda_graphs_refusal(settings: object, device: torch.device, backend: AttentionBackend) -> str | None:
    """Why a model's steps are not captured (settings with cuda_graphs, cuda_graph_max_tokens), or None."""
    if not settings.cuda_graphs:
        return "cuda_graphs is off"
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device.type}"
    if backend.name != "flex":
        return f"CUDA graphs need the flex attention backend, not {backend.name}"
    if torch.distributed.is_initialized():
        return "CUDA graphs are not captured under tensor parallelism"
    return None


class CudaGraphSteps:
    """A model's captured steps, one per bucket, and running a step through them."""

    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        backend: AttentionBackend,
        max_tokens: int,
        max_context: int,
    ):
        self.model, self.pool, self.backend = model, pool, backend
        self.buckets = token_buckets(max_tokens)
        self.max_blocks_per_row = pool.blocks_for(max_context)
        self.graphs: dict[int, tuple[Callable[[], object], BucketInputs, torch.Tensor]] = {}  # replay, in, out
        self.replays = 0  # steps served so far

    @torch.inference_mode()
    def capture(self, cuda_graphs: bool = True) -> None:
        """Prepares every bucket's step with its fixed inputs and logits [T, V]: captured as a CUDA graph, or
        (cuda_graphs False, any device) run eagerly from the same buffers: the serving path's bookkeeping without
        the graph."""
        started = time.perf_counter()
        device = next(self.model.parameters()).device
        memory_pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        for tokens in reversed(self.buckets):
            inputs = BucketInputs(tokens, self.max_blocks_per_row, device)
            inputs.fill([], self.pool)

            def forward(inputs: BucketInputs = inputs) -> torch.Tensor:
                return bucketed_logits(self.model, self.pool, self.backend, inputs.staged, inputs.tables)

            if cuda_graphs:
                replay, logits = capture_graph(forward, memory_pool)
            else:
                logits = forward()

                def replay(forward: Callable[[], torch.Tensor] = forward, logits: torch.Tensor = logits) -> None:
                    logits.copy_(forward())

            self.graphs[tokens] = (replay, inputs, logits)
        how = "captured CUDA graphs" if cuda_graphs else "prepared eager bucketed steps"
        log.info("%s for steps of %s tokens in %.1fs", how, self.buckets, time.perf_counter() - started)

    def serves(self, rows: Sequence[tuple[Sequence[int], SequenceKV, int]]) -> bool:
        """Whether a step of these rows (token ids, cache, logits kept) replays a graph: no prefill, and it fits."""
        return (
            bool(self.graphs)
            and all(len(ids) <= GRAPH_ROW_TOKENS for ids, _, _ in rows)
            and (sum(len(ids) for ids, _, _ in rows) <= self.buckets[-1])
        )

    @torch.inference_mode()
    def forward(self, rows: Sequence[tuple[Sequence[int], SequenceKV, int]]) -> list[torch.Tensor]:
        """Runs a step the graphs serve; returns per row float32 logits [keep, V], as packed_forward does."""
        total = sum(len(ids) for ids, _, _ in rows)
        replay, inputs, logits = self.graphs[next(tokens for tokens in self.buckets if tokens >= total)]
        with reserved_rows(rows):
            inputs.fill([(ids, kv.table, kv.length, keep) for ids, kv, keep in rows], self.pool)
            replay()
            self.replays += 1
            kept = logits[inputs.staged[KEPT, : sum(keep for _, _, keep in rows)]].float()  # [K, V], before a replay
            for ids, kv, _ in rows:
                kv.length += len(ids)
        return list(torch.split(kept, [keep for _, _, keep in rows]))


def capture_graph(
    forward: Callable[[], torch.Tensor], memory_pool: tuple[int, int] | None = None, warmups: int = 2
) -> tuple[Callable[[], None], torch.Tensor]:
    """forward run `warmups` times on a side stream (compiling what it compiles, allocating what it keeps), then
    captured in a CUDA graph (in memory_pool, if given); returns the graph's replay and the output it writes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=memory_pool):
        logits = forward()
    return graph.replay, logits
