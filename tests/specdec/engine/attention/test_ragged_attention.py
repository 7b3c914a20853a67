"""The compiled attention of short packed rows: what SDPA gives each row alone, for every row layout served."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from specdec.engine.attention.ragged_attention import kernel_fits, load_kernel


@pytest.fixture(scope="module")
def kernel():
    attend = load_kernel()
    assert attend is not None, "the kernel builds on these machines (g++ and ninja are installed)"
    return attend


def sdpa_row(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, count: int, offset: int, scale: float
) -> torch.Tensor:
    """One row alone through SDPA: its queries [H, n, D] against its sequence's keys/values [H_kv, L, D], causal."""
    length = start + count
    visible = torch.arange(length) <= (start + torch.arange(count)).unsqueeze(1)  # [n, L]
    out = F.scaled_dot_product_attention(
        query[None, :, offset : offset + count],
        keys[None, :, :length],
        values[None, :, :length],
        attn_mask=visible,
        scale=scale,
        enable_gqa=keys.shape[0] != query.shape[0],
    )
    return out[0].transpose(0, 1)  # [n, H, D]


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (4, 2, 64), (2, 2, 16), (3, 1, 32)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("block_size", [16, 5])
def test_rows_of_every_shape_match_sdpa_row_by_row(kernel, heads, kv_heads, head_dim, threads, block_size):
    """Rows of 1 to 16 queries after 0 to 300 cached positions, each in scattered blocks of a paged pool (block
    sizes that are and are not multiples of 4), packed in any order; grouped query heads; head sizes on the AVX2 path
    (64) and the generic one; one or two threads."""
    rng = random.Random(heads * 100 + head_dim + threads + block_size)
    capacity = 320
    blocks_per_row = -(-capacity // block_size)
    num_blocks = 9 * blocks_per_row + 4
    keys = torch.randn(kv_heads, num_blocks, block_size, head_dim)
    values = torch.randn(kv_heads, num_blocks, block_size, head_dim)
    free = list(range(num_blocks))
    rng.shuffle(free)
    layout, tables, offset = [], [], 0
    for _ in range(9):
        count = rng.choice([1, 2, 3, 4, 5, 7, 16])
        start = rng.choice([0, 1, 6, 57, 190, capacity - count])
        layout.append((len(tables), start, count, offset))
        tables.extend(free.pop() for _ in range(-(-(start + count) // block_size)))
        offset += count
    tokens = offset + 3  # three tokens of the step belong to no short row: the kernel leaves them alone
    query = torch.randn(1, tokens, heads, head_dim).transpose(1, 2)[0]  # [H, T, D], strided as in a model
    out = torch.full((tokens, heads, head_dim), 7.0)
    scale = head_dim**-0.5
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernel(query, keys, values, torch.tensor(layout), torch.tensor(tables), scale, out)
    finally:
        torch.set_num_threads(previous)
    for at_table, start, count, at in layout:
        table = torch.tensor(tables[at_table : at_table + -(-(start + count) // block_size)])
        row_keys = keys[:, table].reshape(kv_heads, -1, head_dim)  # [H_kv, blocks * B, D]
        row_values = values[:, table].reshape(kv_heads, -1, head_dim)
        torch.testing.assert_close(
            out[at : at + count], sdpa_row(query, row_keys, row_values, start, count, at, scale), atol=2e-5, rtol=1e-5
        )
    assert torch.equal(out[offset:], torch.full((3, heads, head_dim), 7.0))


def test_bad_layouts_are_refused_with_the_reason(kernel):
    keys = torch.randn(2, 2, 8, 64)
    query = torch.randn(2, 3, 64)
    rows, tables = torch.tensor([[0, 0, 3, 0]]), torch.tensor([1])
    with pytest.raises(RuntimeError, match="float32"):
        kernel(query.double(), keys, keys, rows, tables, 0.125, torch.empty(3, 2, 64))
    with pytest.raises(RuntimeError, match="rows must be int64"):
        kernel(query, keys, keys, rows.int(), tables, 0.125, torch.empty(3, 2, 64))
    with pytest.raises(RuntimeError, match="tables must be int64"):
        kernel(query, keys, keys, rows, tables.int(), 0.125, torch.empty(3, 2, 64))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(query, keys.transpose(2, 3), keys, rows, tables, 0.125, torch.empty(3, 2, 64))


def test_only_float32_cpu_models_with_head_sizes_of_whole_vectors_use_it():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert kernel_fits(cpu, torch.float32, 64)
    assert not kernel_fits(cpu, torch.bfloat16, 64)
    assert not kernel_fits(cuda, torch.float32, 64)
    assert not kernel_fits(cpu, torch.float32, 40)
