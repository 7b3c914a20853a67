"""How a drafter spells the text a grammar forces, and whether it should, learned from committed output.

Where a constraint allows several tokens but forces the text ahead (after `{"` a schema may force `name": "`), the
drafter may propose that text with no draft pass (docs/architecture.md, "Constrained and penalised decoding"). How
the target writes it is the target's habit: a pretrained chat model writes JSON keys as whole tokens, a model that
never saw JSON may spell them letter by letter, and either may write the same text differently after different
tokens. So a drafter remembers, per forced text and the token before it, the ids the target last committed for it,
and proposes those; a text it has not seen committed yet it spells as the tokenizer writes it. It also counts,
over all its sequences of one vocabulary, how often spelled tokens were committed (judged once the verifier has
ruled on them), and spells while that rate stays at or above MIN_HIT_RATE; below it, one chance in EXPLORE_EVERY
still spells, so the count follows a change.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

MIN_HIT_RATE = 0.5  # a spelled token replaces the draft's own: below this the draft is the better guess
PRIOR_HITS, PRIOR_MISSES = 4, 4  # the rate a drafter starts from: it spells until misses outweigh hits
EXPLORE_EVERY = 32  # below the rate, every EXPLORE_EVERY-th chance to spell still does
MAX_PENDING = 64  # one sequence's spelled tokens awaiting a verdict, at most (the oldest are dropped unjudged)
MAX_WRITTEN = 4096  # spellings (per token before and forced text) and alternatives a vocabulary keeps, at most each
NO_TOKEN = -1  # the "token before" of a text forced at the very start of the output


class VocabularySpelling:
    """How one vocabulary spells forced text, and how often the target kept it, over every sequence."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.hits = 0
        self.misses = 0
        self._declined = 0  # chances to spell passed up since the last exploration
        self._shorter: dict[int, list[int]] = {}  # token -> shorter_token(token), as computed once
        self._others: dict[tuple[str, int], tuple[list[int], str]] = {}  # other_spellings(rest, token), computed once
        # (token before, forced text) -> the ids the target last committed for that text there, the most recent last
        self._written: collections.OrderedDict[tuple[int, str], tuple[int, ...]] = collections.OrderedDict()
        self._lock = threading.Lock()  # sequences of several request threads count and learn here

    def encode(self, text: str) -> list[int]:
        """The ids the tokenizer writes `text` as, with no special token."""
        return self._tokenizer.encode(text, add_special_tokens=False)

    def spell(self, before: int, text: str) -> tuple[list[int], bool]:
        """The ids to propose for forced `text` after the token `before` (NO_TOKEN at the output's start), and
        whether they are learnt: as the target last committed it there (its leading part only, or none, where the
        target's next token ran past the text), else as the tokenizer writes it while that pays (else none)."""
        with self._lock:
            written = self._written.get((before, text))
        if written is not None:
            return list(written), True
        return (self.encode(text) if self.pays() else []), False

    def learn(self, before: int, text: str, committed: Sequence[int]) -> bool:
        """Learns how the target spelled forced `text` after `before`, from the committed tokens that followed
        there; False while they do not cover the text yet (nothing learnt)."""
        written: list[int] = []
        for token in committed:
            spelled = self._tokenizer.decode([*written, token])
            if not text.startswith(spelled):  # the target wrote the rest of the text with what follows it
                break
            written.append(token)
            if spelled == text:
                break
        else:
            return False
        with self._lock:
            self._written[before, text] = tuple(written)
            self._written.move_to_end((before, text))
            if len(self._written) > MAX_WRITTEN:
                self._written.popitem(last=False)
        return True

    def other_spellings(self, rest: str, token: int) -> tuple[list[int], str]:
        """Where `token` is proposed for the forced text `rest` (what is left of a spelled text there): the tokens
        a target that refuses it most likely writes instead, the tokenizer's first token for `rest`, then the one
        whose text is the longest proper prefix of the token's (`tags` -> `tag`, `":` -> `"`); and the text left
        after the token."""
        key = (rest, token)
        if (found := self._others.get(key)) is None:
            if len(self._others) >= MAX_WRITTEN:
                self._others.clear()
            others = [*self.encode(rest)[:1], *self.shorter_token(token)]
            after = rest[len(self._tokenizer.decode([token])) :]
            found = self._others[key] = ([other for other in dict.fromkeys(others) if other != token], after)
        return list(found[0]), found[1]

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
        self._texts: dict[tuple[int, ...], str] = {}  # output before a spelled text -> that text

    def spell(self, before: Sequence[int], text: str) -> tuple[list[int], bool]:
        """The ids to propose for forced `text` after the output `before`, and whether they are learnt
        (VocabularySpelling.spell); the text is remembered, spelled or not, so that the committed output teaches
        how the target writes it there."""
        if len(self._texts) >= MAX_PENDING:
            del self._texts[next(iter(self._texts))]
        self._texts[tuple(before)] = text
        return self.vocabulary.spell(_last(before), text)

    def proposed(self, before: Sequence[int], token: int, learnt: bool = False) -> None:
        """Records a spelled token proposed after the output `before`; only those spelled as the tokenizer writes
        them (not learnt) count towards whether spelling pays."""
        if learnt:
            return
        if len(self._pending) >= MAX_PENDING:
            del self._pending[next(iter(self._pending))]
        self._pending[tuple(before)] = token

    def judge(self, committed: Sequence[int]) -> None:
        """Counts the spelled tokens whose position the committed output covers: a hit where it holds the token, a
        miss where it holds another; learns how the target wrote each spelled text the committed output covers.
        One proposed after output that was not committed is dropped."""
        for before in [before for before in self._pending if len(before) < len(committed)]:
            token = self._pending.pop(before)
            if tuple(committed[: len(before)]) == before:
                self.vocabulary.count(committed[len(before)] == token)
        for before in [before for before in self._texts if len(before) < len(committed)]:
            if tuple(committed[: len(before)]) != before:
                del self._texts[before]
            elif self.vocabulary.learn(_last(before), self._texts[before], committed[len(before) :]):
                del self._texts[before]


def _last(before: Sequence[int]) -> int:
    """The token an output ends with (NO_TOKEN when empty): what a forced text after it is keyed by."""
    return before[-1] if before else NO_TOKEN
