"""The record of spelled forced text: what counts as a hit or a miss, when a drafter spells, and how it learns the
target's own spelling of a forced text."""

from __future__ import annotations

from specdec.sampling.spelled_text import (
    EXPLORE_EVERY,
    MAX_WRITTEN,
    NO_TOKEN,
    PRIOR_HITS,
    PRIOR_MISSES,
    SpelledText,
    VocabularySpelling,
)


class Letters:
    """A tokenizer of single letters and the words of WORDS, ids by position."""

    WORDS = ["tags", "tag", '":', '"']

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.WORDS.index(text)] if text in self.WORDS else [100 + ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.WORDS[i] if i < 100 else chr(i - 100) for i in ids)


def spelled(vocabulary: VocabularySpelling | None = None) -> SpelledText:
    return SpelledText(vocabulary or VocabularySpelling(Letters()))


def test_a_spelled_token_is_judged_once_the_committed_output_covers_its_position():
    text = spelled()
    text.proposed([1, 2], 3)  # after output [1, 2], the spelled token 3
    text.proposed([1, 2, 3], 4)
    text.judge([1, 2])  # nothing covers position 2 yet
    assert (text.vocabulary.hits, text.vocabulary.misses) == (0, 0)
    text.judge([1, 2, 3, 5])  # 3 committed where spelled; 4 was not (5 was)
    assert (text.vocabulary.hits, text.vocabulary.misses) == (1, 1)
    text.judge([1, 2, 3, 5, 6])  # each is judged once
    assert (text.vocabulary.hits, text.vocabulary.misses) == (1, 1)


def test_a_token_spelled_after_output_that_was_not_committed_is_not_counted():
    text = spelled()
    text.proposed([1, 9], 3)  # a pre-draft lane's guess put 9 where the verifier committed 2
    text.judge([1, 2, 3])
    assert (text.vocabulary.hits, text.vocabulary.misses) == (0, 0)


def test_the_sequences_of_one_vocabulary_share_the_record():
    record = VocabularySpelling(Letters())
    first, second = spelled(record), spelled(record)
    first.proposed([], 7)
    second.proposed([], 8)
    first.judge([7])
    second.judge([7])
    assert (record.hits, record.misses) == (1, 1)


def test_spelling_stops_when_misses_outweigh_hits_and_explores_now_and_then():
    record = VocabularySpelling(Letters())
    assert record.pays()  # the prior: spell until told otherwise
    for _ in range(PRIOR_HITS - PRIOR_MISSES + 1):
        record.count(hit=False)
    chances = [record.pays() for _ in range(2 * EXPLORE_EVERY)]
    assert chances.count(True) == 2 and chances[EXPLORE_EVERY - 1] and chances[-1]
    for _ in range(4):
        record.count(hit=True)
    assert record.pays()


def test_the_shorter_token_of_a_spelled_one_is_its_longest_proper_prefix_in_one_token():
    vocabulary = VocabularySpelling(Letters())
    assert vocabulary.shorter_token(0) == [1]  # "tags" -> "tag"
    assert vocabulary.shorter_token(2) == [3]  # '":' -> '"'
    assert vocabulary.shorter_token(1) == [100 + ord("t")]  # "tag": "ta" takes two tokens, "t" one
    assert vocabulary.shorter_token(100 + ord("x")) == []


def letters(text: str) -> list[int]:
    return [100 + ord(c) for c in text]


def test_a_forced_text_is_spelled_as_the_tokenizer_writes_it_until_the_target_is_seen_writing_it():
    text = spelled()
    assert text.spell([5], "tags") == ([0], False)  # the tokenizer's word
    text.judge([5, *letters("tags"), 9])  # the target wrote it letter by letter
    assert text.spell([5], "tags") == (letters("tags"), True)
    assert text.spell([6], "tags") == ([0], False)  # after another token it is not known yet


def test_a_text_is_learnt_only_once_the_committed_output_covers_it_and_only_where_it_was_committed():
    text = spelled()
    text.spell([5], "tags")
    text.spell([7], "tag")  # proposed after output the verifier did not commit
    text.judge([5, *letters("ta")])  # not covered yet: nothing learnt, still pending
    assert text.vocabulary.spell(5, "tags") == ([0], False)
    text.judge([5, *letters("tag"), 2])  # '":' runs past the text's "s"
    assert text.vocabulary.spell(5, "tags") == (letters("tag"), True)  # the part it wrote within the text
    assert text.vocabulary.spell(7, "tag") == ([1], False)


def test_a_text_the_target_writes_together_with_what_follows_is_learnt_as_no_spelling():
    vocabulary = VocabularySpelling(Letters())
    assert vocabulary.learn(NO_TOKEN, "t", [0])  # "tags" covers the text "t" and more
    assert vocabulary.spell(NO_TOKEN, "t") == ([], True)  # the draft model's pass writes it, not a spelling


def test_learnt_spellings_do_not_count_towards_whether_spelling_pays():
    text = spelled()
    text.proposed([1], 3, learnt=True)
    text.judge([1, 4])
    assert (text.vocabulary.hits, text.vocabulary.misses) == (0, 0)


def test_the_vocabulary_remembers_a_bounded_number_of_spellings_and_forgets_the_oldest():
    vocabulary = VocabularySpelling(Letters())
    for before in range(MAX_WRITTEN + 1):
        vocabulary.learn(before, "tag", letters("tag"))
    assert vocabulary.spell(0, "tag") == ([1], False)  # forgotten: the tokenizer's spelling again
    assert vocabulary.spell(MAX_WRITTEN, "tag") == (letters("tag"), True)


def test_the_other_spellings_of_a_spelled_token_are_the_tokenizers_first_for_the_rest_then_its_shorter_token():
    vocabulary = VocabularySpelling(Letters())
    assert vocabulary.other_spellings("tags", 100 + ord("t")) == ([0], "ags")  # "tags" instead of "t"
    assert vocabulary.other_spellings("ags", 100 + ord("a")) == ([], "gs")  # "ags": letters, as proposed
    assert vocabulary.other_spellings("tags", 0) == ([1], "")  # the tokenizer's own first token: "tag", shorter
    assert vocabulary.other_spellings("tags", 0) == ([1], "")  # computed once, answered alike
