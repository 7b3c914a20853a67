"""Linear layers on oneDNN compute what nn.Linear computes, on the same parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdec.engine.cpu_linears import OneDnnLinear, drop_onednn_copies, onednn_available, use_onednn_linears
from tests.tiny_models import tiny_llama

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 80])
def test_onednn_linears_give_nn_linear_logits(rows):
    model = tiny_llama(vocab_size=512, hidden=64, layers=2, seed=3)
    input_ids = torch.randint(0, 512, (1, rows), generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        expected = model(input_ids=input_ids).logits  # [1, rows, V]
        assert use_onednn_linears(model) == 1 + 2 * 7  # the head, and q, k, v, o, gate, up, down per layer
        got = model(input_ids=input_ids).logits
    assert isinstance(model.lm_head, OneDnnLinear)
    assert isinstance(model.model.layers[1].mlp.down_proj, OneDnnLinear)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_the_layers_keep_their_parameters_and_state_dict_and_can_drop_the_copies():
    model = tiny_llama(vocab_size=128, hidden=32, layers=1, seed=4)
    weight, keys = model.lm_head.weight, set(model.state_dict())
    use_onednn_linears(model)
    assert model.lm_head.weight is weight
    assert set(model.state_dict()) == keys
    drop_onednn_copies(model)
    assert not any(isinstance(module, OneDnnLinear) for module in model.modules())
    assert type(model.lm_head) is nn.Linear and not hasattr(model.lm_head, "packed_weight")
    model.to("meta")  # oneDNN's copies could not follow


def test_other_dtypes_keep_the_default_kernel():
    model = tiny_llama(vocab_size=128, hidden=32, layers=1, seed=5).to(torch.bfloat16)
    assert use_onednn_linears(model) == 0
    assert type(model.lm_head) is torch.nn.Linear
