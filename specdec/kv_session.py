"""One session: a request's token sequence on one replica and the KV cache of its prefix.

The cache always covers a prefix `tokens[:cached_len]`; tokens past it are *pending* and are fed by the
next `extend`. Rollback is `truncate(length)`: it drops tokens and crops the cache, never recomputing
the positions that are kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.model_runtime import LoadedModel


class ContextOverflowError(ValueError):
    """A session would hold more tokens than the model's context."""


class KVSession:
    """A token sequence plus the KV cache of its prefix, on one model."""

    def __init__(self, model: LoadedModel, prompt_ids: Sequence[int]):
        self.model = model
        self.cache = model.new_cache()
        self.tokens: list[int] = []
        self.append(prompt_ids)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def cached_len(self) -> int:
        """How many leading tokens have keys/values in the cache."""
        return self.cache.get_seq_length()

    def append(self, token_ids: Sequence[int]) -> None:
        """Adds tokens without running the model (they stay pending)."""
        if len(self.tokens) + len(token_ids) > self.model.max_context_tokens:
            raise ContextOverflowError(
                f"session would hold {len(self.tokens) + len(token_ids)} tokens, "
                f"over the model's context of {self.model.max_context_tokens}")
        self.tokens.extend(int(t) for t in token_ids)

    def extend(self, token_ids: Sequence[int] = (), score_previous: bool = True) -> torch.Tensor:
        """Appends token_ids and feeds every pending token in one forward pass.

        With score_previous (verification), returns float32 logits [len(token_ids) + 1, V]: row 0 predicts
        the token after the sequence's previous last token (recomputed if it is already cached), row i the
        token after new token i. Without it (autoregressive steps, whose previous row was already used),
        returns only the new tokens' rows [len(token_ids), V] and recomputes nothing.
        """
        if not token_ids and not (score_previous and self.tokens):
            raise ValueError("extend needs new tokens, or score_previous on a non-empty sequence")
        previous_len = len(self.tokens)
        self.append(token_ids)
        rows = len(token_ids) + (1 if score_previous and previous_len else 0)
        refeed_from = len(self.tokens) - rows
        if self.cached_len > refeed_from:
            self.cache.crop(refeed_from - self.cached_len)
        input_ids = torch.tensor([self.tokens[self.cached_len:]], dtype=torch.long)  # [1, n_pending]
        return self.model.forward(input_ids, self.cache)[-rows:]  # [rows, V]

    def prefill(self) -> None:
        """Feeds every token but the last, so the next extend scores from the last token on."""
        if len(self.tokens) - self.cached_len > 1:
            input_ids = torch.tensor([self.tokens[self.cached_len:-1]], dtype=torch.long)  # [1, n]
            self.model.forward(input_ids, self.cache)

    def truncate(self, length: int) -> None:
        """Rolls back to the first `length` tokens (a no-op when already that short)."""
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        del self.tokens[length:]
        surplus = self.cached_len - length
        if surplus > 0:
            self.cache.crop(-surplus)
