"""Fixtures of the specdec tests: a tiny Llama with the variants the direct forward mirrors."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import save, word_tokenizer

VOCAB = 64
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96)
IDS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0, max_position_embeddings=256, initializer_range=0.4)


@pytest.fixture(scope="module")
def gqa_llama_dir(tmp_path_factory):
    """A tiny Llama with grouped-query attention, biased projections and scaled rotary angles."""
    torch.manual_seed(11)
    config = transformers.LlamaConfig(
        **SHAPE,
        **IDS,
        num_key_value_heads=2,
        attention_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
    )
    model = transformers.LlamaForCausalLM(config).eval()
    return save(model, word_tokenizer(VOCAB), tmp_path_factory.mktemp("gqa_llama"))
