"""How many KV blocks a model's memory budget buys (see specdec/engine/kv/pool.py).

The budget is a number of bytes, or, at most 1, a share of the device's free memory (CUDA: what
torch.cuda.mem_get_info reports free; CPU: the machine's available memory).
"""

from __future__ import annotations

import os

import torch
from transformers import PretrainedConfig


def block_bytes(config: PretrainedConfig, dtype: torch.dtype, block_size: int) -> int:
    """Bytes one block of `block_size` positions takes: keys and values of every layer and KV head."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * heads * block_size * head_dim * element


def free_memory_bytes(device: torch.device) -> int:
    """Memory free on the device now."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def budget_bytes(budget: float, device: torch.device) -> int:
    """The budget in bytes: `budget` itself, or that share of the device's free memory when it is at most 1."""
    if budget <= 0:
        raise ValueError(f"kv_cache_budget must be > 0, got {budget}")
    return int(budget * free_memory_bytes(device)) if budget <= 1 else int(budget)


def blocks_in_budget(
    budget: float, config: PretrainedConfig, dtype: torch.dtype, device: torch.device, block_size: int
) -> int:
    """Whole blocks that fit the budget (at least one)."""
    return max(1, budget_bytes(budget, device) // block_bytes(config, dtype, block_size))
