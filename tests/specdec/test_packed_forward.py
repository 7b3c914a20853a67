"""Packed forwards: rows of different lengths in one pass give each row exactly its own logits."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig, MistralConfig

from specdec.kv_pool import KVPool
from specdec.kv_session import KVSession, run_forwards
from specdec.model_runtime import LoadedModel, ModelSettings
from specdec.packed_forward import GRID_CALL_POSITIONS, GRID_MAX_TOKENS, PackedRow, PackedStep, packed_forward_refusal


@torch.inference_mode()
def reference_logits(target, tokens: list[int]) -> torch.Tensor:
    """Logits of every position from transformers' own attention on one unpadded sequence, [T, V]."""
    return target.model(input_ids=torch.tensor([tokens])).logits[0].float()


@pytest.fixture(params=[True, False], ids=["kernel", "sdpa"])
def packed_target(request, tiny_pair_dirs):
    """The tiny target with its short rows attending in the compiled kernel, or through SDPA."""
    target = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0]), attention_kernel=request.param))
    assert target.packed and (target.attention_kernel is not None) == request.param
    return target


def test_rows_of_different_lengths_match_one_sequence_at_a_time(packed_target):
    target = packed_target
    rng = random.Random(3)
    sessions = [KVSession(target, [rng.randrange(1, 64) for _ in range(length)]) for length in (1, 2, 7, 30, 55)]
    # Pass 1 mixes prefills of every length; pass 2 scores blocks of different sizes after them.
    run_forwards([plan for s in sessions if (plan := s.plan_prefill()) is not None])
    blocks = [[rng.randrange(1, 64) for _ in range(size)] for size in (0, 1, 4, 2, 6)]
    results = run_forwards([s.plan_extend(block) for s, block in zip(sessions, blocks)])
    for session, block, logits in zip(sessions, blocks, results):
        expected = reference_logits(target, session.tokens)[-(len(block) + 1) :]  # [γ+1, V]
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_rollback_then_packed_extend_matches_a_fresh_sequence(packed_target):
    target = packed_target
    rng = random.Random(5)
    sessions = [KVSession(target, [rng.randrange(1, 64) for _ in range(length)]) for length in (4, 12, 20)]
    for _ in range(20):  # random verify-like rounds: extend, keep a random prefix, repeat, all rows together
        blocks = [[rng.randrange(1, 64) for _ in range(rng.randint(0, 5))] for _ in sessions]
        results = run_forwards([s.plan_extend(block) for s, block in zip(sessions, blocks)])
        for session, block, logits in zip(sessions, blocks, results):
            torch.testing.assert_close(
                logits, reference_logits(target, session.tokens)[-(len(block) + 1) :], atol=1e-4, rtol=0
            )
            session.truncate(len(session) - rng.randint(0, len(block)))


def test_rows_share_a_grid_only_where_it_reads_less_than_a_call_and_match_one_sequence_at_a_time(tiny_pair_dirs):
    """A step on some of many sessions, packed out of slot order: rows of like lengths in nearby slots share a
    grid, far ones and ones much longer than their neighbour attend apart, a prefill attends alone; every row
    still gets exactly its own logits."""
    # its own pool (sessions take slots 0, 1, ...), short rows through SDPA on grids
    target = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0]), attention_kernel=False))
    rng = random.Random(11)
    lengths = [20] * 13 + [20 + 2 * GRID_CALL_POSITIONS]  # slot 13 holds far more than slot 12
    sessions = [KVSession(target, [rng.randrange(1, 64) for _ in range(length)]) for length in lengths]
    run_forwards([s.plan_prefill() for s in sessions])
    in_step = [12, 0, 7, 1, 3, 13, 8]  # slots 0-1-3 (one idle between), 7-8, 12 and 13; packed in this order
    step = PackedStep(
        [PackedRow(sessions[i].cache, sessions[i].cached_len, 2) for i in in_step], torch.device("cpu"), torch.float32
    )
    assert [[step.rows[i].kv.slot for i in grid.rows] for grid in step.grids] == [[0, 1, 3], [7, 8]]
    assert sorted(step.rows[i].kv.slot for i, _ in step.single_rows) == [12, 13]
    blocks = {i: [rng.randrange(1, 64) for _ in range(rng.randint(0, 5))] for i in in_step}
    newcomer = KVSession(target, [rng.randrange(1, 64) for _ in range(GRID_MAX_TOKENS + 9)])  # a prefill row
    plans = [sessions[i].plan_extend(blocks[i]) for i in in_step] + [newcomer.plan_prefill()]
    results = run_forwards(plans)
    for i, logits in zip(in_step, results):
        torch.testing.assert_close(
            logits, reference_logits(target, sessions[i].tokens)[-(len(blocks[i]) + 1) :], atol=1e-4, rtol=0
        )
    next_logits = newcomer.extend()  # scored from the prefilled cache
    torch.testing.assert_close(next_logits, reference_logits(target, newcomer.tokens)[-1:], atol=1e-4, rtol=0)


def test_pool_grows_past_its_first_capacity_and_slots_and_keeps_contents():
    pool = KVPool(num_layers=1)
    sequences = [pool.new_sequence() for _ in range(9)]  # past the first slot count
    assert [kv.slot for kv in sequences] == list(range(9))
    written = torch.randn(9, 100, 2, 4)  # [sequence, position, H_kv, D]
    for start in range(0, 100, 10):  # past the first capacity, ten positions of every sequence at a time
        slots = torch.arange(9).repeat_interleave(10)
        positions = torch.arange(start, start + 10).repeat(9)
        block = written[:, start : start + 10].reshape(90, 2, 4)
        pool.reserve(start + 10)
        keys, values = pool.write(0, slots, positions, block, -block)
    assert keys.shape[0] >= 9 and keys.shape[2] >= 100
    torch.testing.assert_close(keys[:9, :, :100], written.transpose(1, 2))
    torch.testing.assert_close(values[:9, :, :100], -written.transpose(1, 2))
    kv = sequences[4]
    kv.length = 100
    kv.crop(-30)
    assert kv.get_seq_length() == 70
    with pytest.raises(ValueError, match="negative"):
        kv.crop(3)


def test_forks_get_their_own_slot_and_dropped_sequences_give_theirs_back():
    pool = KVPool(num_layers=1)
    first, second = pool.new_sequence(), pool.new_sequence()
    pool.write(0, torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), torch.ones(3, 2, 4), torch.ones(3, 2, 4))
    first.length = 2
    twin = copy.deepcopy(first)
    assert twin.slot == 2 and twin.get_seq_length() == 2
    torch.testing.assert_close(pool.keys[0][2, :, :2], pool.keys[0][0, :, :2])
    del second
    assert pool.new_sequence().slot == 1, "the lowest free slot is reused"


def test_the_config_check_refuses_soft_capping_and_unknown_layer_kinds_with_the_reason():
    assert packed_forward_refusal(LlamaConfig()) is None
    assert packed_forward_refusal(MistralConfig(sliding_window=16)) is None  # windows are masked
    assert (
        packed_forward_refusal(LlamaConfig(layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2))
        is None
    )
    assert "soft-capping" in packed_forward_refusal(Gemma2Config())
    assert "chunked_attention" in packed_forward_refusal(
        LlamaConfig(layer_types=["chunked_attention", "full_attention"], num_hidden_layers=2)
    )


def test_transformers_generation_still_works_on_a_packed_model(tiny_pair):
    """Plain and assisted generate() (several new tokens after a cache: needs a real causal mask)."""
    target, draft = tiny_pair
    prompt = torch.tensor([[5, 9, 2]])
    plain = target.model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    tokens = [5, 9, 2]
    for _ in range(plain.shape[1] - 3):  # the greedy continuation, one full forward per token
        tokens.append(int(reference_logits(target, tokens)[-1].argmax()))
    assert plain[0].tolist() == tokens
    assisted = target.model.generate(
        prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, assistant_model=draft.model
    )
    assert assisted[0].tolist() == tokens
