"""The twin's synthetic model pair: target logits as a deterministic function of the context, and draft logits that
are the target's plus seeded noise whose scale sets the acceptance rate.

A position's *key* hashes the seed, the position and the last `CONTEXT_TOKENS` tokens up to it. The key picks a
row of a precomputed table and a circular shift of it, so a row costs one copy: the table holds R rows of V logits
shaped like a language model's (a Zipf profile over a random order of the ids, with jitter), each stored twice
side by side, and `unfold` makes every shifted row a view of that storage. The shift spreads the argmax over all
V ids; the position in the key keeps greedy decoding from ever repeating a state, so it falls into no cycle. The
draft adds `noise_scale` times a row of Gaussian noise picked the same way by a second key
(specdec/engine/simulated/acceptance.py calibrates the scale). End-of-sequence ids are masked: a twin's completion
always runs to its budget.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

PAIR_VERSION = 1  # bump when the logits a key gives change (cached calibrations name it)
CONTEXT_TOKENS = 4  # tokens of context a position's logits depend on (with the position itself)
TABLE_VALUES = 2**21  # logits per table (rows x V), so a table costs 16 MB in float32 whatever V is
ZIPF_EXPONENT = 1.5  # p(rank r) ∝ r^-1.5 before jitter: the top token holds ~0.4 of the mass, as in a code LM
JITTER = 0.5  # std of the Gaussian noise added to every profile logit, so rows differ beyond their order
_NOISE_SALT = 0x5EED  # separates a position's draft-noise key from its target key
_MASK = 2**64 - 1


def position_key(seed: int, position: int, context: Sequence[int]) -> int:
    """The key of the logits after `context` (its last CONTEXT_TOKENS tokens, ending at `position`): a 64-bit hash,
    the same in every process (Python hashes int tuples without a random seed)."""
    return hash((seed, position, *context[-CONTEXT_TOKENS:])) & _MASK


class ShiftedRows:
    """R rows of V values, each readable at any circular shift as one copied row."""

    def __init__(self, rows: torch.Tensor):  # [R, V]
        self.count, self.vocab = rows.shape
        self._doubled = torch.cat([rows, rows], dim=1).flatten()  # [R * 2V]
        self._windows = self._doubled.unfold(0, self.vocab, 1)  # [R * 2V - V + 1, V]: row r at shift s from r*2V+s

    def starts(self, keys: Iterable[int]) -> torch.Tensor:
        """Where each key's row begins in the doubled storage [K]: row key % R, shifted by (key // R) % V."""
        return torch.tensor(
            [(key % self.count) * 2 * self.vocab + (key // self.count) % self.vocab for key in keys], dtype=torch.long
        )

    def read(self, starts: torch.Tensor) -> torch.Tensor:
        """The rows at `starts` [K], copied into one float32 tensor [K, V]."""
        return self._windows.index_select(0, starts)


def language_model_rows(count: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """[count, V] logits: -ZIPF_EXPONENT * ln(rank) over a random order of the ids, plus Gaussian jitter."""
    profile = -ZIPF_EXPONENT * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))  # [V]
    order = torch.rand(count, vocab, generator=generator).argsort(dim=1)  # [R, V]
    return profile[order] + JITTER * torch.randn(count, vocab, generator=generator)


class SyntheticPair:
    """The target's and the draft's logits for positions given by their keys (see the module doc)."""

    def __init__(self, vocab: int, seed: int, masked_ids: Iterable[int] = ()):
        self.vocab, self.seed = vocab, seed
        rows = max(8, TABLE_VALUES // vocab)
        generator = torch.Generator().manual_seed(seed)
        self.target_rows = ShiftedRows(language_model_rows(rows, vocab, generator))
        self.noise_rows = ShiftedRows(torch.randn(rows, vocab, generator=generator))
        self.masked_ids = torch.tensor(sorted(set(masked_ids)), dtype=torch.long)

    def target_logits(self, keys: Sequence[int]) -> torch.Tensor:
        """The target's float32 logits [K, V] at positions with these keys."""
        return self._masked(self.target_rows.read(self.target_rows.starts(keys)))

    def noise(self, keys: Sequence[int]) -> torch.Tensor:
        """The draft's noise rows [K, V] at positions with these keys (unscaled)."""
        return self.noise_rows.read(self.noise_rows.starts(noise_key(key) for key in keys))

    def draft_logits(self, keys: Sequence[int], noise_scale: float) -> torch.Tensor:
        """The draft's float32 logits [K, V]: the target's plus noise_scale times the positions' noise rows."""
        logits = self.target_rows.read(self.target_rows.starts(keys))  # [K, V]
        return self._masked(logits.add_(self.noise(keys), alpha=noise_scale))

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        if len(self.masked_ids):
            logits[:, self.masked_ids] = -math.inf
        return logits


def noise_key(key: int) -> int:
    """The draft-noise key of a position with target key `key`."""
    return hash((key, _NOISE_SALT)) & _MASK
