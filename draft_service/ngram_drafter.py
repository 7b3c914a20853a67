"""Model-free prompt-lookup drafter: proposes what followed an earlier copy of the sequence's latest n-gram."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from draft_service.drafter import Proposal
from specdec.sampling.sequence_rules import SequenceRules


@dataclass(frozen=True)
class NgramSettings:
    """Suffix lengths tried (longest first) and the cap on tokens proposed per round."""

    min_ngram: int = 1
    max_ngram: int = 4
    max_proposal: int = 10

    def validate(self) -> None:
        """Raises ValueError naming the first field that is out of range."""
        if self.min_ngram < 1:
            raise ValueError(f"min_ngram must be >= 1, got {self.min_ngram}")
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"max_ngram must be >= min_ngram ({self.min_ngram}), got {self.max_ngram}")
        if self.max_proposal < 1:
            raise ValueError(f"max_proposal must be >= 1, got {self.max_proposal}")


class NgramDraftSession:
    """A `DraftSession` that drafts by prompt lookup.

    The index maps every n-gram (min_ngram <= n <= max_ngram) of the sequence to the ascending list of
    positions just past its occurrences, so the last entry for the current suffix is the suffix itself and
    the one before it is its most recent earlier occurrence.
    """

    def __init__(self, prompt_ids: Sequence[int], settings: NgramSettings, rules: SequenceRules | None = None) -> None:
        settings.validate()
        self._settings = settings
        self._rules = rules  # with a constraint, a proposal ends before its first token the constraint refuses
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}
        self.append(prompt_ids)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def kv_cache_tokens(self) -> int:
        """Always 0: there is no model and hence no KV cache."""
        return 0

    def fork(self) -> NgramDraftSession:
        return NgramDraftSession(self._tokens, self._settings, self._rules.fork() if self._rules else None)

    @property
    def token_ids(self) -> list[int]:
        """A copy of the current sequence."""
        return list(self._tokens)

    def _ngram_sizes(self, end: int) -> range:
        """The n-gram lengths that fit in the sequence before position `end`."""
        return range(self._settings.min_ngram, min(self._settings.max_ngram, end) + 1)

    def truncate(self, length: int) -> None:
        """Drops the tokens from `length` on, removing the n-grams that end past it from the index."""
        if not 0 <= length <= len(self._tokens):
            raise ValueError(f"truncate length {length} outside [0, {len(self._tokens)}]")
        for end in range(len(self._tokens), length, -1):
            for n in self._ngram_sizes(end):
                key = tuple(self._tokens[end - n : end])
                ends = self._index[key]
                ends.pop()
                if not ends:
                    del self._index[key]
        del self._tokens[length:]

    def append(self, token_ids: Sequence[int]) -> None:
        """Extends the sequence and indexes the n-grams that end in the new tokens."""
        for token in token_ids:
            self._tokens.append(int(token))
            end = len(self._tokens)
            for n in self._ngram_sizes(end):
                self._index.setdefault(tuple(self._tokens[end - n : end]), []).append(end)

    def propose(self, num_tokens: int) -> Proposal:
        """Proposes up to min(num_tokens, max_proposal) tokens that followed the most recent earlier copy of the
        longest matching suffix, and appends them; an empty proposal when no suffix occurs earlier."""
        limit = min(num_tokens, self._settings.max_proposal)
        if limit <= 0:
            return Proposal([], None)
        length = len(self._tokens)
        for n in reversed(self._ngram_sizes(length)):
            ends = self._index[tuple(self._tokens[length - n :])]
            if len(ends) >= 2:
                start = ends[-2]
                proposed = self._tokens[start : start + limit]
                if self._rules is not None and self._rules.cursor is not None:
                    generated = self._tokens[self._rules.output_start :]
                    proposed = proposed[: self._rules.cursor.allowed_prefix(generated, proposed)]
                self.append(proposed)
                return Proposal(proposed, None)
        return Proposal([], None)
