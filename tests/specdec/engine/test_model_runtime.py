"""Loading models: a draft and a target that share a tokenizer but pad their embedding matrices to different sizes
(as Qwen2.5-7B's 152,064 rows against Qwen2.5-0.5B's 151,936, for 151,665 ids) are a valid pair, and ids past the
tokenizer are never drafted or emitted."""

from __future__ import annotations

import pytest
import torch
from tiny_models import noisy_copy, save, tiny_llama, word_tokenizer
from transformers import LlamaForCausalLM

from specdec.decoding.reference_loop import speculative_generate, target_only_generate
from specdec.engine.model_runtime import LoadedModel, ModelSettings, check_same_vocabulary
from specdec.sampling.rules import SamplingParams, SamplingRule

TOKENIZER_IDS = 60


def padded(model: LlamaForCausalLM, rows: int) -> LlamaForCausalLM:
    """The model with its embedding and LM head grown to `rows` rows; the padding rows' logits are made the largest,
    so a runtime that served them would draft and emit them."""
    model.resize_token_embeddings(rows)
    with torch.no_grad():
        model.lm_head.weight[TOKENIZER_IDS:] = 50 * model.lm_head.weight[:TOKENIZER_IDS].abs().max()
    return model


@pytest.fixture(scope="module")
def padded_pair(tmp_path_factory) -> tuple[LoadedModel, LoadedModel]:
    """(target with 72 embedding rows, draft with 64), one tokenizer of 60 ids."""
    root = tmp_path_factory.mktemp("padded_pair")
    tokenizer = word_tokenizer(TOKENIZER_IDS)
    target = tiny_llama(TOKENIZER_IDS, 32, layers=2, seed=1)
    draft = noisy_copy(target, 0.2, seed=2)
    directories = (
        save(padded(target, 72), tokenizer, root / "target"),
        save(padded(draft, 64), tokenizer, root / "draft"),
    )
    return tuple(LoadedModel.load(ModelSettings(str(directory))) for directory in directories)


def test_a_pair_padded_to_different_sizes_is_accepted_and_serves_the_tokenizers_ids(padded_pair):
    target, draft = padded_pair
    assert (target.model.config.vocab_size, draft.model.config.vocab_size) == (72, 64)
    check_same_vocabulary(target.identity, draft.identity)  # no error: one tokenizer
    assert target.vocab_size == draft.vocab_size == TOKENIZER_IDS


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams(1.0, seed=4, rule=SamplingRule.COUPLED)],
    ids=["greedy", "rejection", "coupled"],
)
def test_padded_ids_are_never_drafted_or_emitted(padded_pair, sampling):
    target, draft = padded_pair
    prompt = [5, 9, 13, 2]
    result = speculative_generate(target, draft, prompt, 4, sampling, 24)
    assert result.token_ids and max(result.token_ids) < TOKENIZER_IDS
    assert result.stats.drafted > 0
    if not sampling.temperature or sampling.rule is SamplingRule.COUPLED:  # the plain decoder's tokens exactly
        assert result.token_ids == target_only_generate(target, prompt, sampling, 24).token_ids
