"""Steps padded to a bucket of tokens: the same logits as the packed pass, padding kept to the scratch block, and a
fixed-shape forward that torch.compile traces whole (what a CUDA graph captures)."""

from __future__ import annotations

import random

import pytest
import torch
from host_syncs import HostSyncCounter

from specdec.decoding.reference_loop import speculative_generate, target_only_generate
from specdec.engine.attention.selection import AttentionBackendChoice
from specdec.engine.bucketed_step import KEPT, BucketInputs, bucketed_logits, token_buckets
from specdec.engine.cuda_graph_steps import CudaGraphSteps, cuda_graphs_refusal
from specdec.engine.kv.session import KVSession, run_forwards
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.sampling.rules import SamplingParams, SamplingRule


@pytest.fixture(scope="module")
def flex_target(tiny_pair_dirs):
    # A fresh compile cache, as a serving process has: calls from other tests' models (other head sizes and
    # scalings) make dynamo trace flex_attention's scalars as dynamic, and those graphs read them back (.item()).
    torch._dynamo.reset()
    return LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0]), attention_backend=AttentionBackendChoice.FLEX))


def prefilled_sessions(model: LoadedModel) -> list[KVSession]:
    """Three sessions with prompts of 3, 20 and 37 tokens (one, two and three blocks), the last forked."""
    sessions = [KVSession(model, [(7 * k + i) % 60 + 1 for i in range(3 + 17 * k)]) for k in range(3)]
    run_forwards([session.plan_prefill() for session in sessions])
    return [*sessions, sessions[2].fork()]


def staged_rows(sessions: list[KVSession], new_tokens: list[list[int]]) -> list[tuple[list[int], list[int], int, int]]:
    """Each session's next forward planned (blocks reserved) as bucket rows: ids, table, start, logits kept."""
    rows = []
    for session, tokens in zip(sessions, new_tokens):
        plan = session.plan_extend(tokens)
        kv = session.cache
        kv.reserve(kv.length + len(plan.token_ids))
        rows.append((plan.token_ids, list(kv.table), kv.length, plan.logit_rows))
    return rows


NEW_TOKENS = [[5], [9, 10, 11, 12, 13], [3, 4], [3, 8, 2]]  # a decode step, a verify block, two forks diverging


def test_token_buckets_are_powers_of_two_up_to_the_largest_step():
    assert token_buckets(1) == [1]
    assert token_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 128]


@pytest.mark.parametrize("bucket", [16, 32])
def test_a_bucketed_step_gives_the_packed_pass_logits_and_writes_padding_to_the_scratch_block(flex_target, bucket):
    eager = prefilled_sessions(flex_target)
    expected = run_forwards([session.plan_extend(tokens) for session, tokens in zip(eager, NEW_TOKENS)])

    bucketed = prefilled_sessions(flex_target)
    rows = staged_rows(bucketed, NEW_TOKENS)
    pool = flex_target.kv_pool
    inputs = BucketInputs(bucket, pool.blocks_for(flex_target.max_context_tokens), flex_target.device)
    inputs.fill(rows, pool)
    widest = max(len(table) for _, table, _, _ in rows)
    assert inputs.table_elements_copied == len(rows) * widest < inputs.tables.numel(), "the step's tables, not M"
    held = {block for _, table, _, _ in rows for block in table}
    before = pool.keys[0].clone()
    with torch.inference_mode(), HostSyncCounter(below_functions=False) as syncs:
        logits = bucketed_logits(flex_target.model, pool, flex_target.attention_backend, inputs.staged, inputs.tables)
    assert syncs.reads == [], "a step a CUDA graph captures may read nothing back"
    assert logits.shape[0] == bucket and logits.isfinite().all(), "padding tokens hold finite values"
    kept = logits[inputs.staged[KEPT, : sum(keep for *_, keep in rows)]][:, : flex_target.vocab_size].float()
    for want, got in zip(expected, torch.split(kept, [keep for *_, keep in rows])):  # eager: a prefill's kept row first
        torch.testing.assert_close(got, want[-got.shape[0] :], rtol=1e-5, atol=1e-5)
    after = pool.keys[0]
    changed = {block for block in range(after.shape[1]) if not torch.equal(before[:, block], after[:, block])}
    assert changed <= held | {pool.scratch_block}, "a bucketed step writes only its rows' blocks and the scratch block"
    assert pool.scratch_block in changed


def test_the_bucketed_step_compiles_whole_without_a_graph_break(flex_target):
    sessions = prefilled_sessions(flex_target)
    rows = staged_rows(sessions, NEW_TOKENS)
    pool = flex_target.kv_pool
    inputs = BucketInputs(16, pool.blocks_for(flex_target.max_context_tokens), flex_target.device)
    inputs.fill(rows, pool)
    step = (flex_target.model, pool, flex_target.attention_backend, inputs.staged, inputs.tables)
    torch._dynamo.reset()
    compiled = torch.compile(bucketed_logits, fullgraph=True, backend="aot_eager")  # a graph break raises
    with torch.inference_mode():
        eager = bucketed_logits(*step)
        traced = compiled(*step)
    torch.testing.assert_close(traced, eager)


def test_steps_are_captured_only_on_cuda_with_flex_and_the_setting_on(flex_target, tiny_pair_dirs):
    assert flex_target.graph_steps is None, "no graphs on CPU"
    settings = ModelSettings(str(tiny_pair_dirs[0]), cuda_graphs=False)
    cuda = torch.device("cuda")
    assert cuda_graphs_refusal(settings, cuda, flex_target.attention_backend) == "cuda_graphs is off"
    on = ModelSettings(str(tiny_pair_dirs[0]))
    assert "CUDA device" in cuda_graphs_refusal(on, torch.device("cpu"), flex_target.attention_backend)
    assert cuda_graphs_refusal(on, cuda, flex_target.attention_backend) is None


def bucketed_pair(tiny_pair_dirs) -> tuple[LoadedModel, LoadedModel]:
    """The tiny target and draft on flex, every decode and verify step through eager bucketed steps: what the
    graphs replay, with the serving path's bookkeeping (staging, reservation, kept logits, lengths)."""
    pair = []
    for directory in tiny_pair_dirs:
        model = LoadedModel.load(ModelSettings(str(directory), attention_backend=AttentionBackendChoice.FLEX))
        steps = CudaGraphSteps(model.model, model.kv_pool, model.attention_backend, 16, model.max_context_tokens)
        steps.capture(cuda_graphs=False)
        model.graph_steps = steps
        pair.append(model)
    return pair[0], pair[1]


def test_speculative_decoding_through_bucketed_steps_matches_the_target_alone(tiny_pair_dirs, tiny_pair):
    target, draft = bucketed_pair(tiny_pair_dirs)
    plain_target = tiny_pair[0]
    rng = random.Random(5)
    coupled = SamplingParams(temperature=1.0, top_p=0.9, seed=11, rule=SamplingRule.COUPLED)
    for params in (SamplingParams(), coupled):  # both make every token the target's own
        for _ in range(4):
            prompt = [rng.randrange(1, 64) for _ in range(rng.randint(2, 20))]
            expected = target_only_generate(plain_target, prompt, params, max_new_tokens=16).token_ids
            assert speculative_generate(target, draft, prompt, 4, params, max_new_tokens=16).token_ids == expected
    assert target.graph_steps.replays > 0 and draft.graph_steps.replays > 0, "decode and verify steps were bucketed"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_replayed_steps_decode_as_the_eager_ones_on_cuda(tiny_pair_dirs):
    settings = dict(device="cuda:0", attention_backend=AttentionBackendChoice.FLEX, cuda_graph_max_tokens=32)
    graphs = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0]), **settings))
    eager = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0]), cuda_graphs=False, **settings))
    assert graphs.graph_steps is not None and eager.graph_steps is None
    decoded = []
    for model in (graphs, eager):
        sessions = prefilled_sessions(model)
        decoded.append(run_forwards([session.plan_extend(tokens) for session, tokens in zip(sessions, NEW_TOKENS)]))
    for got, want in zip(*decoded):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
