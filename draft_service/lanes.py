"""A draft session's lanes: independent sequences of one request on the drafter, each with its own cache.

A coordinator that pre-drafts the next block under several guessed verdicts of the current one keeps one lane
per guess. Lane 0 is prefilled with the prompt and the others start as copies of it; each is then synced on its
own through base_len, like a session with a single lane. They are opened, counted and closed together under the
request's session id.
"""

from __future__ import annotations

from collections.abc import Sequence

from draft_service.drafter import DraftSession
from draft_service.model_drafter import ModelDraftSession
from specdec.common.errors import InvalidFieldError


class DraftLanes:
    """The lanes of one draft session (lane 0 is the one a plain Propose drafts on)."""

    def __init__(self, lanes: Sequence[DraftSession]):
        if not lanes:
            raise ValueError("a draft session needs at least one lane")
        self._lanes = list(lanes)

    def __len__(self) -> int:
        """How many lanes the session holds."""
        return len(self._lanes)

    def lane(self, index: int) -> DraftSession:
        """One lane; INVALID_ARGUMENT naming `lane` when the session has no such lane."""
        if not 0 <= index < len(self._lanes):
            raise InvalidFieldError("lane", f"{index} is out of range: this session has {len(self._lanes)} lane(s)")
        return self._lanes[index]

    def add_forks(self, count: int) -> None:
        """Adds `count` lanes, each a copy of lane 0 as it stands (e.g. just prefilled)."""
        self._lanes.extend(self._lanes[0].fork() for _ in range(count))

    def catch_up(self, index: int, base_len: int, appended_ids: Sequence[int]) -> bool:
        """Syncs model lane `index` to its first base_len tokens + appended_ids by taking the cache of the lane that
        holds the most of that sequence, if one holds more than its own would keep; False (nothing done) otherwise.
        The tokens taken need no pass."""
        lane = self._lanes[index]
        if not isinstance(lane, ModelDraftSession):
            return False
        sequence = [*lane.session.tokens[:base_len], *appended_ids]
        if len(sequence) < 2:  # nothing to take: a token stays pending
            return False
        kept = min(lane.kv_cache_tokens, base_len, len(sequence) - 1)  # a token stays pending: its pass gives logits
        best, best_len = None, kept
        for other in self._lanes:
            if other is not lane and isinstance(other, ModelDraftSession):
                shared = min(other.cached_prefix(sequence, best_len), len(sequence) - 1)
                if shared > best_len:
                    best, best_len = other, shared
        if best is None:
            return False
        lane.take_cache(best, best_len, sequence)
        return True

    def release(self) -> None:
        """Empties every lane, giving its KV cache back (the session is closed)."""
        for lane in self._lanes:
            lane.truncate(0)

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens held in the caches of all lanes."""
        return sum(lane.kv_cache_tokens for lane in self._lanes)
