"""Batched row sampling: every row as logits_to_probs and sample_token give it alone, bad rows coded, no copy of a
packed pass's logits, and nothing read back."""

from __future__ import annotations

import math
import random

import torch
from host_syncs import HostSyncCounter

from specdec.sampling.row_sampling import (
    BadLogits,
    RowSettings,
    batched_probs,
    host_uniforms,
    inverse_cdf,
    joined_rows,
)
from specdec.sampling.rules import SamplingParams, Stream, logits_to_probs, sample_token

CPU = torch.device("cpu")


def random_params(rng: random.Random, seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.3, 1e-6]),
        top_k=rng.choice([0, 3, 50, 100, 200]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        seed=seed,
    )


def test_each_sampled_row_gets_the_one_row_probabilities_and_draw_and_greedy_rows_the_first_argmax():
    rng = random.Random(0)
    for trial in range(40):
        params = [random_params(rng, trial) for _ in range(20)]
        logits = torch.randn(20, 100, generator=torch.Generator().manual_seed(trial)) * 3  # [K, V]
        logits[3, :50] = -math.inf  # a row with masked tokens
        logits[5, 7] = logits[5, 9] = logits[5].max() + 1  # a tie for the argmax: the first index wins
        with HostSyncCounter() as syncs:
            probs, first_argmax, codes = batched_probs(logits, RowSettings.of(params, CPU))
            uniforms = host_uniforms([(trial, row, Stream.DRAFT) for row in range(20)], CPU)
            drawn = inverse_cdf(probs, uniforms) if probs.shape[1] else None
        assert syncs.reads == []
        assert codes.tolist() == [0] * 20
        for row, row_params in enumerate(params):
            if row_params.greedy:
                assert first_argmax[row] == int(logits[row].argmax())
                continue
            alone = logits_to_probs(logits[row], row_params)  # [V]
            assert torch.equal(probs[row], alone)
            assert int(drawn[row]) == sample_token(alone, row_params, row, Stream.DRAFT)


def test_bad_rows_are_coded_not_raised():
    logits = torch.randn(4, 10)
    logits[1, 3] = math.nan
    logits[2] = -math.inf
    logits[3, 0] = math.inf
    params = [SamplingParams(temperature=1.0)] * 4
    _, _, codes = batched_probs(logits, RowSettings.of(params, CPU))
    assert [BadLogits(code) for code in codes.tolist()] == [
        BadLogits.NONE,
        BadLogits.NAN_OR_POSINF,
        BadLogits.ALL_NEGINF,
        BadLogits.NAN_OR_POSINF,
    ]


def test_rows_of_one_pass_join_without_a_copy_and_others_are_copied():
    packed = torch.randn(9, 6)[:, :5]  # [K, V] a pass's logits, cut to the ids served
    blocks = list(packed.split([2, 3, 4]))
    joined = joined_rows(blocks)
    assert torch.equal(joined, packed) and joined.data_ptr() == packed.data_ptr()
    apart = [torch.randn(2, 5), torch.randn(3, 5)]
    assert torch.equal(joined_rows(apart), torch.cat(apart))
    out_of_order = [blocks[1], blocks[0]]
    assert torch.equal(joined_rows(out_of_order), torch.cat(out_of_order))
