"""A model's start-up on its device (docs/architecture.md, "The KV cache"): the self-test first, then the KV pool
allocated whole, then the CUDA graphs; a model refused packing holds no pool; settings that cannot run on CUDA are
refused before any weight is loaded. The CUDA-only steps run here on the CPU through the same code: the pool held
whole as on CUDA, and the graphs prepared eagerly from their buffers."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import AutoConfig

from specdec.common.settings import parse_settings
from specdec.engine import cuda_graph_steps, model_runtime, packed_self_test
from specdec.engine.attention.selection import AttentionBackendChoice
from specdec.engine.kv import budget
from specdec.engine.kv.budget import block_bytes
from specdec.engine.kv.pool import KVPool
from specdec.engine.kv.session import KVSession, run_forwards
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from verify_service.settings import VerifySettings

POOL_BLOCKS = 48


@pytest.fixture
def startup_events(monkeypatch) -> list[str]:
    """What start-up does, in order: 'self-test', 'pool', then 'capture' with whether every layer's buffers held
    the whole pool by then. The pool is held whole and graphs are refused or not as on CUDA; they are 'captured'
    eagerly."""
    events: list[str] = []
    self_test, make_pool = model_runtime.packed_mismatch, model_runtime.make_pool
    capture = cuda_graph_steps.CudaGraphSteps.capture

    def recorded_self_test(*args, **kwargs):
        events.append("self-test")
        return self_test(*args, **kwargs)

    def recorded_pool(*args, **kwargs):
        events.append("pool")
        return make_pool(*args, **kwargs)

    def recorded_capture(steps, cuda_graphs=True):
        pool = steps.pool
        whole = all(k is not None and k.shape[1] == pool.blocks.num_blocks + 1 for k in pool.keys + pool.values)
        events.append(f"capture (pool whole: {whole})")
        capture(steps, cuda_graphs=False)

    monkeypatch.setattr(model_runtime, "packed_mismatch", recorded_self_test)
    monkeypatch.setattr(model_runtime, "make_pool", recorded_pool)
    monkeypatch.setattr(budget, "holds_pool_whole", lambda device: True)
    refusal = model_runtime.cuda_graphs_refusal
    monkeypatch.setattr(
        model_runtime,
        "cuda_graphs_refusal",
        lambda settings, device, backend: refusal(settings, torch.device("cuda"), backend),
    )
    monkeypatch.setattr(cuda_graph_steps.CudaGraphSteps, "capture", recorded_capture)
    return events


def settings_of(directory, **overrides) -> ModelSettings:
    """The flex backend (what graphs replay) and a budget of POOL_BLOCKS blocks."""
    per_block = block_bytes(AutoConfig.from_pretrained(directory), torch.float32, 16)
    flex = AttentionBackendChoice.FLEX
    return ModelSettings(str(directory), attention_backend=flex, kv_cache_budget=POOL_BLOCKS * per_block, **overrides)


def test_the_self_test_runs_first_then_the_pool_is_allocated_whole_then_the_graphs_are_captured(
    tiny_pair_dirs, startup_events
):
    model = LoadedModel.load(settings_of(tiny_pair_dirs[0], cuda_graph_max_tokens=4))
    assert startup_events == ["self-test", "pool", "capture (pool whole: True)"]
    assert model.packed and model.kv_pool.blocks.num_blocks == POOL_BLOCKS and model.kv_pool.preallocated
    assert model.kv_pool.blocks.used == 0, "the pass that allocated the buffers gave its block back"
    session = KVSession(model, [3, 9, 14, 2, 7, 1])
    run_forwards([session.plan_prefill()])  # 6 tokens: past the largest bucket, eager
    run_forwards([session.plan_extend([5])])
    assert model.graph_steps.replays == 1, "a decode step is served by the prepared graphs"


def test_without_graphs_the_pool_is_still_allocated_whole_before_serving(tiny_pair_dirs, startup_events):
    model = LoadedModel.load(settings_of(tiny_pair_dirs[0], cuda_graphs=False))
    assert startup_events == ["self-test", "pool"] and model.graph_steps is None
    pool = model.kv_pool
    assert all(k is not None and k.shape[1] == POOL_BLOCKS + 1 for k in pool.keys + pool.values)


def test_a_model_refused_packing_allocates_no_pool_and_lets_the_probes_go(tiny_pair_dirs, startup_events, monkeypatch):
    probes: list[weakref.ref] = []

    class RecordedPool(KVPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            probes.append(weakref.ref(self))

    monkeypatch.setattr(packed_self_test, "KVPool", RecordedPool)
    self_test = model_runtime.packed_mismatch

    def refused(*args, **kwargs):
        self_test(*args, **kwargs)  # the probe runs on its pool, as ever
        return "refused by the test"

    monkeypatch.setattr(model_runtime, "packed_mismatch", refused)
    model = LoadedModel.load(settings_of(tiny_pair_dirs[0]))
    assert model.unpacked_reason == "refused by the test" and not model.packed
    assert model.kv_pool is None and model.graph_steps is None and "pool" not in startup_events
    gc.collect()
    assert probes and all(probe() is None for probe in probes), "the self-test's probe pool is freed"
    session = KVSession(model, [3, 9, 14])
    assert run_forwards([session.plan_prefill()])[0].shape[0] == 1, "it serves one sequence per pass"


def test_model_process_on_cuda_is_refused_naming_the_setting(tiny_pair_dirs):
    with pytest.raises(ValueError, match=r"model_process is for CPU models, not cuda:0.*--model-process"):
        ModelSettings(str(tiny_pair_dirs[0]), device="cuda:0", model_process=True)
    with pytest.raises(ValueError, match="--model-process"):
        ModelSettings.of(parse_settings(VerifySettings, ["--device", "cuda:1", "--model-process"]))
    assert ModelSettings(str(tiny_pair_dirs[0]), model_process=True).model_process  # on CPU it runs
