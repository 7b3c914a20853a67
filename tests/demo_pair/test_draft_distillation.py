"""The draft's distillation data and loss: the target's own continuations, a draft cut from the target."""

from __future__ import annotations

import tiny_models
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from demo_pair.draft_distillation import draft_from_target, sequence_distillation_loss
from demo_pair.target_outputs import PROMPT_LENGTHS, TOP_K, continue_batch, generate_target_outputs

EOS = 0


def tiny_llama(layers: int) -> LlamaForCausalLM:
    """A random tiny Llama (128 tokens, width 32) whose next-token distributions are far from uniform."""
    return tiny_models.tiny_llama(128, 32, layers, seed=layers, init_range=0.3)


def test_a_draft_as_deep_as_the_target_is_the_target_and_a_shallower_one_shares_its_bottom():
    target = tiny_llama(3)
    ids = torch.randint(1, 128, (2, 10))
    same = draft_from_target(target, target.config).eval()
    torch.testing.assert_close(same(ids).logits, target(ids).logits)
    shallow_config = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1})
    shallow = draft_from_target(target, shallow_config)
    assert len(shallow.model.layers) == 1
    torch.testing.assert_close(shallow.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight)
    torch.testing.assert_close(shallow.lm_head.weight, target.lm_head.weight)


def test_greedy_continuations_follow_the_targets_argmax_and_stop_counting_after_end_of_text():
    target = tiny_llama(2)
    prompts = torch.randint(1, 128, (3, 8))
    tokens, top_logprobs, top_ids, valid, sampled = continue_batch(target, prompts, 12, True, EOS)
    continuation = tokens[:, 8:]  # [B, C]
    assert tokens.shape == (3, 20) and top_ids.shape == top_logprobs.shape == (3, 12, TOP_K)
    assert torch.equal(continuation, top_ids[..., 0].long())
    assert not sampled.any()
    for row, row_valid in zip(continuation.tolist(), valid.tolist(), strict=True):
        ends = row.index(EOS) if EOS in row else len(row)
        assert row_valid == [i <= ends for i in range(len(row))]


def test_the_loss_is_lower_for_the_target_itself_than_for_a_draft_of_other_weights(tmp_path):
    target = tiny_llama(2)
    stream = torch.randint(1, 128, (400,))
    outputs = generate_target_outputs(target, stream, 6, 2, 8, EOS, seed=0, cache_path=tmp_path / "outputs.pt")
    assert outputs.prompt_length == list(PROMPT_LENGTHS)
    assert [bool(s.any()) for s in outputs.sampled] == [False, True, True, False]  # batches 2 and 5 of 6 sampled
    reloaded = generate_target_outputs(target, stream, 6, 2, 8, EOS, seed=0, cache_path=tmp_path / "outputs.pt")
    assert all(torch.equal(a, b) for a, b in zip(reloaded.tokens, outputs.tokens, strict=True))
    loss = sequence_distillation_loss(outputs, batch_size=4)
    with torch.no_grad():
        own = loss(target, torch.Generator().manual_seed(1))
        other = loss(tiny_llama(1), torch.Generator().manual_seed(1))
    assert torch.isfinite(own) and own < other
