"""A request's last round tells the verifier that no round follows it (so nothing is run ahead for it), whether
rounds go as Verify calls or are chained ahead of their verdicts (VerifyNext)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from transformers import AutoTokenizer

from coordinator.replicas import ReplicaPool
from coordinator.servicer import CoordinatorServicer
from coordinator.settings import CoordinatorSettings
from specdec.client import build_request
from specdec.serving.grpc_errors import ErrorMappingInterceptor
from specdec.serving.grpc_handlers import wrap_handler
from specdec.serving.wire import ends_after
from specdec.v1 import verifier_pb2_grpc
from verify_service.service import VerifyService
from verify_service.servicer import VerifierServicer
from verify_service.settings import VerifySettings

NEW_TOKENS = 6
ROUND_METHODS = ("/specdec.v1.Verifier/Verify", "/specdec.v1.Verifier/VerifyNext")


class RoundHints(grpc.aio.ServerInterceptor):
    """Records, in arrival order, whether each round call's hint says the request ends with it."""

    def __init__(self):
        self.ends: list[bool] = []

    def _record(self, request, context) -> contextlib.nullcontext:
        self.ends.append(ends_after(request.next_call))
        return contextlib.nullcontext()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        return wrap_handler(handler, self._record) if details.method in ROUND_METHODS else handler


@pytest.mark.parametrize("chain_rounds", [False, True])
def test_only_the_last_round_of_a_plain_request_says_the_request_ends(tiny_pair, tiny_pair_dirs, chain_rounds):
    target_dir, _ = tiny_pair_dirs
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    settings = CoordinatorSettings(adaptive_gamma=False, chain_rounds=chain_rounds, max_new_tokens_limit=100)
    request = build_request([1, 2, 3], max_new_tokens=NEW_TOKENS, num_speculative_tokens=0)
    hints = RoundHints()

    async def scenario() -> int:
        verifier = VerifierServicer(VerifyService(VerifySettings(), tiny_pair[0]))
        server = grpc.aio.server(interceptors=[hints, ErrorMappingInterceptor()])
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
    assert hints.ends == [False] * (NEW_TOKENS - 1) + [True]
