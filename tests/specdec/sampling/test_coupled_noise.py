"""The coupled rule's noise (specdec/sampling/coupled_noise.py): the compiled CPU kernel and the tensor ops every
other device runs give the bits of an independent host reference, written here in numpy from the definition; and
the noise is standard exponential, a pure function of its key."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import kstest, pearsonr

from specdec.sampling import coupled_noise
from specdec.sampling.coupled_noise import exponential_noise, key_words, load_noise_kernel, noise_from_key_words
from specdec.sampling.rules import Stream, _position_key

MIN_P_VALUE = 0.001
CPU = torch.device("cpu")


def reference_noise(key: int, indices: np.ndarray) -> np.ndarray:
    """The definition on the host: lowbias32((i * (k1 | 1)) ^ k0) of each index i under the key's words k0 (low),
    k1 (high), its top 23 bits as u = (m + 0.5) 2^-23, then -log(u) step by step in float32 (exponent from the
    bits, log(1 + r) = 2 atanh(s))."""
    f32, u32 = np.float32, np.uint32

    def mix(x: np.ndarray) -> np.ndarray:
        x = x ^ (x >> u32(16))
        x = x * u32(0x21F0AAAD)
        x = x ^ (x >> u32(15))
        x = x * u32(0x735A2D97)
        return x ^ (x >> u32(15))

    hashed = mix((indices.astype(u32) * u32((key >> 32) | 1)) ^ u32(key & 0xFFFFFFFF))
    uniform = ((hashed >> u32(9)).astype(f32) + f32(0.5)) * f32(2.0**-23)
    bits = uniform.view(u32)
    exponent = (bits >> u32(23)).astype(np.int32) - 127
    fraction = ((bits & u32(0x7FFFFF)) | u32(0x3F800000)).view(f32)
    big = fraction > f32(np.sqrt(2.0))
    fraction = np.where(big, fraction * f32(0.5), fraction)
    exponent = exponent + big
    r = fraction - f32(1.0)
    s = r / (r + f32(2.0))
    s2 = s * s
    series = s2 * f32(1 / 9)
    for n in (7, 5, 3):
        series = (series + f32(1 / n)) * s2
    log1p = s + s * series
    return -(exponent.astype(f32) * f32(np.log(2.0)) + (log1p + log1p))


def bits(noise: torch.Tensor | np.ndarray) -> np.ndarray:
    array = noise.numpy() if isinstance(noise, torch.Tensor) else noise
    return array.view(np.uint32)


@pytest.fixture(scope="module")
def kernel():
    built = load_noise_kernel()
    if built is None:
        pytest.skip("the CPU noise kernel does not build here (no compiler)")
    return built


@settings(max_examples=40, deadline=None, database=None)
@given(
    draws=st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**40)), min_size=1, max_size=4),
    vocab=st.integers(1, 3000),
)
def test_the_kernel_and_the_tensor_ops_give_the_reference_bit_for_bit(kernel, draws, vocab):
    keys = [_position_key(seed, position, Stream.GUMBEL) for seed, position in draws]
    made = torch.empty((len(keys), vocab))
    kernel(key_words(keys), made)
    ops = noise_from_key_words(key_words(keys), vocab)
    for row, key in enumerate(keys):
        want = bits(reference_noise(key, np.arange(vocab)))
        assert np.array_equal(bits(made[row]), want)
        assert np.array_equal(bits(ops[row]), want)


@settings(max_examples=25, deadline=None, database=None)
@given(key=st.integers(0, 2**64 - 1), indices=st.lists(st.integers(0, 2**18 - 1), min_size=1, max_size=64))
def test_any_vocabulary_index_gets_the_reference_bits(kernel, key, indices):
    """Indices anywhere in a vocabulary of up to 2^18 tokens: both ways over the whole width, read at the indices."""
    width = max(indices) + 1
    made = torch.empty((1, width))
    kernel(key_words([key]), made)
    want = bits(reference_noise(key, np.array(indices)))
    assert np.array_equal(bits(made[0, indices]), want)
    assert np.array_equal(bits(noise_from_key_words(key_words([key]), width)[0, indices]), want)


def test_the_cpu_path_without_the_kernel_gives_the_same_bits(monkeypatch, kernel):
    keys = [_position_key(3, position, Stream.GUMBEL) for position in range(5)]
    with_kernel = exponential_noise(keys, 1001, CPU)
    monkeypatch.setattr(coupled_noise, "load_noise_kernel", lambda: None)
    assert np.array_equal(bits(exponential_noise(keys, 1001, CPU)), bits(with_kernel))


def test_the_noise_is_a_pure_function_of_its_key():
    state = torch.get_rng_state()
    keys = [_position_key(seed, position, Stream.GUMBEL) for seed, position in ((7, 100), (7, 101), (8, 100))]
    first = exponential_noise(keys, 64, CPU)
    assert torch.equal(exponential_noise(keys, 64, CPU), first)
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])
    assert first.dtype == torch.float32 and (first > 0).all() and first.isfinite().all()
    assert torch.equal(torch.get_rng_state(), state), "no global RNG is drawn from"


def test_the_noise_is_standard_exponential_and_its_log_standard_gumbel():
    keys = [_position_key(5, position, Stream.GUMBEL) for position in range(100)]
    noise = exponential_noise(keys, 200, CPU).double().flatten().numpy()
    assert kstest(noise, "expon").pvalue > MIN_P_VALUE
    assert kstest(-np.log(noise), "gumbel_r").pvalue > MIN_P_VALUE


def test_neighbouring_positions_and_indices_are_uncorrelated():
    keys = [_position_key(11, position, Stream.GUMBEL) for position in range(2)]
    rows = exponential_noise(keys, 20_000, CPU).double().numpy()
    assert pearsonr(rows[0], rows[1]).pvalue > MIN_P_VALUE, "adjacent positions"
    assert pearsonr(rows[0, :-1], rows[0, 1:]).pvalue > MIN_P_VALUE, "adjacent indices"
