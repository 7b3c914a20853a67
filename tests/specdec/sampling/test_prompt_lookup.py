"""Lookup tokens: a greedy block grows by the prompt-lookup tokens the draft agrees with, then its own token."""

from __future__ import annotations

import pytest
import torch

from specdec.decoding.drafting import DraftJob, DraftRun
from specdec.engine.kv.session import KVSession, run_forwards
from specdec.sampling.prompt_lookup import lookup_continuation
from specdec.sampling.rules import SamplingParams

PROMPT = [*range(2, 64), *range(2, 64)]  # every token of the vocabulary but two has earlier copies
GREEDY = SamplingParams()


def test_the_longest_suffix_with_an_earlier_copy_gives_what_followed_its_latest_copy():
    assert lookup_continuation([1, 2, 3, 9, 2, 3, 8, 4, 2, 3], 2) == [8, 4]  # "2 3": the latest copy wins
    assert lookup_continuation([7, 1, 2, 5, 2, 6, 1, 2], 3) == [5, 2, 6]  # "1 2" beats the later "2"
    assert lookup_continuation([1, 2, 3, 1, 2], 10) == [3, 1, 2]  # up to the end
    assert lookup_continuation([1, 2, 3, 4], 4) == []  # no earlier copy
    assert lookup_continuation([1, 2, 1], 0) == []


def draft(model, prompt, num_tokens, params=GREEDY, lookup_tokens=4, alternatives=2):
    """(session, drafted) for one block drafted after `prompt`."""
    session = KVSession(model, prompt)
    session.prefill()
    run = DraftRun()
    assert run.add("block", session, num_tokens, params, alternatives, lookup_tokens) is None
    outcomes = []
    while run:
        outcomes += run.step()
    [(_, drafted)] = outcomes
    return session, drafted


def test_a_greedy_block_grows_by_tokens_the_draft_itself_would_choose(tiny_pair):
    _, model = tiny_pair
    session, drafted = draft(model, PROMPT, 3)
    lookup = lookup_continuation([*PROMPT, *drafted.token_ids[:3]], 4)
    assert lookup, "the prompt repeats, so the lookup finds an earlier copy"
    kept = len(drafted.token_ids) - 4
    assert 0 <= kept <= len(lookup) and drafted.token_ids[3 : 3 + kept] == lookup[:kept]
    sequence = [*PROMPT, *drafted.token_ids]
    with torch.inference_mode():
        logits = model.model(torch.tensor([sequence])).logits[0].float()  # [L, V]
    for position in range(len(PROMPT), len(sequence)):
        row = logits[position - 1]
        assert row[sequence[position]] >= row.max() - 1e-4, f"token {position} is not the draft's greedy choice"
    assert len(drafted.alternatives) == len(drafted.token_ids)
    for token, others in zip(drafted.token_ids, drafted.alternatives):
        assert len(others) == 2 and token not in others
    assert session.tokens == sequence and session.cached_len == len(sequence) - 1  # the last token stays pending


def test_after_a_lookup_the_session_rolls_back_and_drafts_as_a_fresh_one(tiny_pair):
    _, model = tiny_pair
    session, drafted = draft(model, PROMPT, 3)
    session.truncate(len(PROMPT) + 2)
    run = DraftRun()
    run.add("again", session, 3, GREEDY, 0)
    [(_, again)] = run.step() + run.step() + run.step()
    _, fresh = draft(model, [*PROMPT, *drafted.token_ids[:2]], 3, lookup_tokens=0, alternatives=0)
    assert again.token_ids == fresh.token_ids


@pytest.mark.parametrize(
    "prompt, params, lookup_tokens",
    [
        (PROMPT, SamplingParams(temperature=1.0, seed=4), 4),  # sampled: q is not one-hot, no lookup
        (PROMPT, GREEDY, 0),  # off
        ([5, 9, 12], GREEDY, 4),  # nothing repeats (the draft's own tokens might: their copies come later)
    ],
    ids=["sampled", "off", "no-earlier-copy"],
)
def test_no_lookup_leaves_the_block_at_its_drafted_size(tiny_pair, prompt, params, lookup_tokens):
    _, model = tiny_pair
    session, drafted = draft(model, prompt, 3, params, lookup_tokens)
    assert len(drafted.token_ids) == 3 and len(session) == len(prompt) + 3


def test_bad_logits_in_the_lookup_pass_end_the_block_as_drafted(tiny_pair):
    _, model = tiny_pair
    session = KVSession(model, PROMPT)
    session.prefill()
    job = DraftJob(session, 1, GREEDY, 0, lookup_tokens=4)
    job.take(7, [7])
    lookup_pass = job.start_lookup([7])  # the last drafted token, no forced ones after it
    assert lookup_pass is not None
    run_forwards([lookup_pass])
    drafted = job.confirm_lookup(torch.full((len(job.lookup) + 1, model.vocab_size), float("nan")))
    assert drafted.token_ids == [7] and session.tokens == [*PROMPT, 7]
