"""Every attention backend gives each row of a packed step exactly its own sequence's attention."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import specdec.engine.attention.flex_backend
from specdec.engine.attention.flex_backend import FlexBackend
from specdec.engine.attention.kernel_backend import KernelBackend
from specdec.engine.attention.ragged_attention import load_kernel
from specdec.engine.attention.sdpa_backend import SdpaBackend
from specdec.engine.attention.selection import AttentionBackendChoice, choose_attention_backend
from specdec.engine.kv.pool import KVPool
from specdec.engine.kv.session import KVSession, run_forwards
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.engine.packed_step import PackedRow, PackedStep

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 4
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_backend(name: str):
    if name == "kernel":
        kernel = load_kernel()
        if kernel is None:
            pytest.skip("the CPU kernel cannot be built here")
        return KernelBackend(kernel)
    return SdpaBackend() if name == "sdpa" else FlexBackend(torch.device("cpu"))


def one_sequence_attention(query, keys, values, start, window):
    """query [1, H, n, D] at positions start.., keys/values [1, H_kv, start+n, D] of one sequence: [n, H, D]."""
    positions = torch.arange(keys.shape[2])
    queries = start + torch.arange(query.shape[2])[:, None]
    visible = positions <= queries
    if window is not None:
        visible &= positions > queries - window
    out = F.scaled_dot_product_attention(
        query.float(), keys.float(), values.float(), attn_mask=visible, enable_gqa=True
    )  # [1, H, n, D]
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["kernel", "sdpa", "flex"])
def test_a_step_of_prefills_decodes_verify_blocks_and_forks_matches_one_sequence_attention(name, dtype, window):
    """Rows of a prefill from 0, a prefill after a cache, a decode step, a verify block and two forks sharing
    their parent's blocks, grouped heads (4 query heads on 2 key/value heads), in one step of one layer."""
    if name == "kernel" and dtype != torch.float32:
        pytest.skip("the kernel serves float32 only")
    backend = make_backend(name)
    generator = torch.Generator().manual_seed(7)
    pool = KVPool(num_layers=1, num_blocks=64, block_size=BLOCK)
    # (cached positions, new tokens) per row; the last two rows are forks of a parent with 11 cached positions
    shapes = [(0, 20), (6, 18), (13, 1), (22, 5), (11, 3), (11, 2)]
    history_keys, history_values, sequences = [], [], []

    def random_positions(count):
        return torch.randn(KV_HEADS, count, HEAD_DIM, generator=generator).to(dtype)  # [H_kv, n, D]

    for cached, _ in shapes[:4] + shapes[4:5]:
        kv = pool.new_sequence()
        kv.reserve(cached)
        keys, values = random_positions(cached), random_positions(cached)
        places = torch.arange(cached)
        blocks = torch.tensor([kv.table[p // BLOCK] for p in range(cached)], dtype=torch.long)
        pool.write(0, blocks, places % BLOCK, keys.transpose(0, 1), values.transpose(0, 1))
        kv.length = cached
        sequences.append(kv)
        history_keys.append(keys)
        history_values.append(values)
    sequences.append(copy.deepcopy(sequences[4]))  # a fork: shares every block of its parent
    history_keys.append(history_keys[4])
    history_values.append(history_values[4])
    for kv, (cached, count) in zip(sequences, shapes):
        kv.reserve(cached + count)
    step = PackedStep(
        [PackedRow(kv, c, n) for kv, (c, n) in zip(sequences, shapes)], torch.device("cpu"), dtype, backend
    )
    total = step.total_tokens
    new_keys, new_values = random_positions(total), random_positions(total)  # [H_kv, T, D]
    keys, values = pool.write(
        0, step.write_at[0], step.write_at[1], new_keys.transpose(0, 1), new_values.transpose(0, 1)
    )
    query = torch.randn(1, HEADS, total, HEAD_DIM, generator=generator).to(dtype)  # [1, H, T, D]

    attended = backend.attend(step, query, keys, values, HEAD_DIM**-0.5, window)  # [T, H, D]

    assert attended.shape == (total, HEADS, HEAD_DIM) and attended.dtype == dtype
    for i, (cached, _) in enumerate(shapes):
        begin, end = step.offsets[i], step.offsets[i + 1]
        row_keys = torch.cat([history_keys[i], new_keys[:, begin:end]], dim=1)[None]  # [1, H_kv, cached+n, D]
        row_values = torch.cat([history_values[i], new_values[:, begin:end]], dim=1)[None]
        expected = one_sequence_attention(query[:, :, begin:end], row_keys, row_values, cached, window)
        torch.testing.assert_close(attended[begin:end].float(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("rows", [1, 5])
def test_flex_attends_every_row_of_a_step_in_one_call_per_layer(tiny_pair_dirs, monkeypatch, rows):
    """However many rows a step has, the flex backend calls flex_attention once per layer, and each row still gets
    its own logits."""
    target = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0]), attention_backend=AttentionBackendChoice.FLEX))
    calls = []
    attend = specdec.engine.attention.flex_backend.flex_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[2])  # the query's tokens
        return attend(*args, **kwargs)

    monkeypatch.setattr(specdec.engine.attention.flex_backend, "flex_attention", counted)
    sessions = [KVSession(target, [3 + i] * (4 + 5 * i)) for i in range(rows)]
    run_forwards([s.plan_prefill() for s in sessions])
    calls.clear()
    results = run_forwards([s.plan_extend([9, 4, 2]) for s in sessions])  # the prefill kept each prompt's last row
    assert calls == [3 * rows] * target.model.config.num_hidden_layers
    for session, logits in zip(sessions, results):
        expected = target.model(input_ids=torch.tensor([session.tokens])).logits[0, -4:].float()
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_auto_chooses_the_kernel_on_cpu_float32_flex_on_cuda_and_sdpa_otherwise():
    cpu, cuda, auto = torch.device("cpu"), torch.device("cuda"), AttentionBackendChoice.AUTO
    expected_cpu = "kernel" if load_kernel() is not None else "sdpa"
    assert choose_attention_backend(auto, cpu, torch.float32, 64)[0].name == expected_cpu
    assert choose_attention_backend(auto, cpu, torch.bfloat16, 64)[0].name == "sdpa"
    assert choose_attention_backend(auto, cpu, torch.float32, 40)[0].name == "sdpa"
    assert choose_attention_backend(auto, cuda, torch.bfloat16, 128)[0].name == "flex"
    assert choose_attention_backend(AttentionBackendChoice.SDPA, cuda, torch.bfloat16, 128)[0].name == "sdpa"
    with pytest.raises(ValueError, match="kernel serves CPU float32"):
        choose_attention_backend(AttentionBackendChoice.KERNEL, cpu, torch.bfloat16, 64)
