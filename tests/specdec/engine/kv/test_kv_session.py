"""KV rollback: truncate keeps the kept positions exact, and cycles keep length and memory bounded."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from tiny_models import make_pair

from specdec.engine.kv.session import ContextOverflowError, KVSession
from specdec.engine.model_runtime import LoadedModel, ModelSettings, TokenizerMismatchError, check_same_vocabulary


def fresh_next_logits(model: LoadedModel, tokens: list[int]) -> torch.Tensor:
    return KVSession(model, tokens).extend()[-1]  # [V]


def test_truncate_matches_fresh_prefill(tiny_pair):
    target, _ = tiny_pair
    session = KVSession(target, [3, 4, 5, 6])
    session.extend([7, 8, 9, 10, 11, 12])
    for n in (9, 6, 4, 2, 1):
        session.truncate(n)
        assert session.cached_len <= n and len(session) == n
        # Re-feed the last kept token so the next-token logits come out of the rolled-back cache.
        session.truncate(n - 1)
        rolled_back = session.extend([session_tokens := [3, 4, 5, 6, 7, 8, 9, 10, 11, 12][n - 1]])[-1]
        torch.testing.assert_close(
            rolled_back, fresh_next_logits(target, [3, 4, 5, 6, 7, 8, 9, 10, 11, 12][:n]), atol=1e-5, rtol=0
        )
        assert session_tokens == session.tokens[-1]


def test_extend_scores_every_new_position_in_one_pass(tiny_pair):
    target, _ = tiny_pair
    tokens = [2, 9, 4, 4, 17, 30]
    session = KVSession(target, tokens[:2])
    session.prefill()  # caches tokens 0 and 1, keeping token 1's row: the extend feeds tokens 2..5 only
    batched = session.extend(tokens[2:])  # [5, V]
    assert batched.shape == (5, target.vocab_size)
    for i in range(5):
        torch.testing.assert_close(batched[i], fresh_next_logits(target, tokens[: 2 + i]), atol=1e-5, rtol=0)


def test_a_prefill_keeps_the_last_row_so_a_first_plain_step_runs_no_pass(tiny_pair, monkeypatch):
    target, _ = tiny_pair
    expected = [fresh_next_logits(target, tokens) for tokens in ([2, 9, 4], [2, 9, 4, 7, 30])]
    session = KVSession(target, [2, 9, 4])
    session.prefill()
    assert session.cached_len == 3
    passes = []
    monkeypatch.setattr(target, "forward_rows", lambda rows, run=target.forward_rows: passes.append(rows) or run(rows))
    first = session.extend()  # [1, V]
    assert passes == [] and first.shape == (1, target.vocab_size)
    torch.testing.assert_close(first[0], expected[0], atol=1e-5, rtol=0)
    block = session.extend([7, 30])  # a verify block: the kept row, then the block's, feeding the block alone
    assert [len(ids) for ids, _, _ in passes[0]] == [2] and block.shape == (3, target.vocab_size)
    torch.testing.assert_close(block[0], first[0])
    torch.testing.assert_close(block[2], expected[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("change", ["append", "truncate"])
def test_the_kept_row_is_dropped_once_the_sequence_changes(tiny_pair, change):
    target, _ = tiny_pair
    session = KVSession(target, [2, 9, 4, 11])
    session.prefill()
    if change == "append":
        session.append([5])
    else:
        session.truncate(3)
    assert session.next_logits is None
    expected = [2, 9, 4, 11, 5] if change == "append" else [2, 9, 4]
    torch.testing.assert_close(session.extend()[-1], fresh_next_logits(target, expected), atol=1e-5, rtol=0)


def test_random_extend_truncate_cycles_keep_length_and_memory_bounded(tiny_pair):
    target, _ = tiny_pair
    rng = random.Random(0)
    session = KVSession(target, [1, 2, 3])
    session.prefill()
    peak = 0
    for _ in range(1000):
        if rng.random() < 0.5 and len(session) > 1:
            length = rng.randint(1, len(session))
            session.truncate(length)
            assert len(session) == length and session.cached_len <= length
        else:
            new = [rng.randrange(1, 64) for _ in range(rng.randint(0, 4))]
            if len(session) + len(new) > 60:
                session.truncate(rng.randint(1, 10))
            session.extend(new)
            assert session.cached_len == len(session)
        assert session.cache.get_seq_length() <= len(session), "the cache never holds more than the sequence"
        key_buffer = session.cache.pool.keys[0]  # [slots, H_kv, capacity, D]
        peak = max(peak, 0 if key_buffer is None else key_buffer.shape[2])
    assert peak <= 128, "the pool grows by doubling, never past twice the longest sequence (64)"


def test_context_overflow_is_refused(tiny_pair):
    target, _ = tiny_pair
    with pytest.raises(ContextOverflowError, match="context"):
        KVSession(target, [1] * (target.max_context_tokens + 1))


def test_mismatched_tokenizers_are_refused(tmp_path, tiny_pair):
    target, _ = tiny_pair
    other_target_dir, _ = make_pair(tmp_path, vocab_size=32)
    other = LoadedModel.load(ModelSettings(str(other_target_dir)))
    with pytest.raises(TokenizerMismatchError, match="token->id map differs"):
        check_same_vocabulary(target.identity, other.identity)
    renamed = type(target.identity)(target.identity.model_id, target.vocab_size, "0" * 64)
    with pytest.raises(TokenizerMismatchError, match="token->id map differs"):
        check_same_vocabulary(target.identity, renamed)
    narrower = type(target.identity)("an n-gram drafter", 32, target.identity.tokenizer_sha256)
    with pytest.raises(TokenizerMismatchError, match="vocabulary size differs"):
        check_same_vocabulary(target.identity, narrower)


@pytest.mark.parametrize("packed", [True, False], ids=["sequence_kv", "dynamic_cache"])
def test_a_fork_is_independent_of_its_original(tiny_pair, packed):
    """A fork continues exactly like a fresh session on the same tokens, and neither side's later extends or
    rollbacks reach the other."""
    target, _ = tiny_pair
    model = target
    if not packed:  # the same weights through transformers' own DynamicCache path
        model = copy.copy(target)
        model.packed = False
    session = KVSession(model, [3, 4, 5, 6])
    session.extend([7, 8])
    twin = session.fork()
    assert twin.tokens == session.tokens and twin.cached_len == session.cached_len
    twin_logits = twin.extend([20, 21])[-1]
    session.truncate(5)
    original_logits = session.extend([30])[-1]
    torch.testing.assert_close(twin_logits, fresh_next_logits(model, [3, 4, 5, 6, 7, 8, 20, 21]), atol=1e-5, rtol=0)
    torch.testing.assert_close(original_logits, fresh_next_logits(model, [3, 4, 5, 6, 7, 30]), atol=1e-5, rtol=0)
    assert twin.tokens == [3, 4, 5, 6, 7, 8, 20, 21]
