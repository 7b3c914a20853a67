"""Whether a drafter spells the text a grammar forces as the tokenizer writes it, learned from committed output.

Where a constraint allows several tokens but forces the text ahead (after `{"` a schema may force `name": "`), the
drafter may propose that text as the tokenizer spells it, with no draft pass (docs/architecture.md, "Constrained and
penalised decoding"). Whether the target writes it that way is the target's habit: a pretrained chat model writes
JSON keys as whole tokens, a model that never saw JSON may spell them letter by letter. So a drafter counts, over
all its sequences of one vocabulary, how often spelled tokens were committed (judged once the verifier has ruled
on them), and spells while that rate stays at or above MIN_HIT_RATE; below it, one chance in EXPLORE_EVERY still
spells, so the count follows a change.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

MIN_HIT_RATE = 0.5  # a spelled token replaces the draft's own: below this the draft is the better guess
PRIOR_HITS, PRIOR_MISSES = 4, 4  # the rate a drafter starts from: it spells until misses outweigh hits
EXPLORE_EVERY = 32  # below the rate, every EXPLORE_EVERY-th chance to spell still does
MAX_PENDING = 64  # one sequence's spelled tokens awaiting a verdict, at most (the oldest are dropped unjudged)


class VocabularySpelling:
    """How one vocabulary spells forced text, and how often the target kept it, over every sequence."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.hits = 0
        self.misses = 0
        self._declined = 0  # chances to spell passed up since the last exploration
        self._shorter: dict[int, list[int]] = {}  # token -> shorter_token(token), as computed once
        self._lock = threading.Lock()  # sequences of several request threads count here

    def encode(self, text: str) -> list[int]:
        """The ids the tokenizer writes `text` as, with no special token."""
        return self._tokenizer.encode(text, add_special_tokens=False)

    def shorter_token(self, token: int) -> list[int]:
        """The one token whose text is the longest proper prefix of `token`'s, in a list ([] when none): what a
        target that refuses a spelled token most often writes instead (`tags` -> `tag`, `":` -> `"`)."""
        if (found := self._shorter.get(token)) is not None:
            return found
        text, found = self._tokenizer.decode([token]), []
        for end in range(len(text) - 1, 0, -1):
            if len(ids := self.encode(text[:end])) == 1:
                found = ids
                break
        self._shorter[token] = found
        return found

    def pays(self) -> bool:
        """Whether to spell at this chance: the committed rate is high enough, or it is time to explore."""
        with self._lock:
            judged = self.hits + self.misses + PRIOR_HITS + PRIOR_MISSES
            if self.hits + PRIOR_HITS >= MIN_HIT_RATE * judged:
                return True
            self._declined += 1
            if self._declined < EXPLORE_EVERY:
                return False
            self._declined = 0
            return True

    def count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1


class SpelledText:
    """One sequence's spelled tokens awaiting a verdict (shared by its lanes: each proposes in the same output)."""

    def __init__(self, vocabulary: VocabularySpelling):
        self.vocabulary = vocabulary
        self._pending: dict[tuple[int, ...], int] = {}  # output before a spelled token -> that token

    def proposed(self, before: Sequence[int], token: int) -> None:
        """Records a spelled token proposed after the output `before`."""
        if len(self._pending) >= MAX_PENDING:
            del self._pending[next(iter(self._pending))]
        self._pending[tuple(before)] = token

    def judge(self, committed: Sequence[int]) -> None:
        """Counts the spelled tokens whose position the committed output covers: a hit where it holds the token, a
        miss where it holds another; one proposed after output that was not committed is dropped."""
        for before in [before for before in self._pending if len(before) < len(committed)]:
            token = self._pending.pop(before)
            if tuple(committed[: len(before)]) == before:
                self.vocabulary.count(committed[len(before)] == token)
