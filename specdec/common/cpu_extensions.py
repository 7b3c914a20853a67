"""Building and loading the project's small C++ CPU kernels (torch's C++ extension builder, g++ and ninja).

A kernel is compiled once per machine and source (its name carries a hash of the source, so a changed source never
meets an old build; builds are cached under TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions). Where it
cannot be built (no compiler, no ninja), the caller gets None and uses its tensor-op path.
"""

from __future__ import annotations

import hashlib
import logging
import pathlib
import time
from types import ModuleType

import torch

log = logging.getLogger(__name__)


def avx2_flags() -> list[str]:
    """Compiler flags for AVX2 code where torch says this CPU has it (none otherwise)."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return ["-mavx2", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


def widest_vector_flags() -> tuple[str, list[str]]:
    """(a name for them, compiler flags) of the widest vectors torch says this CPU has: AVX-512, AVX2 or none, for
    loops the compiler vectorizes itself."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return "avx512", ["-mavx512f", "-mavx512vl", "-mavx512dq", "-mavx512bw", "-mprefer-vector-width=512"]
    return ("avx2", avx2_flags()) if capability == "AVX2" else ("", [])


def load_cpu_extension(name: str, source: pathlib.Path, flags: list[str]) -> ModuleType | None:
    """The compiled module of `source` (built on first use, then cached), or None where it cannot be built. The
    name says what the flags choose (e.g. AVX2 code): one name, one set of flags."""
    name += "_" + hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    started = time.perf_counter()
    log.info("loading the CPU kernel %s (compiled on first use, cached afterwards) ...", name)
    try:
        from torch.utils.cpp_extension import load

        module = load(name, [str(source)], extra_cflags=flags, verbose=False)
    except Exception as error:  # a missing compiler or ninja: the caller's tensor ops serve
        log.warning("CPU kernel %s unavailable (%s: %s)", name, type(error).__name__, error)
        return None
    log.info("CPU kernel %s ready in %.1fs", name, time.perf_counter() - started)
    return module
