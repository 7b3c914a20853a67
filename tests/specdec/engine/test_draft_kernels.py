"""A draft's cheaper CPU kernels: fused q/k/v and gate/up products, all in bfloat16, give the draft's logits up
to rounding, on the draft service only."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from draft_service.settings import DraftSettings
from specdec.common.settings import parse_settings
from specdec.engine.cpu_linears import onednn_available
from specdec.engine.draft_kernels import (
    GATE_UP,
    QKV,
    Bf16Linear,
    FusedLinear,
    bf16_products_fast,
    drop_draft_kernels,
    fused_projections,
    runs_bf16_products,
    use_draft_kernels,
    use_float32_layer_products,
)
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from tests.specdec.conftest import IDS, SHAPE
from tests.specdec.engine.test_direct_forward import passes_of_rows
from verify_service.settings import VerifySettings

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 9])
def test_a_fused_product_gives_each_layers_output(rows):
    torch.manual_seed(rows)
    layers = [nn.Linear(32, out, bias=True) for out in (32, 16, 16)]
    hidden = torch.randn(1, rows, 32)
    with torch.inference_mode():
        fused = FusedLinear(layers)(hidden)
        for layer, output in zip(layers, fused):
            torch.testing.assert_close(output, layer(hidden), rtol=1e-5, atol=1e-5)
    assert FusedLinear.fits(layers) and not FusedLinear.fits([*layers, nn.Linear(16, 8)])


@pytest.mark.skipif(not bf16_products_fast(), reason="no AMX or AVX-512 BF16: the head stays float32")
def test_the_bfloat16_head_keeps_its_parameter_and_returns_float32_logits_close_to_its_own():
    torch.manual_seed(0)
    head = nn.Linear(64, 512, bias=False)
    weight, hidden = head.weight, torch.randn(5, 64)
    with torch.inference_mode():
        expected = head(hidden)
        Bf16Linear.convert(head)
        got = head(hidden)
    assert head.weight is weight and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("which", ["tiny_draft", "gqa_llama"])
def test_a_draft_with_its_kernels_gives_its_logits_up_to_rounding(which, tiny_pair_dirs, gqa_llama_dir):
    directory = str(tiny_pair_dirs[1] if which == "tiny_draft" else gqa_llama_dir)
    plain = LoadedModel.load(ModelSettings(directory))
    fast = LoadedModel.load(ModelSettings(directory, draft_kernels=True))
    layers = fast.model.model.layers
    assert all(fused_projections(layer.self_attn, QKV) is not None for layer in layers)
    assert all(fused_projections(layer.mlp, GATE_UP) is not None for layer in layers)
    assert isinstance(fast.model.lm_head, Bf16Linear) == bf16_products_fast()
    assert not any(fused_projections(layer.self_attn, QKV) for layer in plain.model.model.layers)
    tolerance = 5e-2 if bf16_products_fast() else 1e-5  # of the largest logit: bfloat16 keeps 8 bits a product
    for ours, theirs in zip(passes_of_rows(fast, seed=2), passes_of_rows(plain, seed=2), strict=True):
        assert (ours - theirs).abs().max() <= tolerance * theirs.abs().max()


def test_the_fused_layers_hold_their_weights_once_and_their_modules_still_compute(tiny_pair_dirs):
    plain = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[1]))).model
    fast = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[1]), draft_kernels=True)).model
    attention = fast.model.layers[0].self_attn
    fused = fused_projections(attention, QKV)
    for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
        assert type(proj) is nn.Linear  # its own oneDNN copy dropped
        assert proj.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    input_ids = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        tolerance = 1e-1 if bf16_products_fast() else 1e-5
        torch.testing.assert_close(
            fast(input_ids=input_ids).logits, plain(input_ids=input_ids).logits, rtol=tolerance, atol=tolerance
        )


def test_a_draft_whose_bfloat16_products_are_refused_stays_packed_in_float32(tiny_pair_dirs):
    plain = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[1])))
    fast = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[1]), draft_kernels=True))
    use_float32_layer_products(fast.model)  # what the start-up self-test does when they drift past its tolerance
    assert not runs_bf16_products(fast.model) and fast.packed
    assert all(fused_projections(layer.mlp, GATE_UP).dtype == torch.float32 for layer in fast.model.model.layers)
    tolerance = 5e-2 if bf16_products_fast() else 1e-5  # the head alone in bfloat16
    for ours, theirs in zip(passes_of_rows(fast, seed=3), passes_of_rows(plain, seed=3), strict=True):
        assert (ours - theirs).abs().max() <= tolerance * theirs.abs().max()


def test_the_kernels_can_be_dropped_for_the_meta_device(tiny_pair_dirs):
    model = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[1]), draft_kernels=True)).model
    keys = set(model.state_dict())
    drop_draft_kernels(model)
    assert not any(isinstance(module, Bf16Linear) for module in model.modules())
    assert not any(fused_projections(layer.mlp, GATE_UP) for layer in model.model.layers)
    assert set(model.state_dict()) == keys
    model.to("meta")  # no copy is left that could not follow


def test_other_models_and_dtypes_are_left_alone():
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, **IDS)).to(torch.bfloat16)
    qwen = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE, **IDS, num_key_value_heads=1))
    for model in (llama, qwen):
        assert use_draft_kernels(model) == 0
        assert type(model.lm_head) is nn.Linear
        assert not any(fused_projections(module, QKV) for module in model.modules())


def test_the_draft_service_turns_them_on_and_the_verify_service_never_does():
    assert ModelSettings.of(parse_settings(DraftSettings, [], environ={})).draft_kernels is True
    assert ModelSettings.of(parse_settings(DraftSettings, ["--no-draft-kernels"], environ={})).draft_kernels is False
    assert ModelSettings.of(parse_settings(VerifySettings, [], environ={})).draft_kernels is False
