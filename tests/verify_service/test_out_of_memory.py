"""An out-of-memory error inside a verify step fails that step's calls alone (RESOURCE_EXHAUSTED): no session grows,
the reserved KV blocks go back, and the same service then serves requests token-identical to target-only."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from served_verifier import served

from specdec.decoding.reference_loop import target_only_generate
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.sampling.rules import SamplingParams
from specdec.serving.wire import sampling_to_proto
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verify_service.service import VerifyService
from verify_service.servicer import VerifierServicer
from verify_service.settings import VerifySettings

PROMPT = [5, 9, 14, 3, 22, 7]
NEW_TOKENS = 12


def fail_next_pass_out_of_memory(model: LoadedModel) -> None:
    """Makes the model's next forward raise torch.OutOfMemoryError in its second layer (once)."""

    def out_of_memory(module, args):
        hook.remove()
        raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 GiB")

    hook = model.model.model.layers[1].register_forward_pre_hook(out_of_memory)


async def decode(stub: verifier_pb2_grpc.VerifierStub, session_id: str, prompt: list[int], count: int) -> list[int]:
    """Opens a session and decodes `count` tokens by plain verify rounds (no draft): the target's greedy tokens."""
    request = verifier_pb2.OpenVerifySessionRequest(
        session_id=session_id, prompt_token_ids=prompt, sampling=sampling_to_proto(SamplingParams())
    )
    await stub.OpenSession(request, timeout=30)
    tokens: list[int] = []
    while len(tokens) < count:
        reply = await stub.Verify(
            verifier_pb2.VerifyRequest(session_id=session_id, base_len=len(prompt) + len(tokens)), timeout=30
        )
        tokens.append(reply.next_token_id)
    return tokens


@pytest.fixture
def target(tiny_pair_dirs) -> LoadedModel:
    return LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0])))


def test_an_out_of_memory_step_fails_its_calls_and_the_next_request_is_token_identical(target):
    expected = target_only_generate(target, PROMPT, SamplingParams(), NEW_TOKENS).token_ids
    service = VerifyService(VerifySettings(model=""), target)
    servicer = VerifierServicer(service)
    pool = target.kv_pool

    async def scenario() -> None:
        async with served(servicer) as stub:
            assert await decode(stub, "before", PROMPT, 2) == expected[:2]
            held = pool.blocks.used
            fail_next_pass_out_of_memory(target)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Verify(
                    verifier_pb2.VerifyRequest(
                        session_id="before", base_len=len(PROMPT) + 2, draft_token_ids=expected[2:5]
                    ),
                    timeout=30,
                )
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "out of memory" in refused.value.details()
            assert pool.blocks.used == held, "the failed step grew nothing"
            # the session that failed goes on from where it was; a new request is served in full
            reply = await stub.Verify(
                verifier_pb2.VerifyRequest(
                    session_id="before", base_len=len(PROMPT) + 2, draft_token_ids=expected[2:5]
                ),
                timeout=30,
            )
            assert list(reply.accepted_token_ids) + [reply.next_token_id] == expected[2:6]
            assert await decode(stub, "after", PROMPT, NEW_TOKENS) == expected
            for session_id in ("before", "after"):
                await stub.CloseSession(common_pb2.CloseSessionRequest(session_id=session_id), timeout=30)
            info = await stub.Info(common_pb2.InfoRequest(), timeout=30)
            assert (info.active_sessions, info.kv_blocks_used, info.kv_blocks_free) == (
                0,
                0,
                pool.blocks.num_blocks,
            )

    asyncio.run(scenario())
