"""Keys and values of every sequence on one model, in fixed-size blocks under a memory budget (paged KV cache).

A layer's buffer is [H_kv, blocks, B, D]: B positions (the block size) per block, each head's blocks side by side,
so a sequence whose blocks are consecutive ids reads each head's keys as one run of memory, as a contiguous cache
would. Each sequence holds a block table: position p of the sequence sits in block table[p // B] at p % B. A packed
step (specdec/engine/packed_forward.py) attends for many sequences in one call, reading each through its table, with no
copy of anyone's cache.

Blocks are handed out when a forward is planned (`SequenceKV.reserve`), before the model runs: a budget that is
spent refuses the session that asked (KVCacheFullError) and nobody else. A fork shares its parent's blocks and
the first write into a shared block copies it (copy-on-write; specdec/engine/kv/blocks.py keeps the counts), so a
drafter's lanes cost blocks for what each adds, not for the whole prefix. Rollback (`crop`) frees whole blocks
past the new length.

Past the allocator's blocks each buffer holds one more, the scratch block, which no table names: the padding
tokens of a step padded to a fixed size (specdec/engine/bucketed_step.py) write there.

The number of blocks comes from the budget (specdec/engine/kv/budget.py). On CUDA the buffers are allocated whole at the
first write, which the model makes before serving; elsewhere they double from a few blocks up to the budget as blocks
are handed out, so a small model on CPU holds memory for what it uses.
"""

from __future__ import annotations

import threading
import weakref

import torch

from specdec.engine.kv.blocks import BlockAllocator

_MIN_BLOCKS = 64


class KVPool:
    """Per-layer [H_kv, blocks, B, D] key and value buffers shared by the sequences of one model.

    A layer's buffers take their heads, head size, dtype and device from its first write (so a tensor-parallel rank
    holds only its own heads) and catch up with the pool's block count on each later write.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int = 16, preallocate: bool = False):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.blocks = BlockAllocator(num_blocks)
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # per layer [H_kv, blocks, B, D]
        self.values: list[torch.Tensor | None] = [None] * num_layers  # per layer [H_kv, blocks, B, D]
        self.preallocated = preallocate  # buffers made whole at their first write (before serving: model_runtime.py)
        self.allocated_blocks = num_blocks if preallocate else min(num_blocks, _MIN_BLOCKS)  # buffers' block count
        self.lock = threading.RLock()  # one pass, allocation or release at a time
        self.open_sequences = 0
        self.peak_sequences = 0  # most sequences open at once
        self.longest_sequence = 0  # most positions one sequence has held

    def new_sequence(self) -> SequenceKV:
        """An empty sequence holding no blocks."""
        with self.lock:
            self.open_sequences += 1
            self.peak_sequences = max(self.peak_sequences, self.open_sequences)
            return SequenceKV(self)

    @property
    def scratch_block(self) -> int:
        """The block past the allocator's in the buffers, where padding tokens write and no sequence reads."""
        return self.allocated_blocks

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold `positions` positions."""
        return -(-positions // self.block_size)

    def allocate(self, count: int) -> list[int]:
        """`count` free blocks (KVCacheFullError when too few are free); the buffers grow to hold them."""
        taken = self.blocks.allocate(count, self.block_size)
        if taken:
            while max(taken) >= self.allocated_blocks:
                self.allocated_blocks = min(2 * self.allocated_blocks, self.blocks.num_blocks)
        return taken

    def _close(self, table: list[int]) -> None:
        """A sequence is gone: its blocks go back."""
        with self.lock:
            self.open_sequences -= 1
            self.blocks.release(table)

    def write(
        self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores keys/values [T, H_kv, D] of T tokens at (blocks[t], offsets[t]); returns the layer's buffers."""
        self._fit(layer, keys)
        self.keys[layer][:, blocks, offsets] = keys.transpose(0, 1)  # [H_kv, T, D]
        self.values[layer][:, blocks, offsets] = values.transpose(0, 1)
        return self.keys[layer], self.values[layer]

    @torch.inference_mode()  # the buffers are inference tensors (made in a forward pass)
    def copy_block(self, source: int, target: int) -> None:
        """Copies one block into another, in every layer written so far."""
        for layer, held in enumerate(self.keys):
            if held is not None:
                self._fit(layer, held[:, 0, 0])
                self.keys[layer][:, target] = self.keys[layer][:, source]
                self.values[layer][:, target] = self.values[layer][:, source]

    def _fit(self, layer: int, like: torch.Tensor) -> None:
        """Brings a layer's buffers to the pool's block count (like: [..., H_kv, D] sets a new layer's shape). New
        room is zeroed: an attention over a padded block table reads it, masked out, and must see finite values.
        The layer keeps its old buffers until both new ones are allocated."""
        held = self.keys[layer]
        if held is not None and held.shape[1] == self.allocated_blocks + 1:
            return
        shape = (like.shape[-2], self.allocated_blocks + 1, self.block_size, like.shape[-1])  # + the scratch block
        keys, values = _grown(held, like.new_zeros(shape)), _grown(self.values[layer], like.new_zeros(shape))
        self.keys[layer], self.values[layer] = keys, values


def _grown(held: torch.Tensor | None, room: torch.Tensor) -> torch.Tensor:
    """room with held's blocks, but the scratch block, copied into its first blocks."""
    if held is not None:
        room[:, : held.shape[1] - 1] = held[:, :-1]
    return room


class SequenceKV:
    """One sequence's block table in a KVPool and the number of positions it holds.

    Behaves like a transformers cache where the rest of the code looks (`get_seq_length`, `crop(-n)`); its blocks
    go back to the pool when the sequence is garbage.
    """

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.table: list[int] = []  # block ids; changed in place only (the finalizer holds this list)
        self.length = 0
        self.decodes_greedily = False  # a model process may run the next pass on this one's argmax (model_worker.py)
        weakref.finalize(self, pool._close, self.table)

    def get_seq_length(self) -> int:
        return self.length

    def reserve(self, length: int) -> None:
        """Holds blocks for the first `length` positions and makes the blocks that positions self.length..length-1
        fall in its own (copying shared ones). Raises KVCacheFullError, holding nothing new, when too few are free."""
        pool = self.pool
        with pool.lock:
            needed = pool.blocks_for(length)
            shared = [
                index
                for index in range(self.length // pool.block_size, min(needed, len(self.table)))
                if pool.blocks.is_shared(self.table[index])
            ]
            fresh = pool.allocate(len(shared) + max(0, needed - len(self.table)))
            for index, block in zip(shared, fresh):
                pool.copy_block(self.table[index], block)
                pool.blocks.release([self.table[index]])
                self.table[index] = block
            self.table.extend(fresh[len(shared) :])
            pool.longest_sequence = max(pool.longest_sequence, length)

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last -tokens_to_remove positions (DynamicCache's convention: a negative count) and frees the
        blocks past them."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to drop, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)
        self.trim()

    def trim(self) -> None:
        """Frees the blocks past the positions held (e.g. reserved for a step that failed)."""
        with self.pool.lock:
            keep = self.pool.blocks_for(self.length)
            self.pool.blocks.release(self.table[keep:])
            del self.table[keep:]

    def __deepcopy__(self, memo: dict) -> SequenceKV:
        """An independent copy holding the same positions: it shares every block until one of the two writes."""
        with self.pool.lock:
            twin = self.pool.new_sequence()
            twin.table.extend(self.table)
            twin.length = self.length
            self.pool.blocks.share(self.table)
        return twin
