"""The coupled rule's noise, made on the device that holds the probabilities (docs/architecture.md, "The sampling
rules").

Position t of a seeded request has a row of standard exponential noise e_t in R^V. Element i comes from a 32-bit
counter hash of the vocabulary index i under two key words k0, k1 (the 64-bit hash of (seed, t, GUMBEL) that
specdec/sampling/rules.py makes on the host, one per row): lowbias32((i * (k1 | 1)) ^ k0), a bijection of the index
per row, so two rows share a few of their hash inputs at most; its top 23 bits give a uniform u = (m + 0.5) 2^-23 in
(0, 1), and e = -log(u) is computed by a fixed sequence of IEEE float32 operations (the exponent from u's bits,
log(1 + r) by its atanh series), with no library logarithm and no fused multiply-add. Every element is therefore
the same bits on every device type, in the compiled CPU kernel (csrc/exponential_noise.cpp) and in the tensor ops
below that every other device runs. g = -log(e) is standard Gumbel noise, and argmax(log p + g) = argmax(p / e)
draws from p (the Gumbel-max trick) with one logarithm per element instead of two.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable, Sequence

import torch

from specdec.common.cpu_extensions import load_cpu_extension, widest_vector_flags
from specdec.common.host_copies import to_device

SOURCE = pathlib.Path(__file__).resolve().parent / "csrc" / "exponential_noise.cpp"
UNIFORM_BITS = 23  # bits of each uniform: (m + 0.5) 2^-23 is exact in float32
# float32 constants of the logarithm (exact as Python floats: each is a float32 value)
SQRT2 = 1.4142135381698608
LN2 = 0.6931471824645996
ATANH_SERIES = (0.1111111119389534, 0.1428571492433548, 0.20000000298023224, 0.3333333432674408)  # 1/9, 1/7, 1/5, 1/3

NoiseKernel = Callable[[torch.Tensor, torch.Tensor], None]


@functools.cache
def load_noise_kernel() -> NoiseKernel | None:
    """The CPU kernel's `exponential_noise(keys [R, 2] int32, out [R, V] float32)`, or None where it cannot be
    built. Built without contracting products and sums into fused multiply-adds, which would change bits."""
    vector, vector_flags = widest_vector_flags()
    flags = ["-O3", "-ffp-contract=off", "-fno-trapping-math", *vector_flags]
    module = load_cpu_extension("specdec_exponential_noise" + (f"_{vector}" if vector else ""), SOURCE, flags)
    return None if module is None else module.exponential_noise


def key_words(keys: Sequence[int]) -> torch.Tensor:
    """64-bit row keys as their low and high 32-bit words, int32 [R, 2] (the bits of unsigned words)."""
    words = [[key & 0xFFFFFFFF, key >> 32] for key in keys]
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words], dtype=torch.int32)


def exponential_noise(keys: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Standard exponential noise float32 [R, V] on `device`, row r keyed by keys[r] (a 64-bit integer): the CPU
    kernel on CPU where it builds, else the tensor ops on the device."""
    words = key_words(keys)  # [R, 2]
    if device.type == "cpu":
        kernel = load_noise_kernel()
        if kernel is not None:
            noise = torch.empty((len(keys), vocab_size), dtype=torch.float32)
            kernel(words, noise)
            return noise
    return noise_from_key_words(to_device(words, device), vocab_size)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash's mixing (Wellons' lowbias32) on int32 tensors holding unsigned words (products wrap; the
    right shifts are arithmetic, so each is masked to the bits a logical shift keeps)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x21F0AAAD
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * 0x735A2D97
    return x ^ ((x >> 15) & 0x1FFFF)


def noise_from_key_words(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The noise as tensor ops on the key words' device: words int32 [R, 2] -> float32 [R, V]. One IEEE operation
    per op, in the CPU kernel's order, so both give the same bits."""
    index = torch.arange(vocab_size, dtype=torch.int32, device=words.device)  # [V]
    hashed = _mix((index * (words[:, 1:] | 1)) ^ words[:, :1])  # [R, V]
    uniform = (((hashed >> (32 - UNIFORM_BITS)) & ((1 << UNIFORM_BITS) - 1)).float() + 0.5) * 2.0**-UNIFORM_BITS
    bits = uniform.view(torch.int32)
    exponent = (bits >> 23) - 127  # u = f 2^exponent, f in [1, 2)
    fraction = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)
    big = fraction > SQRT2  # f in (sqrt 2, 2): halved, so r = f - 1 stays small
    fraction = torch.where(big, fraction * 0.5, fraction)
    exponent = exponent + big.int()
    r = fraction - 1.0
    s = r / (r + 2.0)  # log(1 + r) = 2 atanh(s)
    s2 = s * s
    series = s2 * ATANH_SERIES[0]
    for coefficient in ATANH_SERIES[1:]:
        series = (series + coefficient) * s2
    log1p = s + s * series
    return -(exponent.float() * LN2 + (log1p + log1p))
