"""The paged KV pool: writes through block tables, growth up to the budget, copy-on-write forks, rollback."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from specdec.common.errors import KVCacheFullError
from specdec.engine.kv.pool import KVPool


def write_positions(pool: KVPool, kv, values: torch.Tensor) -> None:
    """Writes values [L, H_kv, D] as keys (and their negation as values) of positions kv.length.. of one sequence."""
    positions = range(kv.length, kv.length + values.shape[0])
    kv.reserve(kv.length + values.shape[0])
    blocks = torch.tensor([kv.table[p // pool.block_size] for p in positions])
    offsets = torch.tensor([p % pool.block_size for p in positions])
    pool.write(0, blocks, offsets, values, -values)
    kv.length += values.shape[0]


def read_positions(pool: KVPool, kv) -> torch.Tensor:
    """A sequence's keys [L, H_kv, D], read through its block table."""
    keys = pool.keys[0][:, torch.tensor(kv.table)]  # [H_kv, blocks, B, D]
    return keys.reshape(keys.shape[0], -1, keys.shape[3]).transpose(0, 1)[: kv.length]


def test_sequences_grow_block_by_block_past_the_first_buffer_and_keep_their_contents():
    pool = KVPool(num_layers=1, num_blocks=200, block_size=4)
    sequences = [pool.new_sequence() for _ in range(3)]
    written = torch.randn(3, 100, 2, 8)  # [sequence, position, H_kv, D]
    for start in range(0, 100, 10):  # interleaved: each sequence's blocks are scattered through the pool
        for kv, values in zip(sequences, written):
            write_positions(pool, kv, values[start : start + 10])
    assert pool.keys[0].shape[1] >= 75 > 64, "the buffers doubled past their first 64 blocks"
    for kv, values in zip(sequences, written):
        assert len(kv.table) == 25
        torch.testing.assert_close(read_positions(pool, kv), values)
    assert pool.peak_sequences == 3 and pool.longest_sequence == 100


def test_a_fork_shares_every_block_and_its_first_write_copies_only_the_block_it_writes_into():
    pool = KVPool(num_layers=1, num_blocks=16, block_size=4)
    parent = pool.new_sequence()
    prefix = torch.randn(10, 2, 8)
    write_positions(pool, parent, prefix)  # blocks 0, 1 full; block 2 half
    twin = copy.deepcopy(parent)
    assert twin.table == parent.table and pool.blocks.shared == 3 and pool.blocks.used == 3
    write_positions(pool, twin, torch.ones(3, 2, 8))  # into block 2 (copied) and a new one
    assert twin.table[:2] == parent.table[:2] and twin.table[2] != parent.table[2]
    assert pool.blocks.shared == 2 and pool.blocks.used == 5
    torch.testing.assert_close(read_positions(pool, parent), prefix, msg="the parent's positions are untouched")
    torch.testing.assert_close(read_positions(pool, twin), torch.cat([prefix, torch.ones(3, 2, 8)]))
    del twin
    gc.collect()
    assert pool.blocks.shared == 0 and pool.blocks.used == 3


def test_crop_frees_whole_blocks_past_the_new_length_and_rejects_positive_counts():
    pool = KVPool(num_layers=1, num_blocks=16, block_size=4)
    kv = pool.new_sequence()
    write_positions(pool, kv, torch.randn(13, 2, 8))
    assert len(kv.table) == 4
    kv.crop(-5)
    assert (kv.get_seq_length(), len(kv.table), pool.blocks.used) == (8, 2, 2)
    with pytest.raises(ValueError, match="negative"):
        kv.crop(3)


def test_reserving_past_the_budget_takes_nothing():
    pool = KVPool(num_layers=1, num_blocks=3, block_size=4)
    kv = pool.new_sequence()
    write_positions(pool, kv, torch.randn(6, 2, 8))
    with pytest.raises(KVCacheFullError, match="asked for 2 blocks"):
        kv.reserve(13)
    assert (len(kv.table), pool.blocks.free) == (2, 1)
