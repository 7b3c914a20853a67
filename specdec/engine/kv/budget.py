"""How many KV blocks a model's memory budget buys, and the pool they make (see specdec/engine/kv/pool.py).

The budget is a number of bytes, or, at most 1, a share of memory:
- CUDA: the share of the device's total memory this process may hold in all, as vLLM's gpu_memory_utilization
  reads: the pool gets that share less what the process holds when it is made (weights, and the peak of the
  start-up self-test's passes), never more than is free. Two services sharing a GPU give shares that sum under 1
  (e.g. 0.45 each), whatever order they start in, instead of each taking a share of what the other left;
- CPU: that share of the machine's available memory.
"""

from __future__ import annotations

import logging
import os

import torch
from transformers import PretrainedConfig, PreTrainedModel

from specdec.engine.kv.pool import KVPool

log = logging.getLogger(__name__)


def block_bytes(config: PretrainedConfig, dtype: torch.dtype, block_size: int) -> int:
    """Bytes one block of `block_size` positions takes: keys and values of every layer and KV head."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * heads * block_size * head_dim * element


def release_cached_memory(device: torch.device) -> None:
    """Hands the memory torch's CUDA allocator caches but no tensor holds back to the device (nothing elsewhere)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def budget_bytes(budget: float, device: torch.device) -> int:
    """The budget in bytes: `budget` itself, or (at most 1) that share of memory as the module doc says.
    ValueError naming the setting where a CUDA share is already spent."""
    if budget <= 0:
        raise ValueError(f"kv_cache_budget must be > 0, got {budget}")
    if budget > 1:
        return int(budget)
    if device.type != "cuda":
        return int(budget * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.max_memory_reserved(device)  # this process's peak so far: weights, self-test passes
    allowed = int(budget * total) - held
    if allowed <= 0:
        raise ValueError(
            f"kv_cache_budget {budget:g} of {device}'s {total / 2**30:.1f} GiB is {budget * total / 2**30:.1f} GiB, "
            f"and this process holds {held / 2**30:.1f} GiB already: no room for a KV cache (--kv-cache-budget)"
        )
    return min(allowed, free)


def holds_pool_whole(device: torch.device) -> bool:
    """Whether a model's pool is allocated whole before serving (CUDA), rather than grown as blocks are used."""
    return device.type == "cuda"


def make_pool(budget: float, model: PreTrainedModel, device: torch.device, block_size: int, name: str) -> KVPool:
    """The pool of a model (called `name` in the log) on `device`, as many blocks as the budget buys (at least
    one), held whole where holds_pool_whole says; logs what it reserved."""
    config, whole = model.config, holds_pool_whole(device)
    per_block = block_bytes(config, model.dtype, block_size)
    num_blocks = max(1, budget_bytes(budget, device) // per_block)
    log.info(
        "KV cache of %s: %d blocks of %d positions, %.1f MiB (kv_cache_budget %g)%s",
        name,
        num_blocks,
        block_size,
        num_blocks * per_block / 2**20,
        budget,
        ", allocated whole before serving" if whole else "",
    )
    return KVPool(config.num_hidden_layers, num_blocks, block_size, preallocate=whole)
