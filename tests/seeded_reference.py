"""Seeded sampled requests through a stack against the in-process reference loop
(specdec/decoding/reference_loop.py)."""

from __future__ import annotations

from collections.abc import Sequence

from specdec.client import Client
from specdec.decoding.reference_loop import speculative_generate
from specdec.engine.model_runtime import LoadedModel
from specdec.sampling.rules import SamplingParams, SamplingRule

GAMMA = 3


def assert_seeded_requests_equal_the_reference(
    clients: Sequence[Client], target: LoadedModel, draft: LoadedModel, prompts: Sequence[list[int]], max_new: int
) -> None:
    """Prompt i, sampled with seed i (temperature 1, top-k 20, γ 3, so the coupled rule), comes back from every
    client token for token as the reference loop draws it."""
    for seed, prompt in enumerate(prompts):
        params = SamplingParams(temperature=1.0, top_k=20, seed=seed, rule=SamplingRule.COUPLED)
        expected = speculative_generate(target, draft, prompt, GAMMA, params, max_new).token_ids
        kwargs = dict(max_new_tokens=max_new, temperature=1.0, top_k=20, seed=seed, num_speculative_tokens=GAMMA)
        for client in clients:
            assert list(client.generate(prompt, **kwargs).token_ids) == expected
