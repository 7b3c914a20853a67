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
import hashlib
import logging
import pathlib
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).resolve().parent / "csrc" / "ragged_attention.cpp"

AttendRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor], None]


def _build_flags() -> tuple[str, list[str]]:
    """The extension's name and compiler flags for this CPU: AVX2 + FMA code where torch says the CPU has it."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return "specdec_paged_attention_avx2", [
            "-O3",
            "-mavx2",
            "-mfma",
            "-DCPU_CAPABILITY=AVX2",
            "-DCPU_CAPABILITY_AVX2",
        ]
    return "specdec_paged_attention", ["-O3"]


@functools.cache
def load_kernel() -> AttendRows | None:
    """The kernel's `ragged_attention(query [H, T, D], keys [H_kv, N, B, D], values, rows [R, 4], tables [M],
    scale, out [T, H, D])` (keys and values in blocks, read through each row's block table), compiled on first
    use (~40 s on 2 cores; cached afterwards), or None where it cannot be
    built (no compiler): callers then use SDPA."""
    from torch.utils.cpp_extension import load

    name, flags = _build_flags()
    name += "_" + hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]  # a changed source never meets an old build
    started = time.perf_counter()
    log.info("loading the ragged attention kernel %s (compiled on first use, cached afterwards) ...", name)
    try:
        module = load(name, [str(SOURCE)], extra_cflags=flags, verbose=False)
    except Exception as error:  # a missing compiler or ninja: serve with SDPA
        log.warning(
            "ragged attention kernel unavailable (%s: %s); packed attention uses SDPA", type(error).__name__, error
        )
        return None
    log.info("ragged attention kernel ready in %.1fs", time.perf_counter() - started)
    return module.ragged_attention


def kernel_fits(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel can serve a model: float32 on CPU, head_dim a multiple of 16."""
    return device.type == "cpu" and dtype == torch.float32 and head_dim % 16 == 0
