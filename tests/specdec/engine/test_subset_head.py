"""A draft's head over a subset of the vocabulary: the kept ids' logits are the full head's, the others -inf, the
loader applies it from head_token_ids.json, and speculation with it stays exact."""

from __future__ import annotations

import shutil

import pytest
import torch

from specdec.decoding.reference_loop import speculative_generate, target_only_generate
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.engine.subset_head import SubsetHead, use_subset_head, write_head_ids
from specdec.sampling.rules import SamplingParams, SamplingRule
from tests.tiny_models import tiny_llama

KEPT = [0, 3, 5, 8, 13, 21, 34, 55]


def test_kept_ids_get_the_full_heads_logits_and_the_rest_minus_infinity():
    model = tiny_llama(64, 32, layers=1, seed=3)
    hidden = torch.randn(2, 5, 32)
    with torch.inference_mode():
        full = model.lm_head(hidden)  # [2, 5, 64]
        use_subset_head(model, KEPT)
        subset = model.lm_head(hidden)
    assert isinstance(model.get_output_embeddings(), SubsetHead) and subset.shape == full.shape
    torch.testing.assert_close(subset[..., KEPT], full[..., KEPT], rtol=1e-5, atol=1e-5)
    others = [i for i in range(64) if i not in KEPT]
    assert torch.isneginf(subset[..., others]).all()


@pytest.mark.parametrize("bad", [[], [3, 3], [-1, 2], [64]])
def test_bad_ids_are_refused(bad):
    with pytest.raises(ValueError, match="head_token_ids.json"):
        use_subset_head(tiny_llama(64, 32, layers=1, seed=3), bad)


@pytest.fixture(scope="module")
def subset_draft(tiny_pair_dirs, tmp_path_factory) -> LoadedModel:
    """The tiny pair's draft, served with a head over its target's 16 lowest ids plus EOS."""
    directory = tmp_path_factory.mktemp("subset") / "draft"
    shutil.copytree(tiny_pair_dirs[1], directory)
    write_head_ids(directory, list(range(16)), "a test's choice")
    return LoadedModel.load(ModelSettings(str(directory), draft_kernels=True))


def test_the_loader_serves_a_directorys_subset_head_at_full_width(subset_draft, tiny_pair):
    assert isinstance(subset_draft.model.get_output_embeddings(), SubsetHead)
    logits = subset_draft.forward(torch.tensor([[1, 2, 3]]), subset_draft.new_cache())  # [3, V]
    assert logits.shape[-1] == tiny_pair[0].vocab_size
    assert torch.isneginf(logits[:, 16:]).all() and torch.isfinite(logits[:, :16]).all()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_with_a_subset_head_decodes_as_the_target_alone(subset_draft, tiny_pair, temperature):
    target = tiny_pair[0]
    for seed, prompt in enumerate([[1, 2, 3], [40, 41, 42, 43], [60, 7]]):
        params = SamplingParams(temperature=temperature, seed=seed, rule=SamplingRule.COUPLED)
        expected = target_only_generate(target, prompt, params, 24).token_ids
        assert speculative_generate(target, subset_draft, prompt, 3, params, 24).token_ids == expected
