"""One session: a request's token sequence on one replica and the KV cache of its prefix.

The cache always covers a prefix `tokens[:cached_len]`; tokens past it are *pending* and are fed by the
next forward. Rollback is `truncate(length)`: it drops tokens and crops the cache, never recomputing
the positions that are kept.

A forward is planned per session (`plan_extend`, `plan_prefill`) and run by `run_forwards`, which feeds
the plans of many sessions on one model in a single packed pass (continuous batching) when it can.

A prefill feeds the whole prompt and keeps the logits of its last position: the first extend after it starts
from them instead of feeding the prompt's last token again, so a first plain step needs no pass at all.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.common.errors import KVCacheFullError
from specdec.engine.kv.pool import SequenceKV
from specdec.engine.model_runtime import LoadedModel


class ContextOverflowError(ValueError):
    """A session would hold more tokens than the model's context."""


@dataclass(frozen=True)
class PlannedForward:
    """The tokens one session feeds in its next forward and how many of the last ones need logits."""

    session: KVSession
    token_ids: list[int]
    logit_rows: int  # of the fed tokens
    known_logits: torch.Tensor | None = None  # [1, V] put before the fed tokens' rows (kept by a prefill)
    keeps_logits: bool = False  # a prefill: the session keeps its last row for the next extend


class KVSession:
    """A token sequence plus the KV cache of its prefix, on one model."""

    def __init__(self, model: LoadedModel, prompt_ids: Sequence[int]):
        self.model = model
        self.cache = model.new_cache()
        self.tokens: list[int] = []
        self.plain_greedy_rounds = 0  # verification rounds in a row with no draft under greedy decoding
        self.next_logits: torch.Tensor | None = None  # [1, V] after the whole sequence, all of it cached (prefill)
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
                f"over the model's context of {self.model.max_context_tokens}"
            )
        if token_ids:
            self.next_logits = None
        self.tokens.extend(int(t) for t in token_ids)

    def plan_extend(self, token_ids: Sequence[int] = (), score_previous: bool = True) -> PlannedForward:
        """Appends token_ids and plans feeding every pending token (see `extend` for the rows returned)."""
        if not token_ids and not (score_previous and self.tokens):
            raise ValueError("extend needs new tokens, or score_previous on a non-empty sequence")
        previous_len = len(self.tokens)
        known = self.next_logits if score_previous else None  # the previous token's row, kept by the prefill
        self.append(token_ids)
        rows = len(token_ids) + (1 if score_previous and previous_len and known is None else 0)
        refeed_from = len(self.tokens) - rows
        if self.cached_len > refeed_from:
            self.cache.crop(refeed_from - self.cached_len)
        try:
            self._reserve(len(self.tokens))
        except KVCacheFullError:
            del self.tokens[previous_len:]
            self.next_logits = known
            raise
        return PlannedForward(self, self.tokens[self.cached_len :], rows, known_logits=known)

    def plan_prefill(self) -> PlannedForward | None:
        """Plans feeding every pending token, keeping the last one's logits for the next extend; None when there
        is nothing to feed."""
        if len(self.tokens) == self.cached_len:
            return None
        self._reserve(len(self.tokens))
        return PlannedForward(self, self.tokens[self.cached_len :], 1, keeps_logits=True)

    def _reserve(self, length: int) -> None:
        """Holds cache room for the first `length` tokens before a forward is run (a paged cache; KVCacheFullError
        when its budget is spent), so that a session that cannot grow fails alone, at planning."""
        if isinstance(self.cache, SequenceKV):
            self.cache.reserve(length)

    def extend(self, token_ids: Sequence[int] = (), score_previous: bool = True) -> torch.Tensor:
        """Appends token_ids and feeds every pending token in one forward pass (none when there is none).

        With score_previous (verification), returns float32 logits [len(token_ids) + 1, V]: row 0 predicts
        the token after the sequence's previous last token (kept by the prefill, else recomputed if it is
        already cached), row i the token after new token i. Without it (autoregressive steps, whose previous
        row was already used), returns only the new tokens' rows [len(token_ids), V] and recomputes nothing.
        """
        return run_forwards([self.plan_extend(token_ids, score_previous)])[0]

    def prefill(self) -> None:
        """Feeds every pending token, keeping the last one's logits for the next extend."""
        plan = self.plan_prefill()
        if plan is not None:
            run_forwards([plan])

    def fork(self) -> KVSession:
        """An independent copy: the same tokens and a copy of the cache; later calls on either leave the other
        alone (e.g. a draft lane started from a prefilled one instead of prefilling again)."""
        twin = copy.copy(self)
        twin.tokens = list(self.tokens)
        twin.cache = copy.deepcopy(self.cache)  # a SequenceKV (sharing blocks) or a transformers cache
        return twin

    def evict(self) -> None:
        """Frees the whole cache and keeps the tokens, all pending now: the next forward feeds them again (a session
        preempted to free KV blocks, specdec/engine/kv/preemption.py). The cache is a new one, so that tensor-parallel
        ranks drop the old one's blocks with the next step (verify_service/mirrored_model.py)."""
        self.cache.crop(-self.cached_len)
        self.cache = self.model.new_cache()
        self.next_logits = None

    def truncate(self, length: int) -> None:
        """Rolls back to the first `length` tokens (a no-op when already that short)."""
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        if length < len(self.tokens):
            self.next_logits = None
        del self.tokens[length:]
        surplus = self.cached_len - length
        if surplus > 0:
            self.cache.crop(-surplus)


def run_forwards(plans: Sequence[PlannedForward]) -> list[torch.Tensor]:
    """Runs planned forwards; plans of sessions on one packing model share a single pass.

    Returns per plan float32 logits [logit_rows (+ 1 with a kept row), V], in the order given; a plan with no
    tokens to feed (a first plain step after a prefill) runs no pass.
    """
    results: list[torch.Tensor | None] = [None] * len(plans)
    by_model: dict[int, list[int]] = {}
    for index, plan in enumerate(plans):
        if plan.token_ids:
            by_model.setdefault(id(plan.session.model), []).append(index)
        else:  # all it needs is the row the prefill kept
            results[index] = plan.known_logits
    for indices in by_model.values():
        model = plans[indices[0]].session.model
        rows = [(plans[i].token_ids, plans[i].session.cache, plans[i].logit_rows) for i in indices]
        for index, logits in zip(indices, model.forward_rows(rows)):
            plan = plans[index]
            if plan.keeps_logits:
                plan.session.next_logits = logits[-1:]  # [1, V]
            results[index] = logits if plan.known_logits is None else torch.cat([plan.known_logits, logits])
    return results
