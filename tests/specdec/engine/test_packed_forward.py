"""Packed forwards: rows of different lengths in one pass give each row exactly its own logits."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig, MistralConfig

from specdec.common.errors import KVCacheFullError
from specdec.engine.attention.sdpa_backend import GRID_CALL_POSITIONS, GRID_MAX_TOKENS, SdpaBackend
from specdec.engine.attention.selection import AttentionBackendChoice
from specdec.engine.kv.budget import block_bytes
from specdec.engine.kv.session import KVSession, run_forwards
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.engine.packed_forward import packed_forward_refusal
from specdec.engine.packed_step import PackedRow, PackedStep


@torch.inference_mode()
def reference_logits(target, tokens: list[int]) -> torch.Tensor:
    """Logits of every position from transformers' own attention on one unpadded sequence, [T, V]."""
    return target.model(input_ids=torch.tensor([tokens])).logits[0].float()


BACKENDS = [AttentionBackendChoice.KERNEL, AttentionBackendChoice.SDPA, AttentionBackendChoice.FLEX]


@pytest.fixture(params=BACKENDS, ids=lambda choice: choice.value)
def packed_target(request, tiny_pair_dirs):
    """The tiny target attending through each backend."""
    target = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0]), attention_backend=request.param))
    assert target.packed and target.attention_backend.name == request.param.value
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
    """A step on some of many sessions, packed in any order: rows of like lengths share a grid, a row much longer
    than the grid before it attends apart, a prefill attends alone; every row still gets exactly its own logits,
    read through block tables that a fork shares in part."""
    # short rows through SDPA on grids; blocks of 4 positions, so that rows span many scattered blocks
    target = LoadedModel.load(
        ModelSettings(str(tiny_pair_dirs[0]), attention_backend=AttentionBackendChoice.SDPA, kv_block_size=4)
    )
    rng = random.Random(11)
    lengths = [20, 21, 23, 40, 41, 20 + 2 * GRID_CALL_POSITIONS]
    sessions = [KVSession(target, [rng.randrange(1, 64) for _ in range(length)]) for length in lengths]
    run_forwards([s.plan_prefill() for s in sessions])
    sessions.append(sessions[1].fork())  # a lane sharing session 1's blocks: its first write copies the last one
    in_step = [5, 3, 0, 6, 2, 4, 1]  # packed in this order
    for i in in_step:
        sessions[i].cache.reserve(sessions[i].cached_len + 2)
    step = PackedStep(
        [PackedRow(sessions[i].cache, sessions[i].cached_len, 2) for i in in_step],
        torch.device("cpu"),
        torch.float32,
        SdpaBackend(),
    )
    assert [[in_step[i] for i in grid.rows] for grid in step.plan.grids] == [[0, 6, 1, 2], [3, 4]]
    assert [in_step[i] for i, _, _ in step.plan.single_rows] == [5]
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


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda choice: choice.value)
def test_forked_lanes_share_prefix_blocks_and_diverge_exactly(tiny_pair_dirs, backend):
    """Lanes forked from a prefilled session hold no blocks of their own until they write; each then copies only
    the block it writes into, and every lane's logits stay those of its own sequence."""
    target = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0]), attention_backend=backend, kv_block_size=8))
    pool = target.kv_pool
    rng = random.Random(4)
    first = KVSession(target, [rng.randrange(1, 64) for _ in range(45)])
    first.prefill()  # 44 positions: 5 full blocks and one of 4
    lanes = [first] + [first.fork() for _ in range(4)]
    assert (pool.blocks.used, pool.blocks.shared) == (6, 6)
    results = run_forwards([lane.plan_extend([rng.randrange(1, 64) for _ in range(3)]) for lane in lanes])
    # each lane but the last writer copied the shared half-full block; the full ones stay shared
    assert (pool.blocks.used, pool.blocks.shared) == (6 + 4, 5)
    for lane, logits in zip(lanes, results):
        torch.testing.assert_close(logits, reference_logits(target, lane.tokens)[-4:], atol=1e-4, rtol=0)
    del lanes[1:], lane
    gc.collect()
    assert (pool.blocks.used, pool.blocks.shared) == (6, 0)


def test_rollback_frees_whole_blocks_past_the_new_length(tiny_pair_dirs):
    target = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0]), kv_block_size=4))
    session = KVSession(target, list(range(1, 20)))
    session.prefill()  # 18 positions: 5 blocks
    assert target.kv_pool.blocks.used == 5
    session.truncate(9)  # 9 positions: 3 blocks
    assert (session.cached_len, len(session.cache.table), target.kv_pool.blocks.used) == (9, 3, 3)
    torch.testing.assert_close(session.extend([5]), reference_logits(target, session.tokens)[-2:], atol=1e-4, rtol=0)


def test_a_session_that_cannot_grow_is_refused_alone_and_holds_nothing_new(tiny_pair_dirs):
    """A budget of 4 blocks of 4 positions: a session asking for more gets KVCacheFullError at planning, saying
    what it asked and what is free, and the others still run."""
    target_dir = str(tiny_pair_dirs[0])
    probe = LoadedModel.load(ModelSettings(target_dir))
    budget = 4 * block_bytes(probe.model.config, torch.float32, 4)
    target = LoadedModel.load(ModelSettings(target_dir, kv_cache_budget=budget, kv_block_size=4))
    assert target.kv_pool.blocks.num_blocks == 4
    small, large = KVSession(target, [3] * 6), KVSession(target, [5] * 9)
    small.prefill()  # 2 blocks
    with pytest.raises(KVCacheFullError, match=r"asked for 3 blocks \(12 positions\), 2 of 4 free"):
        large.plan_extend([6])  # 10 positions: 3 blocks
    assert target.kv_pool.blocks.free == 2 and len(large) == 9
    torch.testing.assert_close(small.extend([7]), reference_logits(target, small.tokens)[-2:], atol=1e-4, rtol=0)


def test_an_out_of_memory_error_mid_pass_grows_nothing_and_the_next_pass_serves(tiny_pair_dirs):
    """torch.OutOfMemoryError raised inside the forward (by a hook on a layer): the pass fails, no row grows, the
    blocks reserved for it go back, and the same rows then run exactly."""
    target = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0]), kv_block_size=4))
    sessions = [KVSession(target, [2 + i] * (5 + 3 * i)) for i in range(3)]
    run_forwards([s.plan_prefill() for s in sessions])
    held = target.kv_pool.blocks.used

    def out_of_memory(module, args):
        raise torch.OutOfMemoryError("injected: out of memory in layer 1")

    hook = target.model.model.layers[1].register_forward_pre_hook(out_of_memory)
    plans = [s.plan_extend([9] * 4) for s in sessions]
    with pytest.raises(torch.OutOfMemoryError):
        run_forwards(plans)
    hook.remove()
    assert target.kv_pool.blocks.used == held
    for session in sessions:
        session.truncate(len(session) - 4)
    results = run_forwards([s.plan_extend([9] * 4) for s in sessions])
    for session, logits in zip(sessions, results):
        torch.testing.assert_close(logits, reference_logits(target, session.tokens)[-5:], atol=1e-4, rtol=0)


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
