"""What one packed pass costs on a placement: a roofline of its GPUs (docs/architecture.md, "The accelerator twin").

A pass streams the weights once and every row's cached keys and values, and computes 2 FLOPs per weight per token
fed (the LM head only for the rows whose logits are kept) plus attention; it takes the longer of the two at the
achieved bandwidth and tensor throughput, plus a fixed launch cost and, under tensor parallelism, two all-reduces
per layer of the step's hidden states. Work is split evenly over the tensor-parallel GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec.engine.simulated.profiles import Placement


@dataclass(frozen=True)
class PassRow:
    """One row of a pass: tokens fed, positions already cached, and how many of its last positions keep logits."""

    new_tokens: int
    cached: int
    kept: int = 1


@dataclass(frozen=True)
class PassCost:
    """A pass's modelled time (seconds) and its parts."""

    memory_s: float  # weights + KV read at the achieved bandwidth
    compute_s: float  # FLOPs at the achieved tensor throughput
    all_reduce_s: float
    launch_s: float

    @property
    def seconds(self) -> float:
        return self.launch_s + max(self.memory_s, self.compute_s) + self.all_reduce_s


class CostModel:
    """The roofline of one placement."""

    def __init__(self, placement: Placement):
        self.placement = placement

    def pass_cost(self, rows: Sequence[PassRow]) -> PassCost:
        """The cost of one pass over `rows`."""
        placement = self.placement
        model, gpu, tp = placement.model, placement.gpu, placement.tensor_parallel
        tokens = sum(row.new_tokens for row in rows)
        kept = sum(row.kept for row in rows)
        attended = sum(row.cached + row.new_tokens for row in rows)  # positions whose keys and values are read
        read = model.bytes_read_per_pass + attended * model.kv_bytes_per_position
        # Attention: QK^T and PV, 2 FLOPs a multiply-add, each new token against its row's positions so far.
        attention_pairs = sum(row.new_tokens * (row.cached + (row.new_tokens + 1) / 2) for row in rows)
        flops = (
            2 * model.layers * model.layer_params * tokens
            + 2 * model.embedding_params * kept
            + 4 * model.layers * model.heads * model.head_dim * attention_pairs
        )
        all_reduce = 0.0
        if tp > 1:
            ring_bytes = tokens * model.hidden * model.bytes_per_value * 2 * (tp - 1) / tp
            all_reduce = (
                2 * model.layers * (placement.all_reduce_latency_s + ring_bytes / placement.all_reduce_bytes_per_s)
            )
        return PassCost(
            memory_s=read / tp / (gpu.bandwidth_bytes_per_s * gpu.bandwidth_share),
            compute_s=flops / tp / (gpu.bf16_flops_per_s * gpu.compute_share),
            all_reduce_s=all_reduce,
            launch_s=placement.launch_s,
        )

    def seconds(self, rows: Sequence[PassRow]) -> float:
        return self.pass_cost(rows).seconds

    def decode_step_s(self, cached: int = 0, rows: int = 1) -> float:
        """One decode step of `rows` sequences holding `cached` positions each."""
        return self.seconds([PassRow(1, cached)] * rows)

    def plain_decoding_s(self, prompt_tokens: int, new_tokens: int) -> float:
        """Ideal plain decoding of one request: the prompt's prefill (which gives the first token), then one step per
        further token, nothing between the passes."""
        total = self.seconds([PassRow(prompt_tokens, 0)])
        for index in range(1, new_tokens):
            total += self.decode_step_s(prompt_tokens + index - 1)
        return total
