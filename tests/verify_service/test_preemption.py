"""A verify replica whose KV budget holds a third of its sessions' working set: new sessions queue instead of being
refused, sessions that cannot grow preempt the newest ones, and every session still decodes what the target alone
decodes, speculative blocks (accepted and rejected) included."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from served_verifier import served

from specdec.decoding.reference_loop import target_only_generate
from specdec.engine.kv.budget import block_bytes
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.sampling.rules import SamplingParams
from specdec.serving.wire import sampling_to_proto
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verify_service.service import VerifyService
from verify_service.servicer import VerifierServicer
from verify_service.settings import VerifySettings

SESSIONS = 6
NEW_TOKENS = 40
PROMPT_LENGTH = 6
BLOCK_SIZE = 16
BUDGET_BLOCKS = 6  # each session grows to 3 blocks: 18 at once would be needed


def prompt(index: int) -> list[int]:
    return [(7 * index + 3 * i) % 60 + 1 for i in range(PROMPT_LENGTH)]


@pytest.fixture(scope="module")
def target(long_pair_dirs) -> LoadedModel:
    directory = str(long_pair_dirs[0])
    config = LoadedModel.load(ModelSettings(directory)).model.config
    budget = BUDGET_BLOCKS * block_bytes(config, torch.float32, BLOCK_SIZE)
    return LoadedModel.load(ModelSettings(directory, kv_cache_budget=budget, kv_block_size=BLOCK_SIZE))


async def decode(stub: verifier_pb2_grpc.VerifierStub, index: int, expected: list[int]) -> list[int]:
    """Opens a session and decodes it in rounds of 3 drafted tokens: every other round's draft is the target's own
    continuation (all accepted), the others' have a wrong second token (rejected there)."""
    session_id = f"session-{index}"
    await stub.OpenSession(
        verifier_pb2.OpenVerifySessionRequest(
            session_id=session_id, prompt_token_ids=prompt(index), sampling=sampling_to_proto(SamplingParams())
        ),
        timeout=60,
    )
    tokens: list[int] = []
    while len(tokens) < NEW_TOKENS:
        draft = expected[len(tokens) : len(tokens) + 3]
        if len(tokens) % 2 and len(draft) > 1:
            draft = [draft[0], (draft[1] + 1) % 64, *draft[2:]]
        reply = await stub.Verify(
            verifier_pb2.VerifyRequest(
                session_id=session_id, base_len=PROMPT_LENGTH + len(tokens), draft_token_ids=draft
            ),
            timeout=60,
        )
        tokens.extend([*reply.accepted_token_ids, reply.next_token_id])
    await stub.CloseSession(common_pb2.CloseSessionRequest(session_id=session_id), timeout=60)
    return tokens[:NEW_TOKENS]


def test_sessions_past_the_budget_queue_and_preempt_and_decode_exactly(target):
    expected = [
        target_only_generate(target, prompt(i), SamplingParams(), NEW_TOKENS + 3).token_ids for i in range(SESSIONS)
    ]
    preemptions: list[None] = []
    waits: list[tuple[float, bool]] = []
    service = VerifyService(VerifySettings(model=""), target, on_preempt=lambda: preemptions.append(None))
    servicer = VerifierServicer(service, on_queue_wait=lambda seconds, resuming: waits.append((seconds, resuming)))

    async def scenario() -> list[list[int] | grpc.aio.AioRpcError]:
        async with served(servicer) as stub:
            results = await asyncio.gather(
                *(decode(stub, i, expected[i]) for i in range(SESSIONS)), return_exceptions=True
            )
            info = await stub.Info(common_pb2.InfoRequest(), timeout=30)
            assert (info.active_sessions, info.kv_blocks_used) == (0, 0)
            return results

    results = asyncio.run(scenario())
    assert [r if isinstance(r, Exception) else None for r in results] == [None] * SESSIONS
    assert results == [tokens[:NEW_TOKENS] for tokens in expected]
    assert preemptions, "the budget held a third of the working set: some session must have been preempted"
    assert any(resuming for _, resuming in waits), "a preempted session queued to resume"
    assert target.kv_pool.blocks.num_blocks == BUDGET_BLOCKS
