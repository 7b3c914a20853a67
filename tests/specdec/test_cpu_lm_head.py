"""The LM head on oneDNN computes what nn.Linear computes, on the same parameters."""

from __future__ import annotations

import pytest
import torch

from specdec.cpu_lm_head import OneDnnLinear, onednn_available, use_onednn_lm_head
from tests.tiny_models import tiny_llama

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 5, 16, 80])
def test_onednn_head_gives_nn_linear_logits(rows):
    model = tiny_llama(vocab_size=512, hidden=64, layers=1, seed=3)
    input_ids = torch.randint(0, 512, (1, rows), generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        expected = model(input_ids=input_ids).logits  # [1, rows, V]
        assert use_onednn_lm_head(model)
        got = model(input_ids=input_ids).logits
    assert isinstance(model.lm_head, OneDnnLinear)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_the_head_keeps_its_parameters_and_state_dict():
    model = tiny_llama(vocab_size=128, hidden=32, layers=1, seed=4)
    weight, keys = model.lm_head.weight, set(model.state_dict())
    use_onednn_lm_head(model)
    assert model.lm_head.weight is weight
    assert set(model.state_dict()) == keys


def test_other_dtypes_keep_the_default_kernel():
    model = tiny_llama(vocab_size=128, hidden=32, layers=1, seed=5).to(torch.bfloat16)
    assert not use_onednn_lm_head(model)
    assert type(model.lm_head) is torch.nn.Linear
