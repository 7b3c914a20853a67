"""The model drafter: a small causal LM drafting autoregressively from its own KV cache."""

from __future__ import annotations

import copy
from collections.abc import Sequence

from draft_service.drafter import Proposal
from specdec.decoding.drafting import draft_with_model
from specdec.engine.kv.session import KVSession
from specdec.engine.model_runtime import LoadedModel
from specdec.sampling.rules import SamplingParams
from specdec.sampling.sequence_rules import SequenceRules


class ModelDraftSession:
    """A DraftSession backed by a draft model's KV cache (prefilled by its first forward, or by the caller
    running `session.plan_prefill()` batched with other sessions')."""

    def __init__(
        self, model: LoadedModel, prompt_ids: Sequence[int], params: SamplingParams, rules: SequenceRules | None = None
    ):
        self.session = KVSession(model, prompt_ids)
        self.params = params
        self.rules = rules  # penalties, min_p, a constraint: its drafts follow them too

    def __len__(self) -> int:
        return len(self.session)

    @property
    def kv_cache_tokens(self) -> int:
        return self.session.cached_len

    def fork(self) -> ModelDraftSession:
        twin = copy.copy(self)
        twin.session = self.session.fork()
        twin.rules = self.rules.fork() if self.rules else None
        return twin

    def observe_committed(self, length: int) -> None:
        """Its first `length` tokens are committed: its rules learn what the verifier kept."""
        if self.rules is not None:
            self.rules.observe_committed(self.session.tokens[:length])

    def truncate(self, length: int) -> None:
        self.session.truncate(length)

    def cached_prefix(self, sequence: list[int], beyond: int) -> int:
        """How many leading tokens of `sequence` this session's cache holds; 0 when they part within the first
        `beyond` (the caller has a cache of that many already)."""
        held = self.session.tokens[: self.session.cached_len]
        if held[:beyond] != sequence[:beyond]:
            return 0
        shared = beyond
        while shared < min(len(held), len(sequence)) and held[shared] == sequence[shared]:
            shared += 1
        return shared

    def take_cache(self, other: ModelDraftSession, length: int, sequence: Sequence[int]) -> None:
        """Becomes `sequence` on `other`'s cache of its first `length` tokens (which `other` holds alike), the
        blocks shared until either writes; the rest of `sequence` stays pending. Its own cache is emptied at once,
        so its blocks do not wait for the old session object to be collected."""
        old, self.session = self.session, other.session.fork()
        old.truncate(0)  # its blocks go back now, even while something still holds the old session
        self.session.truncate(length)
        self.session.append(sequence[length:])

    def append(self, token_ids: Sequence[int]) -> None:
        self.session.append(token_ids)

    def propose(self, num_tokens: int) -> Proposal:
        drafted = draft_with_model(self.session, num_tokens, self.params, rules=self.rules)
        return Proposal(drafted.token_ids, drafted.probs)
