"""A request's last round tells the verifier that no round follows it (so nothing is run ahead for it), whether
rounds go as Verify calls or are chained ahead of their verdicts (VerifyNext)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from transformers import AutoTokenizer

from coordinator.replicas import ReplicaPool
from coordinator.servicer import CoordinatorServicer
from coordinator.settings import CoordinatorSettings
from specdec.client import build_request
from specdec.serving.grpc_errors import ErrorMappingInterceptor
from specdec.serving.wire import ends_after
from specdec.v1 import verifier_pb2_grpc
from verify_service.service import VerifyService
from verify_service.servicer import VerifierServicer
from verify_service.settings import VerifySettings

NEW_TOKENS = 6


class HintRecordingVerifier(VerifierServicer):
    """A verify servicer that records, in arrival order, whether each round call's hint says the request ends with
    it, however the call arrives (a unary call or a message of the session's call stream)."""

    def __init__(self, service: VerifyService):
        self.ends: list[bool] = []
        super().__init__(service)

    async def Verify(self, request, context):
        self.ends.append(ends_after(request.next_call))
        return await super().Verify(request, context)

    async def VerifyNext(self, request, context):
        self.ends.append(ends_after(request.next_call))
        return await super().VerifyNext(request, context)


@pytest.mark.parametrize("call_streams", [False, True])
@pytest.mark.parametrize("chain_rounds", [False, True])
def test_only_the_last_round_of_a_plain_request_says_the_request_ends(
    tiny_pair, tiny_pair_dirs, chain_rounds, call_streams
):
    target_dir, _ = tiny_pair_dirs
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    settings = CoordinatorSettings(
        adaptive_gamma=False, chain_rounds=chain_rounds, call_streams=call_streams, max_new_tokens_limit=100
    )
    request = build_request([1, 2, 3], max_new_tokens=NEW_TOKENS, num_speculative_tokens=0)
    verifier = HintRecordingVerifier(VerifyService(VerifySettings(), tiny_pair[0]))

    async def scenario() -> int:
        server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()])
        verifier_pb2_grpc.add_VerifierServicer_to_server(verifier, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        verify_pool = ReplicaPool("verify", [f"127.0.0.1:{port}"], verifier_pb2_grpc.VerifierStub)
        draft_pool = ReplicaPool("draft", ["127.0.0.1:9"], lambda channel: None)
        try:
            vocab_size = tiny_pair[0].vocab_size
            coordinator = CoordinatorServicer(settings, tokenizer, set(), vocab_size, draft_pool, verify_pool)
            reply = await coordinator.Generate(request, None)
            return len(reply.token_ids)
        finally:
            await asyncio.gather(draft_pool.close(), verify_pool.close())
            await server.stop(None)
            verifier.close()

    assert asyncio.run(scenario()) == NEW_TOKENS
    # the first token comes with the open; each later one from a round, the last of which says it ends the request
    assert verifier.ends == [False] * (NEW_TOKENS - 2) + [True]
