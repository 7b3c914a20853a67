"""Keys and values of every sequence on one model, in one pooled buffer per layer.

A layer's buffer is [slots, H_kv, capacity, D]: each sequence owns a slot, the keys/values of position p sit at
[slot, :, p]. Pooling lets a packed step (specdec/packed_forward.py) attend for many sequences in one call,
over a contiguous range of slots, with no copy of anyone's cache. A step writes only its new positions in
place; rollback (`crop`) only lowers a sequence's length.

Sequences take the lowest free slot, so the open ones stay packed at the start of the pool. The pool grows by
doubling, in slots and in capacity (positions per slot); every slot has the same capacity, so the memory held
is slots × the longest sequence seen (up to twice), like a static cache sized by use.
"""

from __future__ import annotations

import heapq
import threading
import weakref

import torch

_MIN_SLOTS = 4
_MIN_CAPACITY = 64


class KVPool:
    """Per-layer [slots, H_kv, capacity, D] key and value buffers shared by the sequences of one model.

    A layer's buffers take their shape, dtype and device from its first write (so a tensor-parallel rank holds
    only its own heads) and catch up with the pool's slot count and capacity on each later write.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # per layer [slots, H_kv, capacity, D]
        self.values: list[torch.Tensor | None] = [None] * num_layers  # per layer [slots, H_kv, capacity, D]
        self.slot_count = _MIN_SLOTS
        self.capacity = _MIN_CAPACITY
        self.lock = threading.RLock()  # one pass, allocation or release at a time
        self._free: list[int] = []  # a heap of released slots below _next_slot
        self._next_slot = 0

    def new_sequence(self) -> SequenceKV:
        """An empty sequence in the lowest free slot."""
        return SequenceKV(self, self._allocate())

    def _allocate(self) -> int:
        with self.lock:
            if self._free:
                return heapq.heappop(self._free)
            slot = self._next_slot
            self._next_slot += 1
            while slot >= self.slot_count:
                self.slot_count *= 2
            return slot

    def _release(self, slot: int) -> None:
        with self.lock:
            heapq.heappush(self._free, slot)

    def reserve(self, positions: int) -> None:
        """Makes room for `positions` positions in every slot (takes effect in each layer at its next write)."""
        while positions > self.capacity:
            self.capacity *= 2

    def write(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores keys/values [T, H_kv, D] of T tokens at (slots[t], positions[t]); returns the layer's buffers."""
        self._fit(layer, keys)
        self.keys[layer][slots, :, positions] = keys
        self.values[layer][slots, :, positions] = values
        return self.keys[layer], self.values[layer]

    @torch.inference_mode()  # the buffers are inference tensors (made in a forward pass)
    def copy_slot(self, source: int, target: int, length: int) -> None:
        """Copies the first `length` positions of one slot into another, in every layer written so far."""
        for layer, held in enumerate(self.keys):
            if held is not None:
                self._fit(layer, held[0, :, 0])
                self.keys[layer][target, :, :length] = self.keys[layer][source, :, :length]
                self.values[layer][target, :, :length] = self.values[layer][source, :, :length]

    def _fit(self, layer: int, like: torch.Tensor) -> None:
        """Brings a layer's buffers to the pool's slot count and capacity (like: [..., H_kv, D] sets a new
        layer's shape). New room is zeroed: a batched attention reads it, masked out, and must see finite values."""
        held = self.keys[layer]
        if held is not None and held.shape[0] == self.slot_count and held.shape[2] == self.capacity:
            return
        heads, head_dim = like.shape[-2], like.shape[-1]
        shape = (self.slot_count, heads, self.capacity, head_dim)
        self.keys[layer] = _grown(held, like.new_zeros(shape))
        self.values[layer] = _grown(self.values[layer], like.new_zeros(shape))


def _grown(held: torch.Tensor | None, room: torch.Tensor) -> torch.Tensor:
    """room with held's contents copied into its leading corner."""
    if held is not None:
        room[: held.shape[0], :, : held.shape[2]] = held
    return room


class SequenceKV:
    """One sequence's slot in a KVPool and the number of positions it holds.

    Behaves like a transformers cache where the rest of the code looks (`get_seq_length`, `crop(-n)`); the slot
    goes back to the pool when the sequence is garbage.
    """

    def __init__(self, pool: KVPool, slot: int):
        self.pool = pool
        self.slot = slot
        self.length = 0
        weakref.finalize(self, pool._release, slot)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last -tokens_to_remove positions (DynamicCache's convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to drop, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def __deepcopy__(self, memo: dict) -> SequenceKV:
        """An independent copy in a new slot of the same pool, holding the same positions."""
        with self.pool.lock:
            twin = self.pool.new_sequence()
            self.pool.copy_slot(self.slot, twin.slot, self.length)
        twin.length = self.length
        return twin
