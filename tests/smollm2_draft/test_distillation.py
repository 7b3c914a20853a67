"""The SmolLM2 draft's shapes: a saved draft reloaded on the target's embeddings, a draft deepened by the target's
next layers, and the head's share of answer tokens."""

from __future__ import annotations

import pytest
import tiny_models
import torch
from safetensors.torch import save_file

from smollm2_draft.distillation import deepened_draft, layer_dropped_draft, share_in_head, trained_draft


def tiny_target():
    """A random tiny Llama (128 tokens, width 32, 4 layers)."""
    return tiny_models.tiny_llama(128, 32, 4, seed=4, init_range=0.3)


def trained_two_layer_draft(target):
    """The target's first 2 layers with weights moved away from the target's, as training would."""
    draft = layer_dropped_draft(target, 2)
    with torch.no_grad():
        for parameter in draft.model.layers.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return draft.eval()


def test_a_deepened_draft_starts_as_the_shallower_one_and_holds_the_targets_next_layers():
    target = tiny_target()
    shallower = trained_two_layer_draft(target)
    deeper = deepened_draft(shallower, target, 4).eval()
    ids = torch.randint(1, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(deeper(ids).logits, shallower(ids).logits)
    assert len(deeper.model.layers) == 4
    new_layer, target_layer = deeper.model.layers[3], target.model.layers[3]
    torch.testing.assert_close(new_layer.mlp.up_proj.weight, target_layer.mlp.up_proj.weight)
    assert not new_layer.mlp.down_proj.weight.any() and not new_layer.self_attn.o_proj.weight.any()
    assert not deeper.get_input_embeddings().weight.requires_grad


def test_a_saved_draft_without_its_embedding_reloads_on_the_targets(tmp_path):
    target = tiny_target()
    draft = trained_two_layer_draft(target)
    own = {name: t for name, t in draft.state_dict().items() if name != "model.embed_tokens.weight"}
    save_file({name: t.half().contiguous() for name, t in own.items()}, tmp_path / "model.safetensors")
    reloaded = trained_draft(target, tmp_path, 2).eval()
    ids = torch.randint(1, 128, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, draft(ids).logits, atol=0.05, rtol=0.01)
    assert torch.equal(reloaded.get_input_embeddings().weight, target.get_input_embeddings().weight)


def test_a_saved_draft_of_another_depth_is_refused(tmp_path):
    target = tiny_target()
    layer = {n: t for n, t in layer_dropped_draft(target, 1).state_dict().items() if ".layers." in n}
    save_file(layer, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="not a draft of 2 layers"):
        trained_draft(target, tmp_path, 2)


def test_the_heads_share_counts_answer_tokens_it_holds():
    assert share_in_head([[1, 2, 3], [3, 4]], kept=[3, 4]) == 3 / 5
    assert share_in_head([], kept=[1]) == 0
