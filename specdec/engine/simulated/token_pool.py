"""The twin's KV pool: the real paged pool's blocks, tables and admission, holding each position's token id where a
model holds its keys and values.

A synthetic model's logits depend on the tokens of the context (specdec/engine/simulated/synthetic_pair.py), so a
row's context is read back from its blocks, as attention reads keys and values: forks share blocks, copy-on-write
copies a block's ids, and rollback frees blocks, all through the pool's own code.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specdec.engine.kv.pool import KVPool, SequenceKV


class TokenPool(KVPool):
    """A KVPool whose blocks hold token ids ([blocks + 1, B] int64, the last the scratch block); its per-layer
    buffers stay empty."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int):
        super().__init__(num_layers, num_blocks, block_size)
        self.token_ids = np.zeros((num_blocks + 1, block_size), dtype=np.int64)  # [blocks + 1, B]

    def copy_block(self, source: int, target: int) -> None:
        """Copies one block's token ids (copy-on-write)."""
        self.token_ids[target] = self.token_ids[source]

    def store(self, kv: SequenceKV, token_ids: Sequence[int]) -> None:
        """Writes token_ids at the sequence's next positions (its blocks reserved) without advancing its length."""
        block_size = self.block_size
        positions = np.arange(kv.length, kv.length + len(token_ids))
        blocks = np.asarray(kv.table, dtype=np.int64)[positions // block_size]
        self.token_ids[blocks, positions % block_size] = token_ids

    def tail(self, kv: SequenceKV, count: int) -> list[int]:
        """The last `count` token ids the sequence holds (fewer when it is shorter)."""
        block_size = self.block_size
        return [
            int(self.token_ids[kv.table[position // block_size], position % block_size])
            for position in range(max(0, kv.length - count), kv.length)
        ]
