"""An LM head with 16-bit weights that writes float32 logits (specdec/engine/float32_head.py): what a bfloat16 head
rounds into a tie it keeps apart. The CUDA product (16-bit inputs, float32 output) has no CPU kernel; here the
head runs its CPU form, the inputs widened, which is the same arithmetic the CUDA product accumulates in."""

from __future__ import annotations

import torch
from tiny_models import tiny_llama
from torch import nn

from specdec.engine.float32_head import Float32LogitsHead, float32_head_refusal, use_float32_head


def test_a_bfloat16_head_rounds_near_ties_together_and_the_float32_head_keeps_them_apart():
    head = nn.Linear(4, 3, bias=False).to(torch.bfloat16)
    with torch.no_grad():  # two logits 1/500 of a bfloat16 step apart (at 8), and a smaller third
        head.weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 0.0078125, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]]))
    hidden = torch.tensor([[[8.0, 0.015625, 0.0, 0.0]]], dtype=torch.bfloat16)  # [1, 1, E]
    rounded = head(hidden)
    assert rounded.dtype == torch.bfloat16 and rounded[0, 0, 0] == rounded[0, 0, 1], "a tie: argmax says 0"
    Float32LogitsHead.convert(head)
    logits = head(hidden)  # [1, 1, V]
    assert logits.dtype == torch.float32 and logits.shape == (1, 1, 3)
    assert int(logits[0, 0].argmax()) == 1, "the larger logit wins"
    torch.testing.assert_close(logits[0], hidden[0].float() @ head.weight.float().t(), rtol=0, atol=0)
    head.revert()
    assert type(head) is nn.Linear and head(hidden).dtype == torch.bfloat16


def test_only_a_16_bit_cuda_head_is_converted_and_the_log_says_why_not():
    model = tiny_llama(32, 16, layers=1, seed=3)
    assert "already as wide" in float32_head_refusal(model)
    model = model.to(torch.bfloat16)
    assert "run on CUDA, not cpu" in float32_head_refusal(model)
    assert not use_float32_head(model) and type(model.lm_head) is nn.Linear
    model.lm_head.register_forward_hook(lambda *args: None)
    assert "hooked" in float32_head_refusal(model)
