"""The direct forward of Llama models: the same logits as transformers' modules, bit for bit, on every backend."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch
import transformers

from specdec.engine import packed_forward
from specdec.engine.attention.selection import AttentionBackendChoice
from specdec.engine.direct_forward import direct_forward_refusal
from specdec.engine.kv.session import KVSession, run_forwards
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from tests.specdec.conftest import IDS, SHAPE, VOCAB


def passes_of_rows(model: LoadedModel, seed: int) -> list[torch.Tensor]:
    """Logits of a prefill pass of five rows of different lengths, then three verify-like passes with rollbacks."""
    rng = random.Random(seed)
    sessions = [KVSession(model, [rng.randrange(1, VOCAB) for _ in range(n)]) for n in (1, 3, 9, 17, 40)]
    logits = run_forwards([plan for s in sessions if (plan := s.plan_prefill()) is not None])
    for _ in range(3):
        blocks = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 5))] for _ in sessions]
        logits += run_forwards([s.plan_extend(block) for s, block in zip(sessions, blocks)])
        for session, block in zip(sessions, blocks):
            session.truncate(len(session) - rng.randint(0, len(block)))
    return logits


@pytest.mark.parametrize("backend", [AttentionBackendChoice.KERNEL, AttentionBackendChoice.SDPA], ids=str)
@pytest.mark.parametrize("which", ["tiny_target", "gqa_llama"])
def test_direct_passes_equal_transformers_modules_bit_for_bit(
    which, backend, tiny_pair_dirs, gqa_llama_dir, monkeypatch
):
    directory = tiny_pair_dirs[0] if which == "tiny_target" else gqa_llama_dir
    model = LoadedModel.load(ModelSettings(str(directory), attention_backend=backend))
    assert model.packed and direct_forward_refusal(model.model) is None
    direct = passes_of_rows(model, seed=4)
    monkeypatch.setattr(packed_forward, "direct_forward_refusal", lambda _model: "transformers' modules")
    modules = passes_of_rows(model, seed=4)
    assert len(direct) == len(modules) > 5
    for ours, theirs in zip(direct, modules):
        assert torch.equal(ours, theirs)


def test_llama_models_run_direct_and_others_keep_transformers_forward(tiny_pair_dirs):
    assert direct_forward_refusal(LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0]))).model) is None
    qwen = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE, **IDS, num_key_value_heads=1))
    assert "Qwen2ForCausalLM is not mirrored" in direct_forward_refusal(qwen)


def test_a_hooked_module_keeps_transformers_forward_while_hooked():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, **IDS))
    assert direct_forward_refusal(model) is None
    hook = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *_: None)  # e.g. an injected fault
    assert direct_forward_refusal(model) == "a module is hooked"
    hook.remove()
    assert direct_forward_refusal(model) is None


def test_the_decision_cache_lets_a_model_go():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, **IDS))
    assert direct_forward_refusal(model) is None
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
