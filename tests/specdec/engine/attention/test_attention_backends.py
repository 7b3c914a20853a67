"""Every attention backend gives each row of a packed step exactly its own sequence's attention."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import specdec.engine.attention.flex_backend
from specdec.common.settings import parse_settings
from specdec.engine.attention.flex_backend import FlexBackend
from specdec.engine.attention.flex_layout import FLEX_BLOCK_SIZES, Q_TILE
from specdec.engine.attention.kernel_backend import KernelBackend
from specdec.engine.attention.ragged_attention import load_kernel
from specdec.engine.attention.sdpa_backend import SdpaBackend
from specdec.engine.attention.selection import AttentionBackendChoice, choose_attention_backend
from specdec.engine.cuda_graph_steps import CudaGraphSteps
from specdec.engine.kv.pool import KVPool
from specdec.engine.kv.session import KVSession, run_forwards
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.engine.packed_step import PackedRow, PackedStep
from verify_service.settings import VerifySettings

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


@pytest.mark.parametrize("block_size", [16, 32])
def test_every_flex_call_asks_the_kernel_for_the_tiles_of_its_mask(tiny_pair_dirs, monkeypatch, block_size):
    """Packed passes (a prefill, a verify block beside a decode step) and a bucketed step: every flex_attention call
    passes kernel_options whose BLOCK_M x BLOCK_N are its block mask's query tile x KV block, and takes the main
    kernel (the compiler's default tiles do not divide those blocks, and the decode kernel would make its own)."""
    settings = ModelSettings(
        str(tiny_pair_dirs[0]), attention_backend=AttentionBackendChoice.FLEX, kv_block_size=block_size
    )
    target = LoadedModel.load(settings)
    seen = []
    attend = specdec.engine.attention.flex_backend.flex_attention

    def checked(*args, block_mask, kernel_options, **kwargs):
        seen.append((block_mask.BLOCK_SIZE, kernel_options))
        return attend(*args, block_mask=block_mask, kernel_options=kernel_options, **kwargs)

    monkeypatch.setattr(specdec.engine.attention.flex_backend, "flex_attention", checked)
    sessions = [KVSession(target, [5] * 40), KVSession(target, [7] * 3)]
    run_forwards([s.plan_prefill() for s in sessions])
    run_forwards([sessions[0].plan_extend([9, 4, 2, 8, 1]), sessions[1].plan_extend([6])])
    steps = CudaGraphSteps(target.model, target.kv_pool, target.attention_backend, 8, target.max_context_tokens)
    steps.capture(cuda_graphs=False)  # every bucket's step, eagerly from its buffers
    assert len(seen) == (2 + len(steps.buckets)) * target.model.config.num_hidden_layers  # a call per pass and layer
    for tiles, options in seen:
        assert tiles == (Q_TILE, block_size)
        assert (options["BLOCK_M"], options["BLOCK_N"]) == tiles and options["FORCE_USE_FLEX_ATTENTION"]


def test_only_block_sizes_the_compiled_kernels_take_are_accepted_for_flex_on_cuda(tiny_pair_dirs):
    model = str(tiny_pair_dirs[0])
    for block_size in FLEX_BLOCK_SIZES:
        ModelSettings(model, device="cuda:0", kv_block_size=block_size)  # auto is flex on CUDA
    for choice in (AttentionBackendChoice.AUTO, AttentionBackendChoice.FLEX):
        with pytest.raises(ValueError, match=r"kv_block_size 24: .*16, 32, 64, 128.*\(--kv-block-size\)"):
            ModelSettings(model, device="cuda:0", attention_backend=choice, kv_block_size=24)
    with pytest.raises(ValueError, match="--kv-block-size"):
        ModelSettings.of(parse_settings(VerifySettings, ["--device", "cuda:1", "--kv-block-size", "8"]))
    ModelSettings(model, device="cuda:0", attention_backend=AttentionBackendChoice.SDPA, kv_block_size=24)
    ModelSettings(model, attention_backend=AttentionBackendChoice.FLEX, kv_block_size=8)  # eager on CPU: any size
    with pytest.raises(ValueError, match="kv_block_size must be >= 1"):
        ModelSettings(model, kv_block_size=0)
