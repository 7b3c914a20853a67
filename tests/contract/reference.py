"""The target alone, run with transformers in this process: what the stack's output is held to."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import DynamicCache


@torch.no_grad()
def greedy(model, prompt: Sequence[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Target-only greedy decoding: the argmax of the target's logits, token by token (stops after EOS)."""
    cache = DynamicCache()
    feed = list(prompt)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([feed]), cache=cache, use_cache=True, logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
        generated.append(token)
        feed = [token]
        if token == eos_token_id:
            break
    return generated


@torch.no_grad()
def next_token_probabilities(model, prompts: Sequence[Sequence[int]], temperature: float = 1.0) -> np.ndarray:
    """[len(prompts), vocab] float64: the target's exact next-token distribution after each prompt (no top-k/p)."""
    rows = []
    for prompt in prompts:
        logits = model(torch.tensor([list(prompt)])).logits[0, -1].double()
        rows.append(torch.softmax(logits / temperature, -1).numpy())
    return np.stack(rows)
