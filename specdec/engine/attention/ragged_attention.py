"""The compiled CPU kernel for a packed step's short rows (specdec/engine/attention/csrc/ragged_attention.cpp), and its
loading.

A verify block or a draft step feeds each row a few queries (2-16) against its own cached positions. On CPU,
torch's SDPA kernel is built for long query blocks: for 5 queries against 190 positions (4 heads of 64) one
call costs ~130 µs with the keys and values out of cache, about twice this kernel's ~70 µs, and a packed step
makes one call per row and layer (flex_attention, compiled, was slower still for such rows: ~140 µs warm). This
kernel attends every short row of a step in one call per layer, reading each row's keys and values once, block by
block through the row's block table (specdec/engine/kv/pool.py).

It is compiled once per machine with torch's C++ extension builder (g++ and ninja; the build is cached under
TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions) when a float32 model is loaded on CPU. Where it
cannot be built, or for other devices and dtypes, packed attention uses SDPA.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable

import torch

from specdec.common.cpu_extensions import avx2_flags, load_cpu_extension

SOURCE = pathlib.Path(__file__).resolve().parent / "csrc" / "ragged_attention.cpp"

AttendRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor], None]


@functools.cache
def load_kernel() -> AttendRows | None:
    """The kernel's `ragged_attention(query [H, T, D], keys [H_kv, N, B, D], values, rows [R, 4], tables [M],
    scale, out [T, H, D])` (keys and values in blocks, read through each row's block table), compiled on first
    use (~40 s on 2 cores; cached afterwards), or None where it cannot be built (no compiler): callers then use
    SDPA. AVX2 code also uses FMA."""
    vector = avx2_flags()
    flags = ["-O3", *vector[:1], *(["-mfma"] if vector else []), *vector[1:]]  # the order existing builds used
    module = load_cpu_extension("specdec_paged_attention" + ("_avx2" if vector else ""), SOURCE, flags)
    return None if module is None else module.ragged_attention


def kernel_fits(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel can serve a model: float32 on CPU, head_dim a multiple of 16."""
    return device.type == "cpu" and dtype == torch.float32 and head_dim % 16 == 0
